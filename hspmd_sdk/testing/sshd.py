"""Throw-away SSH "hosts" on loopback addresses, for tests and the remote-launch tutorial.

:class:`LoopbackSSHD` runs one OpenSSH server (``/usr/sbin/sshd -D``) on a loopback address (``127.0.0.2``,
``127.0.0.3``, ...: the whole of ``127.0.0.0/8`` is this machine) and a free port, with its own host key, key-only
login for the current user with a client key made for the purpose, and everything (config, keys, pid file, log)
in a temporary folder that :meth:`LoopbackSSHD.stop` removes.  :class:`LoopbackHosts` starts several of them and
gives what :func:`~hspmd_sdk.runtime.control.launcher.launch_remote` needs: a cluster whose host names are the addresses, the
per-host settings (Python = this interpreter), the client key and a known_hosts file with their host keys::

    with LoopbackHosts(2, ranks_per_host=2) as lab:
        job = launch(None, lab.cluster, hosts=lab.hosts, **lab.ssh_options, entry=..., steps=2)

Nothing listens beyond loopback.  Needs ``openssh-server`` (``apt-get install openssh-server``); sshd is started
by this helper, never as a system service.
"""
from __future__ import annotations

import atexit
import getpass
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..core.cluster import Cluster

SSHD = "/usr/sbin/sshd"


def sshd_available() -> bool:
    return Path(SSHD).is_file() and shutil.which("ssh-keygen") is not None


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies (Linux), so that a crashed test
    or notebook kernel leaves no sshd behind."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 15)  # PR_SET_PDEATHSIG, SIGTERM
    except (OSError, AttributeError):
        pass


