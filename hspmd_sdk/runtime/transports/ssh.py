"""Launching onto remote hosts over SSH: :class:`SSHTransport`, :func:`check_hosts`, :func:`launch_remote`.

One SSH connection per host (asyncssh, on an event loop of the transport's own thread).  On each host the
transport starts the per-host agent (:mod:`.agent`) under ``setsid``; the agent spawns that host's workers, each in
its own process group, relays their protocol lines (whole lines, tagged with the rank) and their exits, and stops
them all on a ``kill`` message or when its stdin closes (the connection dropped, the kernel died).  The launch spec
travels on the agent's stdin: nothing has to exist on a remote host but Python, torch and hspmd_sdk.

Security: host keys are verified against a known_hosts file (``~/.ssh/known_hosts`` by default).  An unknown or
changed key refuses the connection.  ``accept_new_host_keys=True`` trusts a host *never seen before* (its key is
added to the known_hosts file) but still refuses a changed key; verification can never be turned off.  Client
keys come from ssh-agent and the default key files, or from ``client_keys=``; no password is ever sent.  Every
remote command is built by :func:`~hspmd_sdk.runtime.transports.hosts.remote_command`, every word quoted.

Stopping: ``Job.cancel()``, an interrupt in ``Job.wait()`` and the death of any worker stop every worker on every
host: the agent kills the process groups (SIGTERM, then SIGKILL); if an agent does not answer in time, a fresh
connection runs ``kill -KILL -- -PGID`` for its workers and itself.
"""
from __future__ import annotations

import asyncio
import json
import os
import queue
import shlex
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Coroutine, Mapping, Sequence, TypeVar

from ...errors import HSPMDError
from .agent import PREFIX as AGENT_PREFIX
from .hosts import HostsArg, HostTable, SSHHost, load_hosts, remote_command
from ..protocol import EXIT_ORPHANED, control_line
from ..spec import LaunchSpec
from .transport import ExitSink, LineSink, Transport, WorkerGroup

T = TypeVar("T")

#: Return code reported for a rank whose host connection was lost before it reported its exit.
EXIT_LOST = 255


class SSHError(HSPMDError):
    """A host could not be reached, authenticated or verified, or its agent did not start."""


class PreflightError(SSHError):
    """The hosts' preflight check failed; ``report`` says, per host, what is wrong."""

    def __init__(self, report: "PreflightReport") -> None:
        self.report = report
        super().__init__("preflight check failed, nothing was started:\n" + report.problems_text()
                         + "\n\n" + str(report))


def _asyncssh() -> Any:
    try:
        import asyncssh
    except ImportError:
        raise SSHError("remote launch needs asyncssh: pip install 'hspmd_sdk[remote]'") from None
    return asyncssh


# ---- the event loop thread ------------------------------------------------------------------------------------
class _LoopThread:
    """An asyncio loop on a daemon thread; ``run(coro, timeout)`` from any other thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="hspmd-ssh-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if threading.current_thread() is self.thread:
            raise RuntimeError("SSHTransport: a blocking call from its own event loop thread")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise

    def submit(self, coro: Coroutine[Any, Any, Any]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Cancel what still runs on the loop, shut its executor (name lookups), stop it, join the thread and
        close the loop (its selector and self-pipe): nothing of the transport outlives it."""
        if threading.current_thread() is self.thread:
            raise RuntimeError("SSHTransport.close() from its own event loop thread")

        async def drain() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.loop.shutdown_asyncgens()
            await self.loop.shutdown_default_executor()
        try:
            self.run(drain(), timeout=10)
        except Exception:  # noqa: BLE001 - closing is best effort; the loop is stopped below anyway
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


# ---- preflight --------------------------------------------------------------------------------------------------
_PROBE = r"""
import json, os, platform, shutil, socket, sys
from importlib import metadata, util
out = {"python": platform.python_version(), "executable": sys.executable, "hostname": socket.gethostname(),
       "cpus": os.cpu_count(), "setsid": bool(shutil.which("setsid")), "cwd": os.getcwd()}
try:
    import hspmd_sdk
    out["hspmd_sdk"] = hspmd_sdk.__version__
except Exception as e:
    out["hspmd_sdk_error"] = "%s: %s" % (type(e).__name__, e)
try:
    if util.find_spec("torch") is None:
        raise ImportError("No module named 'torch'")
    out["torch"] = metadata.version("torch")
    if sys.argv[1:] == ["cuda"]:  # importing torch takes seconds: only when the host must have GPUs
        import torch
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        out["cuda_devices"] = n
        out["device_names"] = [torch.cuda.get_device_name(i) for i in range(n)]
except Exception as e:
    out["torch_error"] = "%s: %s" % (type(e).__name__, e)
try:
    with open("/proc/meminfo") as f:
        out["mem_available"] = [int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:")][0]
except Exception:
    pass
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.bind(("", 0))
out["free_port"] = s.getsockname()[1]
s.close()
print("@probe " + json.dumps(out))
"""


