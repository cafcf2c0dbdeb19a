"""A real multi-node Slurm cluster on this one machine, for tests and the Slurm tutorial.

:class:`LocalSlurm` starts Debian's own daemons, never as system services: ``munged`` with a key, socket, pid
and log of its own; ``slurmctld`` in this network namespace on a bridge address (``10.78.X.1``); and one
``slurmd`` per node, each in a network namespace of its own (``10.78.X.(11 + i)``, a veth into the bridge), with
its own host name and ``/etc/hosts`` (a private mount namespace), so that each node is a host of its own as far as
the network goes.  Processes are tracked by process group (``proctrack/pgid``: a task's child that outlives
it, reparented, is still ended with its step; real clusters use ``proctrack/cgroup``).  Nodes carry their device kind as GPU GRES backed by fake device files (clones of
``/dev/null``: ``CUDA_VISIBLE_DEVICES`` is set, no GPU is there) and as a node feature::

    with LocalSlurm([SlurmNode("n1", "H800", gpus=2), SlurmNode("n2", "H20", gpus=2)]) as slurm:
        os.environ.update(slurm.env)          # SLURM_CONF: what srun, scontrol and sinfo read
        cluster = Cluster.from_slurm()
        slurm.kill_node("n2")                 # its slurmd and every process of its namespace: SIGKILL
        slurm.restart_node("n2")

Everything lives in a temporary folder that :meth:`LocalSlurm.stop` removes with the namespaces, veths and the
bridge; every process the helper started (and every task of a node) is killed.  Two instances do not collide:
each takes its own subnet, bridge, namespace and cluster names.  :func:`slurm_unavailable` says why this machine
cannot run it (``None`` when it can).
"""
from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..errors import HSPMDError

BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "srun", "salloc", "scontrol", "scancel", "squeue",
            "nsenter", "unshare", "ip", "mknod")
_COUNTER = itertools.count()


class SlurmLabError(HSPMDError):
    """The local Slurm cluster could not be started or changed (names the daemon or node and its log)."""


@dataclass(frozen=True)
class SlurmNode:
    """One compute node: name, device kind (the GRES type and feature, lower-cased as Slurm users write it;
    ``"cpu"``: no GRES, no feature), GPU count, CPUs and memory (MiB) as the scheduler declares them."""

    name: str
    kind: str = "cpu"
    gpus: int = 0
    cpus: int = 4
    memory_mb: int = 1000

    @property
    def gres(self) -> str | None:
        return f"gpu:{self.kind.lower()}:{self.gpus}" if self.gpus else None


def slurm_unavailable() -> str | None:
    """Why :class:`LocalSlurm` cannot run here (not root, a program missing, no network namespaces), or ``None``."""
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (network namespaces, slurmd as root)"
    missing = [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        return (f"programs missing: {', '.join(missing)} (apt-get install -y slurm-wlm munge iproute2 "
                "util-linux)")
    name = f"hsprobe{os.getpid() % 100000}"
    if subprocess.run(["ip", "netns", "add", name], capture_output=True, timeout=30).returncode != 0:
        return "cannot create network namespaces here (ip netns add failed)"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return None


def _bin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    r = subprocess.run(["ip", *args], capture_output=True, timeout=30)
    if check and r.returncode != 0:
        raise SlurmLabError(f"ip {' '.join(args)}: {r.stderr.decode(errors='replace').strip()}")
    return r


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as dead: PID 1 reaps it later)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _kill_wait(pids: Sequence[int], sig: int = signal.SIGKILL, timeout_s: float = 10.0) -> list[int]:
    """Send ``sig`` to ``pids`` and wait until they are dead; the ones still alive after ``timeout_s``."""
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = [p for p in left if _alive(p)]
    return left


