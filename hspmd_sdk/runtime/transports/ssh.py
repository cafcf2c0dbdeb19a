"""Launching onto remote hosts over SSH: :class:`SSHTransport` and :func:`check_hosts`.

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

The parts: this module is the transport (connections, host keys, starting and stopping); the preflight probe
and its report are :mod:`.ssh_probe`; the launcher's end of each host's agent (:class:`RemoteWorkers`, the event
loop thread) is :mod:`.ssh_workers`; the agent itself, which runs on the host, is :mod:`.agent`.
"""
from __future__ import annotations

import asyncio
import json
import shlex
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..spec import LaunchSpec
from .hosts import HostsArg, HostTable, SSHError, SSHHost, load_hosts, remote_command
from .ssh_probe import PreflightError, PreflightReport, HostReport, check_cluster, probe_into, threads_per_worker
from .ssh_workers import LoopThread, RemoteWorkers
from .transport import ExitSink, LineSink, Transport
from ..control.preflight import HostFacts

if TYPE_CHECKING:
    import types

    import asyncssh

    from ...core.cluster import Cluster

__all__ = ["SSHTransport", "check_hosts", "SSHError", "PreflightError", "PreflightReport", "RemoteWorkers"]


def _asyncssh() -> "types.ModuleType":
    try:
        import asyncssh
    except ImportError:
        raise SSHError("remote launch needs asyncssh: pip install 'hspmd_sdk[remote]'") from None
    return asyncssh


class SSHTransport(Transport):
    """Starts each host's workers through one SSH connection and a per-host agent.

    For :func:`~hspmd_sdk.runtime.control.launcher.launch_entry` (:class:`~.transport.Transport`): ``preflight`` probes every host
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
        self._loop: LoopThread | None = None
        self._conns: dict[str, Any] = {}
        self._conn_lock = threading.Lock()
        self._kh_lock = threading.Lock()
        self.probes: dict[str, dict[str, Any]] = {}
        self.groups: list[RemoteWorkers] = []

    # ---- plumbing ---------------------------------------------------------------------------------------------
    @property
    def loop(self) -> LoopThread:
        with self._conn_lock:
            if self._loop is None:
                self._loop = LoopThread()
            return self._loop

    def settings(self, host: str) -> SSHHost:
        return self.hosts[host]

    def where(self, host: str) -> str:
        s = self.settings(host)
        return f"{host} ({(s.user + '@') if s.user else ''}{s.address_of(host)}:{s.port})"

    def _known_hosts_entries(self) -> "asyncssh.SSHKnownHosts":
        """The known_hosts file, parsed; a file that cannot be read or parsed is an error naming it."""
        asyncssh = _asyncssh()
        try:
            text = self.known_hosts.read_text() if self.known_hosts.is_file() else ""
            return asyncssh.import_known_hosts(text)
        except (OSError, ValueError) as e:  # ValueError: not UTF-8, or an entry asyncssh cannot parse
            raise SSHError(f"known_hosts file {self.known_hosts}: cannot read it ({e}); fix or remove the bad "
                           "entries, or pass known_hosts= another file") from None

    def _loaded_client_keys(self) -> "list[asyncssh.SSHKeyPair]":
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

    async def _connect(self, host: str, *, accept_new: bool | None = None, retries: int | None = None
                       ) -> "asyncssh.SSHClientConnection":
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

    def _known_entries(self, host: str) -> "list[asyncssh.SSHKey]":
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

    def connection(self, host: str) -> "asyncssh.SSHClientConnection":
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
    def check(self, cluster: "Cluster", timeout_s: float = 60.0) -> PreflightReport:
        """Probe every host of ``cluster`` (in parallel): reachable, Python, torch, hspmd_sdk, devices
        (:func:`~.ssh_probe.check_cluster`)."""
        return check_cluster(self, cluster, timeout_s)

    def probe(self, host: str) -> dict[str, Any]:
        """The preflight facts of ``host`` (probing it now if it was not probed yet)."""
        if host not in self.probes:
            rep = HostReport(host, self.settings(host).address_of(host), self.settings(host).port, [], "cpu")
            probe_into(self, host, [rep], 60.0)
            if not rep.ok:
                raise SSHError(f"{self.where(host)}: {rep.error or '; '.join(rep.problems)}")
        return self.probes[host]

    local = False

    def preflight(self, cluster: "Cluster") -> None:
        """Every host reachable, with the launcher's Python, torch and hspmd_sdk (:meth:`check`), or raise."""
        self.check(cluster).raise_if_failed()

    def threads_per_worker(self, cluster: "Cluster") -> int | None:
        return threads_per_worker(self.probes, cluster)

    def host_facts(self, host: str, *, cuda: bool = False) -> HostFacts:
        """Cores, available RAM and CUDA devices of ``host``, from its preflight probe (empty if not probed)."""

        info = self.probes.get(host, {})
        return HostFacts(cpus=info.get("cpus"), mem_available=info.get("mem_available"),
                         gpus=info.get("cuda_devices"))

    def rendezvous(self, host: str, *, fresh: bool = False) -> tuple[str, int]:
        """Address and a free port on ``host`` for the job's rendezvous store (rank 0 runs there).  ``fresh``: probe the
        host again for a port free *now* (a re-formed world's rendezvous: the first store may still hold its port)."""
        if fresh:
            self.probes.pop(host, None)
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


async def _close_conn(conn: "asyncssh.SSHClientConnection") -> None:
    conn.close()
    try:
        await asyncio.wait_for(conn.wait_closed(), 5)
    except Exception:  # noqa: BLE001
        pass


def check_hosts(cluster: "Cluster", hosts: HostsArg = None, *, transport: SSHTransport | None = None,
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