@dataclass
class HostReport:
    """What the preflight found on one host."""

    host: str
    address: str
    port: int
    ranks: list[int]
    kind: str
    reachable: bool = False
    error: str | None = None
    python: str | None = None
    torch: str | None = None
    hspmd_sdk: str | None = None
    cuda_devices: int = 0
    device_names: list[str] = field(default_factory=list)
    cpus: int | None = None
    free_port: int | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.reachable and not self.problems

    def devices_text(self) -> str:
        if self.cuda_devices:
            names = sorted(set(self.device_names))
            return f"{self.cuda_devices} x {', '.join(names)}"
        return f"cpu ({self.cpus} cores)" if self.cpus else "-"


@dataclass
class PreflightReport:
    """Per-host preflight results; ``ok`` when every host passed."""

    hosts: list[HostReport]
    local_version: str

    @property
    def ok(self) -> bool:
        return all(h.ok for h in self.hosts)

    def __getitem__(self, host: str) -> HostReport:
        for h in self.hosts:
            if h.host == host:
                return h
        raise KeyError(host)

    def problems_text(self) -> str:
        return "\n".join(f"  {h.host} ({h.address}:{h.port}): {p}" for h in self.hosts for p in
                         ([h.error] if h.error else h.problems))

    def raise_if_failed(self) -> "PreflightReport":
        if not self.ok:
            raise PreflightError(self)
        return self

    def rows(self) -> list[list[str]]:
        return [[h.host, f"{h.address}:{h.port}", "yes" if h.reachable else "NO", h.python or "-", h.torch or "-",
                 h.hspmd_sdk or "-", h.devices_text(), f"{len(h.ranks)} x {h.kind}",
                 "ok" if h.ok else "; ".join([h.error] if h.error else h.problems)] for h in self.hosts]

    _HEAD = ["host", "ssh", "reachable", "python", "torch", "hspmd_sdk", "devices", "ranks", "status"]

    def __str__(self) -> str:
        rows = [self._HEAD, *self.rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(self._HEAD))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)

    def _repr_html_(self) -> str:
        import html

        cells = lambda row, tag: "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in row)  # noqa: E731
        body = "".join(f"<tr style='color:{'inherit' if h.ok else '#b00'}'>{cells(r, 'td')}</tr>"
                       for h, r in zip(self.hosts, self.rows()))
        return f"<table><tr>{cells(self._HEAD, 'th')}</tr>{body}</table>"