def make_key(path: Path) -> Path:
    """An ed25519 key pair without passphrase at ``path`` / ``path.pub`` (made once)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "hspmd-test", "-f", str(path)],
                       check=True, timeout=30)
    return path


class LoopbackSSHD:
    """One sshd on ``address``:``port`` (a free port by default), accepting ``client_key`` only."""

    def __init__(self, address: str, client_key: Path, *, port: int | None = None, netns: str | None = None) -> None:
        if not address.startswith("127.") and netns is None:
            raise ValueError(f"LoopbackSSHD listens on loopback addresses only (127.x.y.z), not {address!r}, "
                             "unless it runs in a network namespace of its own (netns=)")
        self.address = address
        self.port = port
        self.netns = netns
        self.client_key = Path(client_key)
        self.dir = Path(tempfile.mkdtemp(prefix="hspmd-sshd-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.host_key = make_key(self.dir / "host_ed25519")

    def _config(self, port: int) -> Path:
        user = getpass.getuser()
        (self.dir / "authorized_keys").write_text(Path(str(self.client_key) + ".pub").read_text())
        cfg = self.dir / "sshd_config"
        cfg.write_text("\n".join([
            f"Port {port}", f"ListenAddress {self.address}", f"HostKey {self.host_key}",
            f"PidFile {self.dir / 'sshd.pid'}", f"AuthorizedKeysFile {self.dir / 'authorized_keys'}",
            "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password", f"AllowUsers {user}", "StrictModes no", "UsePAM no",
            "PrintMotd no", "MaxStartups 64", "MaxSessions 64", "LogLevel ERROR", "",
        ]))
        return cfg

    def start(self, timeout_s: float = 15.0) -> "LoopbackSSHD":
        """Start sshd and wait (with backoff) until it accepts connections; retry another port if it cannot bind."""
        Path("/run/sshd").mkdir(parents=True, exist_ok=True) if os.geteuid() == 0 else None  # privsep dir
        for _attempt in range(5):
            port = self.port or _free_port(self.address)
            log = open(self.dir / "sshd.log", "ab")
            prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
            self.proc = subprocess.Popen([*prefix, SSHD, "-D", "-e", "-f", str(self._config(port))], stdout=log,
                                         stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=_die_with_parent)
            log.close()
            if self._wait_listening(port, timeout_s):
                self.port = port
                atexit.register(self.stop)
                return self
            self._terminate()
        raise RuntimeError(f"sshd on {self.address} did not start; its log:\n{self.log()}")

    def _wait_listening(self, port: int, timeout_s: float) -> bool:
        deadline, delay = time.monotonic() + timeout_s, 0.01
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection((self.address, port), timeout=1):
                    return True
            except OSError:
                time.sleep(delay)
                delay = min(0.3, delay * 2)
        return False

    def log(self) -> str:
        try:
            return (self.dir / "sshd.log").read_text(errors="replace")
        except OSError:
            return ""

    def known_hosts_line(self) -> str:
        key = " ".join(Path(str(self.host_key) + ".pub").read_text().split()[:2])
        target = self.address if self.port == 22 else f"[{self.address}]:{self.port}"
        return f"{target} {key}\n"

    def _terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 15)  # the listener and its connection children share this group
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(5)
        self.proc = None

    def stop(self) -> None:
        """Stop the server and remove its folder."""
        atexit.unregister(self.stop)
        self._terminate()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LoopbackSSHD":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.proc is not None and self.proc.poll() is None else "stopped"
        return f"LoopbackSSHD({self.address}:{self.port}, {state})"


class LoopbackHosts:
    """``n`` loopback SSH hosts ``127.0.0.2``, ``127.0.0.3``, ... with a cluster of ``ranks_per_host`` CPU ranks each.

    ``cluster``: the Cluster (host names = addresses); ``hosts``: host -> SSHHost settings (port; Python = this
    interpreter; ``env`` keeps gloo on the loopback interface); ``ssh_options``: ``known_hosts`` (a file with
    the servers' keys, unless ``trust=False``) and ``client_keys``.
    """

    def __init__(self, n: int = 2, *, ranks_per_host: int = 2, first: int = 2, trust: bool = True,
                 workdir: str | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="hspmd-lab-"))
        self.client_key = make_key(self.dir / "id_ed25519")
        self.known_hosts = self.dir / "known_hosts"
        self.servers = [LoopbackSSHD(f"127.0.0.{first + i}", self.client_key) for i in range(n)]
        self.ranks_per_host = ranks_per_host
        self.trust = trust
        self.workdir = workdir

    def start(self) -> "LoopbackHosts":
        try:
            for s in self.servers:
                s.start()
        except BaseException:
            self.stop()
            raise
        self.known_hosts.write_text("".join(s.known_hosts_line() for s in self.servers) if self.trust else "")
        return self

    @property
    def cluster(self) -> Any:
        k = self.ranks_per_host
        return Cluster.load({"nodes": [{"host": s.address, "kind": "cpu", "ranks": list(range(i * k, (i + 1) * k))}
                                       for i, s in enumerate(self.servers)]})

    @property
    def hosts(self) -> dict[str, dict[str, Any]]:
        return {s.address: {"port": s.port, "python": sys.executable, "env": {"GLOO_SOCKET_IFNAME": "lo"},
                            **({"workdir": self.workdir} if self.workdir else {})} for s in self.servers}

    @property
    def ssh_options(self) -> dict[str, Any]:
        return {"known_hosts": str(self.known_hosts), "client_keys": [str(self.client_key)]}

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LoopbackHosts":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LoopbackHosts({', '.join(f'{s.address}:{s.port}' for s in self.servers)})"


class NetnsHosts(LoopbackHosts):
    """``n`` hosts in network namespaces of their own, joined by veth pairs to a bridge in this namespace.

    Each host has its own network stack (its own loopback; nothing shared with this machine's), an address
    ``10.213.X.(i + 2)/24`` on its veth (``X`` picked from this process id) and an sshd on port 22; this namespace
    reaches them through the bridge (``10.213.X.1``).  Needs root and ``ip`` (iproute2); :func:`netns_available`.
    Everything it creates is removed by :meth:`stop`.
    """

    def __init__(self, n: int = 2, *, ranks_per_host: int = 1) -> None:
        super().__init__(0, ranks_per_host=ranks_per_host)
        tag = os.getpid() % 100000
        self.subnet = f"10.213.{tag % 250 + 1}"
        self.bridge = f"hbr{tag}"
        self.namespaces = [f"hspmd{tag}n{i}" for i in range(n)]
        self.ifaces = [(f"hv{tag}r{i}", f"hv{tag}n{i}") for i in range(n)]
        self.servers = [LoopbackSSHD(f"{self.subnet}.{i + 2}", self.client_key, port=22, netns=ns)
                        for i, ns in enumerate(self.namespaces)]

    def _net_up(self) -> None:
        run = lambda *a: subprocess.run(["ip", *a], check=True, capture_output=True, timeout=30)  # noqa: E731
        run("link", "add", self.bridge, "type", "bridge")
        run("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        run("link", "set", self.bridge, "up")
        for i, (ns, (root_if, ns_if)) in enumerate(zip(self.namespaces, self.ifaces)):
            run("netns", "add", ns)
            run("-n", ns, "link", "set", "lo", "up")
            run("link", "add", root_if, "type", "veth", "peer", "name", ns_if)
            run("link", "set", ns_if, "netns", ns)
            run("-n", ns, "addr", "add", f"{self.subnet}.{i + 2}/24", "dev", ns_if)
            run("-n", ns, "link", "set", ns_if, "up")
            run("link", "set", root_if, "master", self.bridge)
            run("link", "set", root_if, "up")

    def start(self) -> "NetnsHosts":
        try:
            self._net_up()
        except BaseException:
            self.stop()
            raise
        super().start()
        return self

    @property
    def hosts(self) -> dict[str, dict[str, Any]]:
        return {s.address: {"port": s.port, "python": sys.executable, "env": {"GLOO_SOCKET_IFNAME": ns_if}}
                for s, (_, ns_if) in zip(self.servers, self.ifaces)}

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        for root_if, _ in self.ifaces:
            subprocess.run(["ip", "link", "del", root_if], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)


def netns_available() -> bool:
    """Whether this process may create network namespaces (root, ``ip`` present, namespaces allowed)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or not sshd_available():
        return False
    name = f"hspmdprobe{os.getpid() % 100000}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True, timeout=30).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return ok