class LocalSlurm:
    """A Slurm cluster of ``nodes`` (default: ``n1`` with 2 H800, ``n2`` with 2 H20) on this machine.

    ``env``: what clients need (``SLURM_CONF``); ``partition``: the one partition (default, all nodes);
    ``address(node)``: a node's address; ``netns(node)``: its network namespace.  Fault injection:
    :meth:`kill_node`, :meth:`cut_node`/:meth:`restore_node`, :meth:`restart_node`; inspection:
    :meth:`node_pids`.  Needs root (:func:`slurm_unavailable`).
    """

    def __init__(self, nodes: Sequence[SlurmNode] | None = None, *, partition: str = "hspmd",
                 slurmd_timeout_s: int = 30) -> None:
        self.nodes = list(nodes or [SlurmNode("n1", "H800", gpus=2), SlurmNode("n2", "H20", gpus=2)])
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names) or not 1 <= len(names) <= 9:
            raise SlurmLabError(f"nodes: 1-9 nodes with distinct names, got {names}")
        sweep_stale()
        n = next(_COUNTER)
        self.tag = f"{os.getpid()}x{n}"  # names carry the owner's pid: sweep_stale() removes a dead owner's
        self.subnet = _free_subnet((os.getpid() * 7 + n) % 240 + 10)
        self.bridge = f"hsb{self.tag}"
        self.partition = partition
        self.slurmd_timeout_s = slurmd_timeout_s
        self.dir = Path(tempfile.mkdtemp(prefix="hspmd-slurm-"))
        (self.dir / "owner").write_text(str(os.getpid()))
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._up: list[str] = []  # what exists, for stop(): "bridge", "ns:NAME"
        self.ctl_port = 0

    # ---- names ---------------------------------------------------------------------------------------------
    @property
    def controller_address(self) -> str:
        """The bridge address in this namespace: slurmctld listens here; nodes reach the launcher here."""
        return f"{self.subnet}.1"

    def address(self, node: str) -> str:
        return f"{self.subnet}.{11 + self._index(node)}"

    def netns(self, node: str) -> str:
        return f"hsn{self.tag}i{self._index(node)}"

    def _veth(self, node: str) -> str:
        return f"hv{self.tag}i{self._index(node)}"

    def _index(self, node: str) -> int:
        for i, n in enumerate(self.nodes):
            if n.name == node:
                return i
        raise SlurmLabError(f"no node {node!r} in this cluster (nodes: {[n.name for n in self.nodes]})")

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """Environment for Slurm's clients (``srun``, ``sinfo``, ``scontrol``) to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    # ---- start ---------------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> "LocalSlurm":
        """Bring up munged, the network, slurmctld and every slurmd; wait until every node is idle."""
        atexit.register(self.stop)
        try:
            self._network()
            self._files()
            self._start_munged()
            self._start_ctld()
            for n in self.nodes:
                self._start_slurmd(n.name)
            self.wait_idle(timeout_s=timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _network(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._up.append("bridge")
        _ip("addr", "add", f"{self.controller_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for n in self.nodes:
            ns, veth = self.netns(n.name), self._veth(n.name)
            _ip("netns", "add", ns)
            self._up.append(f"ns:{ns}")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._up.append(f"veth:{veth}")
            _ip("-n", ns, "addr", "add", f"{self.address(n.name)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")

    def _files(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "run", "log", "munge", "msock", "dev"):
            (d / sub).mkdir(mode=0o755)
        (d / "munge").chmod(0o700)
        self.ctl_port = _free_port(self.controller_address)
        hosts = ["127.0.0.1 localhost", f"{self.controller_address} {socket.gethostname().split('.')[0]}"]
        hosts += [f"{self.address(n.name)} {n.name}" for n in self.nodes]
        (d / "hosts").write_text("\n".join(hosts) + "\n")
        gres = ["AutoDetect=off"]
        for n in self.nodes:
            if n.gpus:
                (d / "dev" / n.name).mkdir()
                for g in range(n.gpus):
                    os.mknod(d / "dev" / n.name / f"gpu{g}", 0o666 | 0o020000, os.makedev(1, 3))
                files = f"gpu[0-{n.gpus - 1}]" if n.gpus > 1 else "gpu0"
                gres.append(f"NodeName={n.name} Name=gpu Type={n.kind.lower()} File={d}/dev/{n.name}/{files}")
        (d / "gres.conf").write_text("\n".join(gres) + "\n")
        lines = [
            f"ClusterName=hspmd{self.tag.replace('x', '')}"[:40], f"SlurmctldHost={socket.gethostname().split('.')[0]}({self.controller_address})",
            f"SlurmctldPort={self.ctl_port}", "SlurmdPort=6818", "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}", "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/run/slurmctld.pid", f"SlurmdPidFile={d}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log", f"SlurmdLogFile={d}/log/slurmd-%n.log",
            "ProctrackType=proctrack/pgid", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "SlurmdParameters=config_overrides", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "MpiDefault=none", "MailProg=/bin/true",
            "ReturnToService=2", f"SlurmdTimeout={self.slurmd_timeout_s}", "KillWait=2", "MinJobAge=5",
            "MessageTimeout=10", "InactiveLimit=0", "SchedulerType=sched/builtin", "GresTypes=gpu",
            "SlurmctldDebug=info", "SlurmdDebug=info", "PlugStackConfig=/dev/null",
        ]
        for n in self.nodes:
            extra = (f" Features={n.kind.lower()} Gres={n.gres}" if n.gpus else
                     f" Features={n.kind.lower()}" if n.kind.lower() != "cpu" else "")
            lines.append(f"NodeName={n.name} NodeAddr={self.address(n.name)} CPUs={n.cpus} "
                         f"RealMemory={n.memory_mb}{extra} State=UNKNOWN")
        lines.append(f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    @property
    def munge_socket(self) -> Path:
        return self.dir / "msock" / "munge.sock"

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.dir / "log" / f"{name}.out", "ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, **self.env}, preexec_fn=_die_with_parent)
        log.close()
        self._procs[name] = proc
        return proc

    def _start_munged(self) -> None:
        key = self.dir / "munge" / "munge.key"
        subprocess.run([_bin("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True,
                       timeout=30)
        key.chmod(0o600)
        self._spawn("munged", [_bin("munged"), "-F", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--pid-file={self.dir / 'run' / 'munged.pid'}",
                               f"--log-file={self.dir / 'log' / 'munged.log'}",
                               f"--seed-file={self.dir / 'munge' / 'seed'}"])
        self._wait(lambda: self.munge_socket.exists(), "munged", "munged.log", 15)

    def _start_ctld(self) -> None:
        self._spawn("slurmctld", [_bin("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: _connects(self.controller_address, self.ctl_port), "slurmctld", "slurmctld.log", 30)

    def _start_slurmd(self, node: str) -> None:
        ns = self.netns(node)
        script = (f"hostname {node} && mount --bind {self.dir / 'hosts'} /etc/hosts && "
                  f"exec {_bin('slurmd')} -D -N {node} -f {self.conf}")
        self._spawn(f"slurmd-{node}", ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--mount",
                                       "sh", "-c", script])

    def _wait(self, ok: Any, daemon: str, log: str, timeout_s: float) -> None:
        deadline, delay = time.monotonic() + timeout_s, 0.01
        while not ok():
            proc = self._procs.get(daemon)
            if proc is not None and proc.poll() is not None or time.monotonic() > deadline:
                raise SlurmLabError(f"{daemon} did not start (in {self.dir}); its log:\n{self.log(log)}")
            time.sleep(delay)
            delay = min(0.2, delay * 2)

    def log(self, name: str) -> str:
        """The tail of a log in ``log/`` (``slurmctld.log``, ``slurmd-n1.log``, ``munged.log``, ``NAME.out``)."""
        try:
            return "\n".join((self.dir / "log" / name).read_text(errors="replace").splitlines()[-40:])
        except OSError:
            return f"(no {name})"

    # ---- state ---------------------------------------------------------------------------------------------
    def scontrol(self, *args: str, timeout_s: float = 30.0) -> str:
        r = subprocess.run([_bin("scontrol"), *args], capture_output=True, text=True, timeout=timeout_s,
                           env={**os.environ, **self.env})
        if r.returncode != 0:
            raise SlurmLabError(f"scontrol {' '.join(args)}: {r.stderr.strip()}")
        return r.stdout

    def node_states(self) -> dict[str, str]:
        """Node -> its state as slurmctld sees it (``IDLE``, ``DOWN*``, ``ALLOCATED``, ...)."""
        out: dict[str, str] = {}
        for line in self.scontrol("show", "node", "-o").splitlines():
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            if "NodeName" in fields:
                out[fields["NodeName"]] = fields.get("State", "")
        return out

    def wait_idle(self, nodes: Sequence[str] | None = None, timeout_s: float = 60.0) -> None:
        """Wait until ``nodes`` (default: all) are up and not drained (idle, mixed or allocated)."""
        want = list(nodes or [n.name for n in self.nodes])
        deadline, states = time.monotonic() + timeout_s, {}
        while time.monotonic() < deadline:
            try:
                states = self.node_states()
            except (SlurmLabError, subprocess.TimeoutExpired):
                states = {}
            if all(_usable(states.get(n, "")) for n in want):
                return
            time.sleep(0.1)
        logs = "\n".join(f"--- slurmd-{n}.log\n{self.log(f'slurmd-{n}.log')}" for n in want)
        raise SlurmLabError(f"nodes not up after {timeout_s:g} s: {states}\n--- slurmctld.log\n"
                            f"{self.log('slurmctld.log')}\n{logs}")

    def node_pids(self, node: str) -> list[int]:
        """Every live process in ``node``'s network namespace (its slurmd, slurmstepd and their tasks)."""
        r = _ip("netns", "pids", self.netns(node), check=False)
        return [int(p) for p in r.stdout.split() if _alive(int(p))]

    def task_pids(self, node: str) -> list[int]:
        """The processes of ``node`` other than its slurmd: job steps and their tasks."""
        proc = self._procs.get(f"slurmd-{node}")
        keep = {proc.pid} if proc is not None and proc.poll() is None else set()
        return [p for p in self.node_pids(node) if p not in keep]

    # ---- faults --------------------------------------------------------------------------------------------
    def kill_node(self, node: str) -> None:
        """SIGKILL the node's slurmd and every process in its namespace (its steps and their tasks)."""
        proc = self._procs.pop(f"slurmd-{node}", None)
        for _ in range(5):
            pids = self.node_pids(node)
            if not pids:
                break
            _kill_wait(pids)
        if proc is not None:
            proc.wait(10)

    def cut_node(self, node: str) -> None:
        """Take the node's link to the bridge down: its processes run on, cut off."""
        _ip("link", "set", self._veth(node), "down")

    def restore_node(self, node: str) -> None:
        """Bring the node's link back up."""
        _ip("link", "set", self._veth(node), "up")

    def restart_node(self, node: str, *, wait: bool = True, timeout_s: float = 60.0) -> None:
        """Kill the node (if it runs) and start its slurmd again; ``wait``: until slurmctld sees it usable."""
        self.kill_node(node)
        self._start_slurmd(node)
        if wait:
            self.wait_idle([node], timeout_s=timeout_s)

    # ---- stop ----------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Kill every daemon and task, remove the namespaces, veths, bridge and folder.  Idempotent."""
        atexit.unregister(self.stop)
        for n in self.nodes:
            if f"ns:{self.netns(n.name)}" in self._up:
                self.kill_node(n.name)
        for name in ("slurmctld", "munged", *list(self._procs)):
            proc = self._procs.pop(name, None)
            if proc is not None and proc.poll() is None:
                _kill_wait([proc.pid], signal.SIGTERM, 5.0) and _kill_wait([proc.pid])
                proc.wait(10)
        for item in reversed(self._up):
            kind, _, name = item.partition(":")
            if kind == "veth":
                _ip("link", "del", name, check=False)
            elif kind == "ns":
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", self.bridge, check=False)
        self._up = []
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LocalSlurm":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalSlurm({', '.join(f'{n.name}={self.address(n.name)}' for n in self.nodes)}, conf={self.conf})"


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the process that started it dies (Linux; kept across the
    ``nsenter``/``unshare``/``sh`` execs), so that a killed test run leaves no daemon behind."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