# ---- the transport ----------------------------------------------------------------------------------------------
class SSHTransport(Transport):
    """Starts each host's workers through one SSH connection and a per-host agent.

    For :func:`~.launcher.launch` (:class:`~.transport.Transport`): ``preflight`` probes every host
    (:meth:`check`), the rendezvous is on rank 0's host at a port free there, resources and threads come from the
    probes.

    ``hosts``: host name -> :class:`~hspmd_sdk.runtime.transports.hosts.SSHHost` (or its dict form); ``default``: settings
    of hosts not named.  ``known_hosts``: the file host keys are checked against (default
    ``~/.ssh/known_hosts``); ``accept_new_host_keys``: add the key of a host not in that file (a changed key is
    always refused).  ``client_keys``: private key files (default: ssh-agent and ``~/.ssh/id_*``);
    ``agent_path``: the ssh-agent socket (default ``$SSH_AUTH_SOCK``).  Timeouts in seconds; connections are
    retried ``connect_retries`` times with exponential backoff from ``backoff_s``.
    """

    def __init__(self, hosts: HostsArg = None, *, default: SSHHost | Mapping[str, Any] | None = None,
                 known_hosts: str | Path | None = None, accept_new_host_keys: bool = False,
                 client_keys: Sequence[str | Path] | None = None, agent_path: str | None = None,
                 connect_timeout_s: float = 10.0, connect_retries: int = 3, backoff_s: float = 0.5,
                 start_timeout_s: float = 60.0, kill_timeout_s: float = 5.0, keepalive_s: float = 5.0) -> None:
        self.hosts: HostTable = load_hosts(hosts, default=default)
        self.known_hosts = Path(known_hosts).expanduser() if known_hosts else Path("~/.ssh/known_hosts").expanduser()
        self.accept_new_host_keys = accept_new_host_keys
        self.client_keys = [str(Path(k).expanduser()) for k in client_keys] if client_keys is not None else None
        self.agent_path = agent_path
        self.connect_timeout_s = connect_timeout_s
        self.connect_retries = max(1, connect_retries)
        self.backoff_s = backoff_s
        self.start_timeout_s = start_timeout_s
        self.kill_timeout_s = kill_timeout_s
        self.keepalive_s = keepalive_s
        self._loop: _LoopThread | None = None
        self._conns: dict[str, Any] = {}
        self._conn_lock = threading.Lock()
        self._kh_lock = threading.Lock()
        self._probes: dict[str, dict[str, Any]] = {}
        self.groups: list[RemoteWorkers] = []

    # ---- plumbing ---------------------------------------------------------------------------------------------
    @property
    def loop(self) -> _LoopThread:
        with self._conn_lock:
            if self._loop is None:
                self._loop = _LoopThread()
            return self._loop

    def settings(self, host: str) -> SSHHost:
        return self.hosts[host]

    def where(self, host: str) -> str:
        s = self.settings(host)
        return f"{host} ({(s.user + '@') if s.user else ''}{s.address_of(host)}:{s.port})"

    def _known_hosts_entries(self) -> Any:
        """The known_hosts file, parsed; a file that cannot be read or parsed is an error naming it."""
        asyncssh = _asyncssh()
        try:
            text = self.known_hosts.read_text() if self.known_hosts.is_file() else ""
            return asyncssh.import_known_hosts(text)
        except (OSError, ValueError) as e:  # ValueError: not UTF-8, or an entry asyncssh cannot parse
            raise SSHError(f"known_hosts file {self.known_hosts}: cannot read it ({e}); fix or remove the bad "
                           "entries, or pass known_hosts= another file") from None

    def _loaded_client_keys(self) -> Any:
        """The client key files given, loaded; a missing or unreadable key is an error naming the file."""
        asyncssh = _asyncssh()
        assert self.client_keys is not None
        keys = []
        for path in self.client_keys:
            try:
                keys += asyncssh.load_keypairs([path])
            except (OSError, ValueError) as e:  # KeyImportError is a ValueError
                raise SSHError(f"client key {path}: cannot load it ({e}); pass client_keys= (CLI: -i) a private "
                               "key file without passphrase, or load it into ssh-agent") from None
        return keys

    def _options(self, host: str) -> dict[str, Any]:
        s = self.settings(host)
        opts: dict[str, Any] = dict(port=s.port, known_hosts=self._known_hosts_entries(),
                                    preferred_auth="publickey", password=None, kbdint_auth=False,
                                    connect_timeout=self.connect_timeout_s, login_timeout=self.connect_timeout_s,
                                    keepalive_interval=self.keepalive_s, keepalive_count_max=3)
        if s.user:
            opts["username"] = s.user
        if self.client_keys is not None:
            opts["client_keys"] = self._loaded_client_keys()
        if self.agent_path is not None:
            opts["agent_path"] = self.agent_path
        return opts

    async def _connect(self, host: str, *, accept_new: bool | None = None, retries: int | None = None) -> Any:
        asyncssh = _asyncssh()
        accept = self.accept_new_host_keys if accept_new is None else accept_new
        addr = self.settings(host).address_of(host)
        options = self._options(host)
        attempts = self.connect_retries if retries is None else retries
        last: BaseException | None = None
        for attempt in range(attempts):
            try:
                return await asyncssh.connect(addr, **options)
            except asyncssh.HostKeyNotVerifiable as e:
                if accept and await self._accept_new_key(host):
                    return await self._connect(host, accept_new=False)  # verify the key now recorded
                raise SSHError(self._host_key_message(host, e)) from None
            except asyncssh.PermissionDenied as e:
                raise SSHError(f"{self.where(host)}: public-key authentication failed ({e.reason}); add your key "
                               "to the host's authorized_keys, load it in ssh-agent or pass client_keys=[...] "
                               "(passwords are never used)") from None
            except (UnicodeError, ValueError) as e:
                raise SSHError(f"{self.where(host)}: cannot connect: {addr!r} is not a valid host name or "
                               f"address ({e})") from None
            except (OSError, asyncssh.Error, asyncio.TimeoutError) as e:
                last = e
                if attempt + 1 < attempts:
                    await asyncio.sleep(self.backoff_s * 2 ** attempt)
        raise SSHError(f"{self.where(host)}: cannot connect after {attempts} attempt{'s' if attempts > 1 else ''}: "
                       f"{type(last).__name__}: {last}") from None

    def _host_key_message(self, host: str, err: BaseException) -> str:
        s = self.settings(host)
        addr = s.address_of(host)
        target = addr if s.port == 22 else f"[{addr}]:{s.port}"
        known = self._known_entries(host)
        if known:
            return (f"{self.where(host)}: HOST KEY MISMATCH: the key the server offers is not the one recorded "
                    f"for {target} in {self.known_hosts} (someone may be intercepting the connection, or the host "
                    "was reinstalled). Nothing was started. If the change is expected, remove the old entry "
                    f"(ssh-keygen -R '{target}' -f {self.known_hosts}) and connect again.")
        return (f"{self.where(host)}: host key not verified: {target} is not in {self.known_hosts} ({err}). "
                f"Nothing was started. Check the host's key fingerprint and add it (e.g. ssh-keyscan -p {s.port} "
                f"{addr} >> {self.known_hosts}), or pass accept_new_host_keys=True to trust a host seen for the "
                "first time.")

    def _known_entries(self, host: str) -> list[Any]:
        s = self.settings(host)
        addr = s.address_of(host)
        keys, ca_keys, *_ = self._known_hosts_entries().match(addr, addr, s.port)
        return [*keys, *ca_keys]

    async def _accept_new_key(self, host: str) -> bool:
        """Record the key of a host with no entry at all (never one whose key changed); ``True`` if added."""
        asyncssh = _asyncssh()
        if self._known_entries(host):
            return False
        s = self.settings(host)
        addr = s.address_of(host)
        key = await asyncssh.get_server_host_key(addr, s.port)
        if key is None:
            return False
        target = addr if s.port == 22 else f"[{addr}]:{s.port}"
        line = f"{target} {key.export_public_key().decode().strip()}\n"
        with self._kh_lock:
            self.known_hosts.parent.mkdir(parents=True, exist_ok=True)
            with open(self.known_hosts, "a") as f:
                f.write(line)
        return True

    def connection(self, host: str) -> Any:
        """The (one) connection to ``host``, opened on first use."""
        with self._conn_lock:
            conn = self._conns.get(host)
            if conn is not None and not conn.is_closed():
                return conn
        conn = self.loop.run(self._connect(host), timeout=self.connect_timeout_s * (self.connect_retries + 1) * 2
                             + 10)
        with self._conn_lock:
            old = self._conns.get(host)
            if old is not None and not old.is_closed():
                self.loop.submit(_close_conn(conn))
                return old
            self._conns[host] = conn
        return conn

    def run_command(self, host: str, command: str, timeout_s: float = 60.0) -> tuple[int | None, str, str]:
        """Run one command (already quoted) on ``host`` over its connection: exit status, stdout, stderr."""
        conn = self.connection(host)

        async def go() -> tuple[int | None, str, str]:
            r = await asyncio.wait_for(conn.run(command, check=False), timeout_s)
            return r.exit_status, str(r.stdout or ""), str(r.stderr or "")
        return self.loop.run(go(), timeout=timeout_s + 5)

    # ---- preflight ---------------------------------------------------------------------------------------------
    def check(self, cluster: Any, timeout_s: float = 60.0) -> PreflightReport:
        """Probe every host of ``cluster`` (in parallel): reachable, Python, torch, hspmd_sdk, devices."""
        import hspmd_sdk

        reports = [HostReport(host=n.host, address=self.settings(n.host).address_of(n.host),
                              port=self.settings(n.host).port, ranks=list(n.ranks), kind=n.kind)
                   for n in cluster.nodes]
        per_host: dict[str, list[HostReport]] = {}
        for rep in reports:
            per_host.setdefault(rep.host, []).append(rep)
        threads = [threading.Thread(target=self._probe_into, args=(host, reps, timeout_s), daemon=True)
                   for host, reps in per_host.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s + 30)
        report = PreflightReport(_merge_nodes(reports), hspmd_sdk.__version__)
        torches = {h.torch for h in report.hosts if h.torch}
        for h in report.hosts:
            if h.reachable and h.hspmd_sdk and h.hspmd_sdk != report.local_version:
                h.problems.append(f"hspmd_sdk {h.hspmd_sdk} differs from this kernel's {report.local_version}: "
                                  "install the same version on every host")
            if h.reachable and len(torches) > 1:
                h.problems.append(f"torch versions differ between hosts ({', '.join(sorted(torches))})")
        return report

    def _probe_into(self, host: str, reps: list[HostReport], timeout_s: float) -> None:
        s = self.settings(host)
        gpu = any(rep.kind.lower() != "cpu" for rep in reps)
        try:
            rc, out, err = self.run_command(host, remote_command(s, ["-c", _PROBE, "cuda" if gpu else "cpu"]),
                                            timeout_s)
        except SSHError as e:
            for rep in reps:
                rep.error = str(e).removeprefix(self.where(host) + ": ")
            return
        except BaseException as e:  # noqa: BLE001 - a timeout or a dropped connection: report it per host
            for rep in reps:
                rep.error = f"probe failed: {type(e).__name__}: {e}"
            return
        info: dict[str, Any] | None = None
        for line in out.splitlines():
            if line.startswith("@probe "):
                info = json.loads(line[len("@probe "):])
        for rep in reps:
            rep.reachable = True
            if info is None:
                tail = (err.strip().splitlines() or ["no output"])[-1]
                rep.problems.append(f"cannot run Python {' '.join(s.python_argv())!r}"
                                    + (f" in {s.workdir!r}" if s.workdir else "") + f" (exit status {rc}): {tail}")
                continue
            self._probes[host] = info
            rep.python, rep.torch, rep.hspmd_sdk = info.get("python"), info.get("torch"), info.get("hspmd_sdk")
            rep.cuda_devices, rep.device_names = int(info.get("cuda_devices") or 0), info.get("device_names") or []
            rep.cpus, rep.free_port = info.get("cpus"), info.get("free_port")
            if "hspmd_sdk_error" in info:
                rep.problems.append(f"hspmd_sdk is not importable by {info['executable']}: {info['hspmd_sdk_error']}")
            if "torch_error" in info:
                rep.problems.append(f"torch is not importable by {info['executable']}: {info['torch_error']}")
            if not info.get("setsid"):
                rep.problems.append("the 'setsid' command (util-linux) is missing")
            if rep.kind.lower() != "cpu" and rep.cuda_devices < len(rep.ranks):
                rep.problems.append(f"the cluster puts {len(rep.ranks)} {rep.kind} ranks on this host but it has "
                                    f"{rep.cuda_devices} CUDA devices")

    def probe(self, host: str) -> dict[str, Any]:
        """The preflight facts of ``host`` (probing it now if it was not probed yet)."""
        if host not in self._probes:
            rep = HostReport(host, self.settings(host).address_of(host), self.settings(host).port, [], "cpu")
            self._probe_into(host, [rep], 60.0)
            if not rep.ok:
                raise SSHError(f"{self.where(host)}: {rep.error or '; '.join(rep.problems)}")
        return self._probes[host]

    local = False

    def preflight(self, cluster: Any) -> None:
        """Every host reachable, with the launcher's Python, torch and hspmd_sdk (:meth:`check`), or raise."""
        self.check(cluster).raise_if_failed()

    def threads_per_worker(self, cluster: Any) -> int | None:
        return _threads_per_worker(self, cluster)

    def host_facts(self, host: str, *, cuda: bool = False) -> Any:
        """Cores, available RAM and CUDA devices of ``host``, from its preflight probe (empty if not probed)."""
        from ..control.preflight import HostFacts

        info = self._probes.get(host, {})
        return HostFacts(cpus=info.get("cpus"), mem_available=info.get("mem_available"),
                         gpus=info.get("cuda_devices"))

    def rendezvous(self, host: str, *, fresh: bool = False) -> tuple[str, int]:
        """Address and a free port on ``host`` for the job's rendezvous store (rank 0 runs there).  ``fresh``: probe the
        host again for a port free *now* (a re-formed world's rendezvous: the first store may still hold its port)."""
        if fresh:
            self._probes.pop(host, None)
        return self.settings(host).address_of(host), int(self.probe(host)["free_port"])

    # ---- workers -----------------------------------------------------------------------------------------------
    def start(self, host: str, ranks: Sequence[int], spec: LaunchSpec, on_line: LineSink,
              on_exit: ExitSink) -> "RemoteWorkers":
        conn = self.connection(host)
        cmd = remote_command(self.settings(host), ["-m", "hspmd_sdk.runtime.transports.agent", f"--host={host}",
                                                   f"--job={spec.job_id}"], setsid=True)
        group = RemoteWorkers(self, host, list(ranks), on_line, on_exit, heartbeat_s=spec.heartbeat_s,
                              loop=self.loop)
        start_msg = json.dumps({"t": "start", "ranks": list(ranks), "spec": spec.to_line()}) + "\n"
        self.groups.append(group)
        try:
            self.loop.run(group.open(conn, cmd, start_msg), timeout=self.start_timeout_s + 5)
            group.wait_started(self.start_timeout_s)
        except BaseException:
            group.kill(grace_s=0)
            raise
        return group

    def kill_process_groups(self, host: str, pgids: Sequence[int], timeout_s: float = 10.0,
                            retries: int | None = None) -> None:
        """Fallback: SIGKILL process groups on ``host`` over a fresh connection (``retries`` attempts to connect,
        default ``connect_retries``)."""
        if not pgids:
            return
        cmd = "kill -KILL -- " + " ".join(shlex.quote(f"-{int(p)}") for p in pgids) + " 2>/dev/null; true"
        attempts = self.connect_retries if retries is None else max(1, retries)

        async def go() -> None:
            conn = await self._connect(host, retries=attempts)
            try:
                await asyncio.wait_for(conn.run(cmd, check=False), timeout_s)
            finally:
                await _close_conn(conn)
        self.loop.run(go(), timeout=timeout_s + self.connect_timeout_s * attempts * 2 + 10)

    def close(self) -> None:
        """Close every connection (agents still running see their stdin close and stop their workers), then the
        event loop and its thread.  Idempotent; the transport can be used again (it reconnects)."""
        with self._conn_lock:
            conns, self._conns = list(self._conns.values()), {}
            loop, self._loop = self._loop, None
        if loop is None:
            return

        async def go() -> None:
            await asyncio.gather(*(_close_conn(c) for c in conns), return_exceptions=True)
        try:
            loop.run(go(), timeout=10)
        except Exception:  # noqa: BLE001 - closing is best effort
            pass
        loop.close()


async def _close_conn(conn: Any) -> None:
    conn.close()
    try:
        await asyncio.wait_for(conn.wait_closed(), 5)
    except Exception:  # noqa: BLE001
        pass


def _merge_nodes(reports: list[HostReport]) -> list[HostReport]:
    """One report per host (a host named by several nodes gets all their ranks)."""
    out: dict[str, HostReport] = {}
    for r in reports:
        if r.host in out:
            out[r.host].ranks += r.ranks
        else:
            out[r.host] = r
    return list(out.values())


class RemoteWorkers(WorkerGroup):
    """The workers of one host, run by its agent over the host's SSH connection.

    Lines and exits arrive on the event loop and are handed to the job's callbacks by a dispatcher thread of
    their own (in order; a slow callback never stalls the connection).  The group pings the agent every
    ``heartbeat_s`` seconds and notes when it last heard anything from it (:meth:`link_silence`); ranks whose exit
    the agent could not report (its connection ended, or it never answered a kill) are :meth:`lost`.
    """

    def __init__(self, transport: SSHTransport, host: str, ranks: list[int], on_line: LineSink,
                 on_exit: ExitSink, *, heartbeat_s: float = 1.0, loop: _LoopThread | None = None) -> None:
        self.transport = transport
        self._loop = loop or transport.loop  # the loop its channel lives on (closed with the transport)
        self.host = host
        self.ranks = ranks
        self.heartbeat_s = heartbeat_s
        self._on_line, self._on_exit = on_line, on_exit
        self._proc: Any = None
        self._lock = threading.Lock()
        self._pids: dict[int, int] = {}
        self._rc: dict[int, int] = {}
        self._lost: dict[int, str] = {}
        self._killed_by_agent: set[int] = set()
        self._escalated: set[int] = set()
        self._killing: set[int] = set()
        self._stopping = False
        self._started = threading.Event()
        self._all_exited = threading.Event()
        self._fatal: str | None = None
        self._fallback = False
        self._last_heard: float | None = None
        self.agent_pid: int | None = None
        self.agent_pgid: int | None = None
        self.agent_stderr: list[str] = []
        self._queue: queue.Queue[tuple[str, int, Any, Any] | None] = queue.Queue()
        self._dispatcher = threading.Thread(target=self._dispatch, name=f"hspmd-ssh-{host}", daemon=True)
        self._dispatcher.start()

    # ---- event loop side ---------------------------------------------------------------------------------------
    async def open(self, conn: Any, cmd: str, start_msg: str) -> None:
        self._proc = await conn.create_process(cmd, encoding="utf-8", errors="replace")
        self._last_heard = time.monotonic()
        self._proc.stdin.write(start_msg)
        await self._proc.stdin.drain()
        loop = asyncio.get_running_loop()
        loop.create_task(self._read_stdout())
        loop.create_task(self._read_stderr())
        loop.create_task(self._ping())

    async def _ping(self) -> None:
        line = control_line("ping")
        while not self._all_exited.is_set():
            await asyncio.sleep(self.heartbeat_s)
            try:
                self._proc.stdin.write(line)  # buffered by asyncssh when the window is full: never blocks
            except Exception:  # noqa: BLE001 - the channel is closed: the reader reports it
                return

    async def _read_stdout(self) -> None:
        pending = ""  # readline returns part of a line longer than the channel's window: join the parts
        try:
            while True:
                part = await self._proc.stdout.readline()
                if not part:
                    break
                self._last_heard = time.monotonic()
                pending += part
                if pending.endswith("\n"):
                    line, pending = pending, ""
                    self._handle(line.rstrip("\r\n"))
            if pending:
                self._handle(pending.rstrip("\r\n"))
        except Exception as e:  # noqa: BLE001 - the connection dropped
            self.agent_stderr.append(f"connection error: {type(e).__name__}: {e}")
        status = None
        try:
            await asyncio.wait_for(self._proc.wait_closed(), 2)
            status = self._proc.returncode
        except Exception:  # noqa: BLE001 - no exit status: the connection itself is gone
            pass
        self._connection_ended(status)

    async def _read_stderr(self) -> None:
        try:
            while True:
                line = await self._proc.stderr.readline()
                if not line:
                    break
                self._last_heard = time.monotonic()
                self.agent_stderr = (self.agent_stderr + [line.rstrip("\r\n")])[-30:]
        except Exception:  # noqa: BLE001
            pass

    def _handle(self, line: str) -> None:
        if not line.startswith(AGENT_PREFIX):
            self.agent_stderr = (self.agent_stderr + [line])[-30:]
            return
        try:
            msg = json.loads(line[len(AGENT_PREFIX):])
        except (ValueError, RecursionError):
            return
        kind = msg.get("t")
        if kind == "line":
            self._queue.put(("line", int(msg["rank"]), msg.get("s", "out"), msg.get("x", "")))
        elif kind == "exit":
            rank, rc = int(msg["rank"]), int(msg["rc"])
            if msg.get("killed"):
                with self._lock:
                    self._killed_by_agent.add(rank)
            self._record_exit(rank, rc)
        elif kind == "started":
            with self._lock:
                self._pids[int(msg["rank"])] = int(msg["pid"])
                if set(self._pids) >= set(self.ranks):
                    self._started.set()
        elif kind == "ready":
            self.agent_pid, self.agent_pgid = int(msg["pid"]), int(msg["pgid"])
        elif kind == "fatal":
            self._fatal = str(msg.get("message"))
            self._started.set()

    def _record_exit(self, rank: int, rc: int, note: str | None = None, lost: str | None = None) -> None:
        with self._lock:
            if rank in self._rc or rank not in self.ranks:
                return
            self._rc[rank] = rc
            if lost is not None:
                self._lost[rank] = lost
            done = set(self._rc) >= set(self.ranks)
        if note:
            self._queue.put(("line", rank, "err", note))
        self._queue.put(("exit", rank, rc, None))
        if done:
            self._all_exited.set()
            self._queue.put(None)

    def _connection_ended(self, status: int | None = None) -> None:
        """The agent's channel closed: every rank that did not report its exit is lost."""
        self._started.set()
        with self._lock:
            missing = [r for r in self.ranks if r not in self._rc]
            if not missing or self._fallback:
                return  # kill() is killing the process groups itself and records their exits
        tail = "\n".join(self.agent_stderr[-10:])
        why = (f"its agent exited with status {status} before its ranks reported their exits" if status is not None
               else "its SSH connection closed before its ranks reported their exits")
        note = f"[launcher] {self.transport.where(self.host)}: {why}" + (f"; agent output:\n{tail}" if tail else "")
        for r in missing:
            self._record_exit(r, EXIT_LOST, note, lost=why)

    # ---- dispatcher thread -------------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            kind, rank, a, b = item
            try:
                if kind == "line":
                    self._on_line(rank, a, b)
                else:
                    self._on_exit(rank, a)
            except Exception:  # noqa: BLE001 - a bug in a handler must not stop the others
                import traceback

                traceback.print_exc()

    # ---- WorkerGroup -------------------------------------------------------------------------------------------
    def wait_started(self, timeout_s: float) -> None:
        if not self._started.wait(timeout_s):
            raise SSHError(f"{self.transport.where(self.host)}: the agent did not start the workers within "
                           f"{timeout_s:g} s" + self._stderr_hint())
        if self._fatal or set(self._pids) < set(self.ranks):
            raise SSHError(f"{self.transport.where(self.host)}: the agent could not start the workers: "
                           f"{self._fatal or 'it exited early'}" + self._stderr_hint())

    def _stderr_hint(self) -> str:
        tail = "\n".join(self.agent_stderr[-10:])
        return f"\nagent output:\n{tail}" if tail else ""

    def poll(self) -> dict[int, int | None]:
        with self._lock:
            return {r: self._rc.get(r) for r in self.ranks}

    def pids(self) -> dict[int, int]:
        with self._lock:
            return dict(self._pids)

    def link_silence(self) -> float:
        if self._last_heard is None or self._all_exited.is_set():
            return 0.0
        return time.monotonic() - self._last_heard

    def lost(self, rank: int) -> str | None:
        with self._lock:
            return self._lost.get(rank)

    def stopped_by_kill(self, rank: int, returncode: int) -> bool:
        with self._lock:
            return rank in self._killing and (returncode in (-signal.SIGTERM, EXIT_ORPHANED)
                                              or rank in self._killed_by_agent or rank in self._escalated)

    def _send(self, msg: dict[str, Any]) -> None:
        """Queue one line to the agent (never blocks; a closed channel is the reader's to report)."""
        proc = self._proc
        if proc is None:
            return
        line = json.dumps(msg, separators=(",", ":")) + "\n"

        def write() -> None:
            try:
                proc.stdin.write(line)
            except Exception:  # noqa: BLE001
                pass
        try:
            self._loop.loop.call_soon_threadsafe(write)
        except RuntimeError:
            pass  # the loop is closed: the job is over

    def send_control(self, msg: dict[str, Any], ranks: Sequence[int]) -> None:
        self._send({"t": "control", "ranks": list(ranks), "msg": msg})

    def dump_stack(self, rank: int) -> None:
        self._send({"t": "dump", "rank": int(rank)})

    def kill(self, grace_s: float = 0.5, ranks: Sequence[int] | None = None) -> None:
        """Ask the agent to stop the workers (``ranks``, default all); if it does not answer in time, SIGKILL their
        process groups over a fresh connection; if the host cannot be reached at all, the ranks are lost."""
        with self._lock:
            targets = [r for r in self.ranks if (ranks is None or r in ranks) and r not in self._rc]
            self._killing |= set(self.ranks if ranks is None else ranks)
            self._stopping = self._stopping or ranks is None
            if not targets:
                return
        proc = self._proc
        if proc is not None:
            msg = {"t": "kill", "grace": grace_s, "ranks": None if ranks is None else targets}
            try:
                self._loop.run(_write(proc, json.dumps(msg) + "\n"), timeout=5)
            except Exception:  # noqa: BLE001 - the channel is gone: the fallback below does the job
                pass
        if proc is not None and self._exited_within(targets, grace_s + self.transport.kill_timeout_s):
            return
        with self._lock:
            self._fallback = self._fallback or ranks is None
            pgids = [self._pids[r] for r in targets if r in self._pids and r not in self._rc]
        if self.agent_pgid is not None and ranks is None:
            pgids.append(self.agent_pgid)
        unreachable = None
        try:
            self.transport.kill_process_groups(self.host, pgids, timeout_s=self.transport.kill_timeout_s + 5,
                                               retries=1)
        except Exception as e:  # noqa: BLE001
            unreachable = f"{type(e).__name__}: {e}"
            self.agent_stderr.append(f"fallback kill failed: {unreachable}")
        with self._lock:
            missing = [r for r in targets if r not in self._rc]
            self._escalated |= set(missing)
        for r in missing:
            if unreachable is not None:
                why = (f"its agent did not answer and the host could not be reached to kill rank {r} "
                       f"({unreachable})")
                self._record_exit(r, EXIT_LOST, f"[launcher] {self.host}: {why}", lost=why)
            else:
                note = (f"[launcher] rank {r} killed over a fresh SSH connection (its agent on {self.host} did "
                        "not answer)" if r in self._pids else f"[launcher] rank {r} never started on {self.host}")
                self._record_exit(r, -signal.SIGKILL, note)
        if proc is not None and ranks is None:
            try:
                self._loop.run(_close_proc(proc), timeout=5)
            except Exception:  # noqa: BLE001
                pass

    def _exited_within(self, ranks: Sequence[int], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if all(r in self._rc for r in ranks):
                    return True
            self._all_exited.wait(0.05)
        return False

    def join(self, timeout: float | None = None) -> None:
        self._dispatcher.join(timeout)


async def _write(proc: Any, text: str) -> None:
    proc.stdin.write(text)
    await asyncio.wait_for(proc.stdin.drain(), 5)


async def _close_proc(proc: Any) -> None:
    proc.close()


# ---- the user-facing functions ---------------------------------------------------------------------------------
def check_hosts(cluster: Any, hosts: HostsArg = None, *, transport: SSHTransport | None = None,
                **ssh_options: Any) -> PreflightReport:
    """Check every host of ``cluster`` before starting anything: reachable over SSH (key verified), Python and
    torch versions, hspmd_sdk version equal to this kernel's, CUDA device count and names.

    ``hosts``/``ssh_options``: as for :class:`SSHTransport` (or pass a ``transport``).  The report prints as a
    table (HTML in a notebook); ``report.ok``; ``report.raise_if_failed()``.
    """
    own = transport is None
    transport = transport or SSHTransport(hosts, **ssh_options)
    try:
        return transport.check(cluster)
    finally:
        if own:
            transport.close()


def _threads_per_worker(transport: SSHTransport, cluster: Any) -> int:
    counts: dict[str, int] = {}
    for n in cluster.nodes:
        counts[n.host] = counts.get(n.host, 0) + len(n.ranks)
    per = [max(1, int(transport._probes.get(h, {}).get("cpus") or os.cpu_count() or 1) // c)
           for h, c in counts.items()]
    return max(1, min(per))