_STALE = re.compile(r"^hs[nb](\d+)x\d+")


def sweep_stale() -> list[str]:
    """Remove the namespaces, veths and bridges that an instance whose process died left behind (a test run
    killed before it could stop): every name carries its owner's pid.  Returns what it removed."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return []
    removed: list[str] = []
    for ns in _ip("netns", "list", check=False).stdout.decode().split():
        m = _STALE.match(ns)
        if m and not _alive(int(m[1])):
            r = _ip("netns", "pids", ns, check=False)
            _kill_wait([int(p) for p in r.stdout.split()], timeout_s=5.0)
            _ip("netns", "del", ns, check=False)
            removed.append(ns)
    for line in _ip("-o", "link", "show", check=False).stdout.decode().splitlines():
        name = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
        m = re.match(r"^(?:hv|hsb)(\d+)x\d+", name)
        if m and not _alive(int(m[1])):
            _ip("link", "del", name, check=False)
            removed.append(name)
    for d in Path(tempfile.gettempdir()).glob("hspmd-slurm-*"):
        owner = d / "owner"
        try:
            pid = int(owner.read_text())
        except (OSError, ValueError):
            continue
        if not _alive(pid):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    return removed


def _free_subnet(first: int) -> str:
    """``10.78.N`` for the first ``N`` from ``first`` that no interface here uses."""
    used = _ip("-4", "-o", "addr", "show", check=False).stdout.decode()
    for k in range(240):
        n = (first - 10 + k) % 240 + 10
        if f" 10.78.{n}." not in used:
            return f"10.78.{n}"
    raise SlurmLabError("no free subnet 10.78.N.0/24 for a local Slurm cluster")


def _usable(state: str) -> bool:
    s = state.upper()
    return bool(s) and not any(bad in s for bad in ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "UNKNOWN", "*"))


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def _connects(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False
