"""Workers as Slurm job steps: :class:`SlurmTransport` (``launch(..., transport=SlurmTransport())``, SPEC §10).

How a job runs on Slurm:

- **Allocation**: one allocation per node of the cluster (``salloc --no-shell --no-kill -w NODE -N1 -n RANKS``,
  plus ``--gres=gpu:RANKS`` on a GPU node, and the ``partition``/``time``/``account``/``qos``/``constraint``/
  ``extra_args`` given), requested when the launch is checked (``preflight``) or when the node's workers start.
  Per-node allocations request exactly each node's ranks and GPUs (one multi-node request cannot ask for
  different counts per node), and a node that dies takes only its own allocation with it: the others, and their
  workers, run on, which is what elastic training needs (``--no-kill`` is kept for a node list given through
  ``extra_args``).  All of a job's allocations carry one job name, ``hspmd-<token>``.
- **Workers**: one job step per rank, ``srun --jobid=J --exact -N1 -n1 -w NODE [--gres=gpu:1] python -m
  hspmd_sdk.runtime.workers.worker --rank R``, started by this process: each worker gets its own GPU from Slurm
  (``CUDA_VISIBLE_DEVICES``) and its own CPUs (``--exact``).  ``srun`` relays the worker's stdin, stdout and
  stderr over Slurm's own step I/O connection, so the worker speaks exactly the protocol of a local worker
  (:mod:`.protocol`): the spec and the control lines in, one ``@hspmd`` JSON line per message out; the launcher
  side is :class:`~.transport.LocalWorkers` around the ``srun`` processes.  Heartbeats go end to end (launcher
  <-> srun <-> slurmstepd <-> worker), so a node that dies or is cut off is noticed by the job's own watchdog, not
  by waiting for Slurm to mark it DOWN.
- **Rendezvous**: rank 0's node, at its ``NodeAddr`` and a port free there, asked by a short ``--overlap`` step
  in the node's allocation (a random port from 20000-40000 if the launch skipped ``preflight``).
- **Stopping**: a worker's stdin is closed (it exits at once, as local workers do), its step gets SIGCONT and
  SIGTERM (``scancel --signal``, sent from a thread: Slurm forwards a signal to the node and waits for it, which
  on a node that died takes ``MessageTimeout``), and after the grace period its step is cancelled (``scancel
  JOB.STEP``: recorded by slurmctld at once, which kills the tasks on a live node); the ``srun`` client is
  SIGKILLed here if it has not ended :data:`STEP_EXIT_S` later (it waits for a dead node until Slurm marks it
  DOWN).  :meth:`close` (the job's end, a cancel or a failure) cancels every allocation and waits until Slurm
  has ended them, so nothing the job started is left on any node.  A launcher killed outright (any signal,
  SIGKILL included) cannot do that: a reaper it started in a session of its own (:mod:`.slurm_reaper`) sees its
  pipe from the launcher close and cancels the allocations still held, which ends their steps and so the
  ``srun`` clients too.
- **Lost nodes** (``elastic=True``): a node that dies or is cut off stops relaying its workers' lines; the job's
  watchdog takes them for hung after ``silent_s`` (their heartbeats, not Slurm's ``DOWN``, which comes after
  ``SlurmdTimeout``), stops them as above and the survivors replan.  Once none of a node's workers runs, its
  allocation is released (cancelled, not waited for: on a dead node Slurm completes it when the node returns or is
  marked ``DOWN``), so that workers started there later (``job.grow`` onto the node once it is back) get a fresh
  allocation.  The new world meets on a surviving node (``rendezvous(..., fresh=True)`` probes a port there).

Slurm commands directly, not submitit: submitit runs a pickled Python callable (cloudpickle, written to a shared
folder) as a batch job and reads its result back from files; it has no way to start long-lived per-rank
processes on named nodes of one allocation, to stream their lines, or to talk to them while they run, and it
tracks jobs through ``sacct`` (accounting), which many clusters and this project's test cluster do not run.  And
its channel deserializes executable pickles, which this SDK's channels never do.  ``salloc``/``srun``/``scancel``
/``squeue``/``scontrol`` are on every Slurm cluster, need no dependency, and keep one protocol for every
transport.

Security: the launcher <-> worker channel is Slurm's step I/O, which Slurm authenticates (munge-signed job
credentials; only the job's owner and root can attach) and which carries JSON lines only (a LaunchSpec, then
pings and control messages; the worker answers with JSON messages and raw log text that the launcher never
evaluates).  This transport opens no listening port of its own.  The rendezvous store that rank 0 hosts lets in
only a process that proves it holds the job's secret (fresh per job, inside the LaunchSpec: :mod:`.store`).
Still unauthenticated (as with every transport): the gloo/NCCL connections between workers, which those
libraries open and accept themselves -- whoever can reach those ports on the nodes can disturb the job.
"""
from __future__ import annotations

import atexit
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from ...core.slurm_nodes import SlurmError, SlurmNodeInfo, read_slurm_nodes
from ...errors import PlanValidationError
from ..workers.devices import CUDA_INDEX_ENV
from ..spec import LaunchSpec
from .transport import WORKER_MODULE, ExitSink, LineSink, LocalWorkers, Transport, worker_env
from ..control.preflight import HostFacts

if TYPE_CHECKING:
    from ...core.cluster import Cluster

__all__ = ["SlurmTransport", "SlurmWorkers", "SlurmError", "srun_status"]

_PROBE = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_STREAM); s.bind(('', 0)); "
          "print('@port', s.getsockname()[1]); s.close()")
_ACTIVE = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STAGE_OUT", "RESIZING", "SIGNALING")
#: Seconds a stopped worker's ``srun`` may take to end after its step was cancelled before it is SIGKILLed here
#: (on a live node it ends within a second; for a node that died or was cut off it waits for Slurm's ``DOWN``).
STEP_EXIT_S = 3.0


def srun_status(rc: int) -> int:
    """A worker's return code from ``srun``'s: ``128 + N`` (its task killed by signal ``N``) -> ``-N``."""
    return -(rc - 128) if 128 < rc < 128 + 65 else rc


def _slurm_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment without the ``SLURM_*`` variables of an enclosing job (they would redirect ``srun`` and
    ``salloc``), ``SLURM_CONF`` kept; plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    return {**env, **(extra or {})}


def _exe(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SlurmError(f"Slurm's {name} is not on PATH: install Slurm's clients (Debian: slurm-client) or run "
                         "the launcher on a host of the Slurm cluster")
    return path


def _run(argv: Sequence[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, env=_slurm_env(),
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(argv[:3])}...: no answer from Slurm in {timeout_s:g} s") from None


class _Reaper:
    """The launcher's end of :mod:`.slurm_reaper`: a process in a session of its own that cancels the allocations
    still held when this process dies without releasing them (started with the first ``add``)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def say(self, line: str) -> None:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                if not line.startswith("add "):
                    return
                pkg = str(Path(__file__).resolve().parents[2])  # where hspmd_sdk is, whatever this sys.path
                path = os.pathsep.join(p for p in (pkg, os.environ.get("PYTHONPATH", "")) if p)
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "hspmd_sdk.runtime.transports.slurm_reaper", _exe("scancel")], text=True,
                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    env=_slurm_env({"PYTHONPATH": path}), start_new_session=True)
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write(line + "\n")
                self._proc.stdin.flush()
            except (OSError, ValueError):
                pass  # the reaper is gone: the next add starts another

    def close(self) -> None:
        """Every allocation is cancelled: the reaper exits without doing anything."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            assert proc.stdin is not None
            proc.stdin.write("close\n")
            proc.stdin.close()
            proc.wait(timeout=5)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


@dataclass(frozen=True)
class Allocation:
    """One node's allocation: its Slurm job id, the node, its ranks and whether it holds GPUs."""

    job_id: str
    host: str
    ranks: int
    gpus: bool


class SlurmTransport(Transport):
    """Starts each rank as a Slurm job step on its node (module docstring).

    ``partition``, ``time`` (``"10:00"``), ``account``, ``qos``, ``constraint``: passed to ``salloc``;
    ``extra_args``: further ``salloc`` arguments.  ``python``: the workers' interpreter (default: this one; the
    nodes must see the same path, as on a shared file system); ``cpus_per_rank``: CPUs each step gets (and torch
    threads each worker uses); ``allocate_timeout_s``: how long to wait for the scheduler to grant the
    allocations.  The cluster's hosts must be Slurm node names (:meth:`~hspmd_sdk.Cluster.from_slurm`).
    Clients find the cluster as Slurm's own tools do (``SLURM_CONF`` or ``/etc/slurm/slurm.conf``).
    """

    local = False

    def __init__(self, partition: str | None = None, time: str | None = None, account: str | None = None,
                 qos: str | None = None, constraint: str | None = None, extra_args: Sequence[str] = (), *,
                 python: str | None = None, cpus_per_rank: int = 1, allocate_timeout_s: float = 300.0,
                 kill_timeout_s: float = 15.0) -> None:
        if cpus_per_rank < 1:
            raise PlanValidationError([("cpus_per_rank", f"{cpus_per_rank} must be >= 1")], what="SlurmTransport")
        self.partition, self.time, self.account, self.qos = partition, time, account, qos
        self.constraint = constraint
        self.extra_args = tuple(str(a) for a in extra_args)
        self.python = python or sys.executable
        self.cpus_per_rank = cpus_per_rank
        self.allocate_timeout_s = allocate_timeout_s
        self.kill_timeout_s = kill_timeout_s
        self.name = f"hspmd-{secrets.token_hex(4)}"
        self._nodes: dict[str, SlurmNodeInfo] = {}
        self._allocs: dict[str, Allocation] = {}
        self._released: list[str] = []  # allocations cancelled while the job ran (their node's workers ended)
        self._lock = threading.RLock()
        self.groups: list[SlurmWorkers] = []
        self._reaper = _Reaper()  # cancels what is still held should this process die (a signal, SIGKILL)

    # ---- the scheduler's view ---------------------------------------------------------------------------------
    def _node(self, host: str) -> SlurmNodeInfo:
        if host not in self._nodes:
            for info in read_slurm_nodes(nodes=[host]):
                self._nodes[info.name] = info
        return self._nodes[host]

    @property
    def allocations(self) -> dict[str, str]:
        """Host -> the Slurm job id of its allocation (those held now)."""
        with self._lock:
            return {h: a.job_id for h, a in self._allocs.items()}

    def preflight(self, cluster: "Cluster") -> None:
        """Every host a usable Slurm node (of ``partition``) with enough GPUs for its ranks; then allocate them
        all (raises :class:`SlurmError` or :class:`~hspmd_sdk.errors.PlanValidationError` naming the node)."""
        for name in ("salloc", "srun", "scancel", "squeue", "scontrol"):
            _exe(name)
        counts: dict[str, int] = {}
        kinds: dict[str, str] = {}
        for n in cluster.nodes:
            counts[n.host] = counts.get(n.host, 0) + len(n.ranks)
            kinds[n.host] = n.kind
        for info in read_slurm_nodes(self.partition, nodes=list(counts)):
            self._nodes[info.name] = info
        problems = [(f"nodes.{h}", f"{c} {kinds[h]} ranks but Slurm gives the node {self._nodes[h].gpus} GPUs")
                    for h, c in counts.items() if kinds[h].lower() != "cpu" and self._nodes[h].gpus
                    and c > self._nodes[h].gpus]
        if problems:
            raise PlanValidationError(problems, what="cluster on Slurm")
        self.allocate({h: (c, kinds[h].lower() != "cpu" and self._nodes[h].gpus > 0) for h, c in counts.items()})

    def allocate(self, wanted: Mapping[str, tuple[int, bool]]) -> dict[str, str]:
        """Allocate every host of ``wanted`` (host -> (ranks, with GPUs)) not yet held, in parallel; all or none
        (the ones granted are cancelled if another fails).  Host -> job id."""
        todo = {h: w for h, w in wanted.items() if h not in self._allocs}
        results: dict[str, Allocation | BaseException] = {}

        def one(host: str, ranks: int, gpus: bool) -> None:
            try:
                results[host] = self._salloc(host, ranks, gpus)
            except BaseException as e:  # noqa: BLE001 - reported below, per host
                results[host] = e
        threads = [threading.Thread(target=one, args=(h, n, g), daemon=True) for h, (n, g) in todo.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        granted = {h: r for h, r in results.items() if isinstance(r, Allocation)}
        failed = {h: r for h, r in results.items() if not isinstance(r, Allocation)}
        with self._lock:
            self._allocs.update(granted)
            if granted and not self._hooked:
                atexit.register(self.close)
                self._hooked = True
        for a in granted.values():
            self._reaper.say(f"add {a.job_id}")
        if failed:
            self._cancel([a.job_id for a in granted.values()])
            with self._lock:
                for h in granted:
                    self._allocs.pop(h, None)
            raise SlurmError("cannot allocate " + "; ".join(f"{h}: {e}" for h, e in failed.items()))
        return self.allocations

    _hooked = False

    def _salloc(self, host: str, ranks: int, gpus: bool) -> Allocation:
        argv = [_exe("salloc"), "--no-shell", "--no-kill", "-J", self.name, "-w", host, "-N1", "-n", str(ranks),
                "-c", str(self.cpus_per_rank)]
        argv += [f"--gres=gpu:{ranks}"] if gpus else []
        for flag, value in (("-p", self.partition), ("-t", self.time), ("-A", self.account), ("-q", self.qos),
                            ("-C", self.constraint)):
            if value:
                argv += [flag, value]
        argv += list(self.extra_args)
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                text=True, env=_slurm_env(), start_new_session=True)
        try:
            out, err = proc.communicate(timeout=self.allocate_timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()  # salloc withdraws its pending request
            out, err = proc.communicate(timeout=30)
            m = re.search(r"job allocation (\d+)", err)
            if m:
                self._cancel([m[1]])
            raise SlurmError(f"salloc on {host}: not granted within {self.allocate_timeout_s:g} s "
                             f"({err.strip()[-300:]})") from None
        m = re.search(r"Granted job allocation (\d+)", err)
        if proc.returncode != 0 or m is None:
            raise SlurmError(f"salloc on {host} failed (exit status {proc.returncode}): "
                             f"{(err or out).strip()[-500:]}")
        return Allocation(job_id=m[1], host=host, ranks=ranks, gpus=gpus)

    # ---- what launch() asks ---------------------------------------------------------------------------------
    def rendezvous(self, host: str, *, fresh: bool = False) -> tuple[str, int]:
        """``host``'s address (its ``NodeAddr``) and a port free there now (a probe step in its allocation)."""
        address = self._node(host).address
        alloc = self._allocs.get(host)
        if alloc is None:
            return address, random.randint(20000, 40000)
        argv = [_exe("srun"), f"--jobid={alloc.job_id}", "--overlap", "-N1", "-n1", "-w", host, "-J",
                "hspmd-probe", "--quiet", self.python, "-c", _PROBE]
        r = _run(argv, timeout_s=60.0)
        m = re.search(r"^@port (\d+)$", r.stdout, re.M)
        if r.returncode != 0 or m is None:
            raise SlurmError(f"probing a free port on {host} (job {alloc.job_id}) failed (exit status "
                             f"{r.returncode}): {(r.stderr or r.stdout).strip()[-400:]}")
        return address, int(m[1])

    def host_facts(self, host: str, *, cuda: bool = False) -> HostFacts:
        """The node as the scheduler declares it: CPUs, memory (``RealMemory``) and GPUs (its GRES)."""

        info = self._node(host)
        return HostFacts(cpus=info.cpus, mem_available=info.memory_mb * 2**20, gpus=info.gpus)

    def threads_per_worker(self, cluster: "Cluster") -> int | None:
        return self.cpus_per_rank

    # ---- workers ---------------------------------------------------------------------------------------------
    def start(self, host: str, ranks: Sequence[int], spec: LaunchSpec, on_line: LineSink,
              on_exit: ExitSink) -> "SlurmWorkers":
        """One ``srun`` step per rank in ``host``'s allocation (allocated now if ``preflight`` did not)."""
        if host not in self._allocs:
            info = self._node(host)
            kind = spec.devices[ranks[0]] if ranks else "cpu"
            self.allocate({host: (len(ranks), kind.lower() != "cpu" and info.gpus > 0)})
        alloc = self._allocs[host]
        group = SlurmWorkers(host, list(ranks), alloc.job_id, heartbeat_s=spec.heartbeat_s,
                             kill_timeout_s=self.kill_timeout_s)
        with self._lock:
            self.groups.append(group)

        def exited(rank: int, rc: int) -> None:
            on_exit(rank, srun_status(rc))
            if all(v is not None for v in group.poll().values()):
                self._release(group)
        try:
            for r in ranks:
                group.add(r, self._srun(alloc, r, spec), on_line, exited, spec.line_for(r))
        except BaseException:
            group.kill(grace_s=0)
            raise
        group.start_pings()
        return group

    def _srun(self, alloc: Allocation, rank: int, spec: LaunchSpec) -> subprocess.Popen[bytes]:
        argv = [_exe("srun"), f"--jobid={alloc.job_id}", "--no-kill", "--exact", "-N1", "-n1", "-c",
                str(self.cpus_per_rank), "-w", alloc.host, "-J", step_name(rank)]
        argv += ["--gres=gpu:1"] if alloc.gpus else []
        argv += [self.python, "-m", WORKER_MODULE, "--rank", str(rank)]
        env = worker_env(spec, rank)
        if alloc.gpus:  # the step's one GPU (CUDA_VISIBLE_DEVICES names only it): cuda:0, whatever the local rank
            env[CUDA_INDEX_ENV] = "0"
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=_slurm_env(env), start_new_session=True)

    #: a node lost and restarted (or freed by the scheduler) comes back: elastic jobs grow back onto it by default
    grows_back = True

    def available(self, host: str) -> bool:
        """Whether Slurm node ``host`` can take workers again (:mod:`.growback`): it answers the scheduler (not
        DOWN, DRAINED, FAILED or NOT_RESPONDING) and no job still runs there (the allocation the job lost with it
        ends only some seconds after the node is back; a node another job holds would make the grow wait)."""
        state = ""
        for info in read_slurm_nodes(nodes=[host]):
            state = info.state.upper()
        if not state or any(bad in state for bad in ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "UNKNOWN")):
            return False
        r = _run([_exe("squeue"), "-h", "-w", host, "-o", "%i"], timeout_s=15.0)
        return r.stdout.strip() == ""

    def _release(self, group: "SlurmWorkers") -> None:
        """``group``'s workers all ended: cancel its host's allocation unless other workers of the job run there
        (not waited for here; :meth:`close` waits).  Workers started on the host later get a fresh allocation."""
        with self._lock:
            alloc = self._allocs.get(group.host)
            if alloc is None or alloc.job_id != group.job_id:
                return
            if any(g.host == group.host and any(rc is None for rc in g.poll().values()) for g in self.groups):
                return
            del self._allocs[group.host]
            if not group.unconfirmed:  # else its node did not answer: Slurm completes it once the node is back
                self._released.append(alloc.job_id)
        try:
            _run([_exe("scancel"), alloc.job_id])
        except SlurmError:
            pass  # close() cancels it again
        else:
            if alloc.job_id not in self._released:  # else close() waits for it, and the reaper keeps it
                self._reaper.say(f"drop {alloc.job_id}")

    # ---- the end ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop any worker still running, cancel every allocation and wait until Slurm ended them (an allocation
        on a node that stopped answering counts as ended: nothing of the job can run there).  Idempotent; the
        transport can be used again (it allocates anew)."""
        for g in list(self.groups):
            if any(rc is None for rc in g.poll().values()):
                g.kill(grace_s=0.5)
        with self._lock:
            self.groups = []
            ids = [a.job_id for a in self._allocs.values()] + self._released
            self._allocs.clear()
            self._released = []
            hooked, self._hooked = self._hooked, False
        if hooked:
            atexit.unregister(self.close)
        self._cancel(ids)
        self._reaper.close()

    def _cancel(self, job_ids: Sequence[str]) -> None:
        """``scancel`` the jobs and wait (``kill_timeout_s``) until none is active; a warning names those that
        still are (this runs in the job's own threads at its end: an exception would reach no one)."""
        if not job_ids:
            return
        _run([_exe("scancel"), *job_ids])
        deadline = time.monotonic() + self.kill_timeout_s
        active: list[str] = list(job_ids)
        while time.monotonic() < deadline:
            r = _run([_exe("squeue"), "-h", "-j", ",".join(job_ids), "-o", "%i %T %N"])
            rows = [line.split() for line in r.stdout.splitlines()]
            active = [row[0] for row in rows if row[1:2] and row[1] in _ACTIVE]
            completing = {row[0]: row[2] for row in rows if row[1:2] == ["COMPLETING"] and row[2:3]}
            if completing and set(active) == set(completing) and _unreachable(completing.values()):
                return  # cancelled on nodes that died or were cut off: Slurm completes them when they return
            if r.returncode == 0 and not active:
                return
            if r.returncode != 0 and "Invalid job id" in r.stderr:
                return  # gone already (purged after MinJobAge)
            time.sleep(0.1)
        warnings.warn(f"Slurm jobs {', '.join(active)} still active {self.kill_timeout_s:g} s after scancel "
                      "(check them with squeue; scancel --signal=KILL ends them)", RuntimeWarning, stacklevel=2)

    def __repr__(self) -> str:
        opts = {k: v for k, v in (("partition", self.partition), ("time", self.time), ("account", self.account),
                                  ("qos", self.qos), ("constraint", self.constraint)) if v}
        return f"SlurmTransport({', '.join(f'{k}={v!r}' for k, v in opts.items())})"


def _unreachable(nodes: Iterable[str]) -> bool:
    """Whether every node in ``nodes`` (names; one allocation's node each) has stopped answering slurmctld."""
    try:
        infos = read_slurm_nodes(nodes=sorted(set(nodes)))
    except Exception:  # noqa: BLE001 - cannot tell: wait as for any other job
        return False
    return bool(infos) and all("NOT_RESPONDING" in i.state.upper() or "DOWN" in i.state.upper() for i in infos)


def step_name(rank: int) -> str:
    """The job step name of ``rank``'s worker."""
    return f"hspmd-r{rank}"


class SlurmWorkers(LocalWorkers):
    """One host's workers: local ``srun`` processes (lines, exits and pings as for local workers), each the
    client of one job step of allocation ``job_id``; signals go to the steps through ``scancel``."""

    def __init__(self, host: str, ranks: list[int], job_id: str, *, heartbeat_s: float = 1.0,
                 kill_timeout_s: float = 15.0) -> None:
        super().__init__(host, ranks, heartbeat_s=heartbeat_s)
        self.job_id = job_id
        self.kill_timeout_s = kill_timeout_s
        self._steps: dict[int, str] = {}
        #: ranks whose ``srun`` had to be SIGKILLed here: their node never confirmed the end of their step
        self.unconfirmed: set[int] = set()

    def poll(self) -> dict[int, int | None]:
        return {r: None if rc is None else srun_status(rc) for r, rc in super().poll().items()}

    def steps(self, ranks: Sequence[int]) -> dict[int, str]:
        """Rank -> its step id (``JOB.STEP``), for the ranks whose step runs (asked from ``squeue``)."""
        if any(r not in self._steps for r in ranks):
            try:
                r = _run([_exe("squeue"), "-h", "-s", "-j", self.job_id, "-o", "%i %j"], timeout_s=15.0)
            except SlurmError:
                return {k: v for k, v in self._steps.items() if k in ranks}
            names = {step_name(k): k for k in ranks}
            for line in r.stdout.splitlines():
                sid, _, name = line.strip().partition(" ")
                if name in names:
                    self._steps[names[name]] = sid
        return {k: v for k, v in self._steps.items() if k in ranks}

    def _signal(self, ranks: Sequence[int], *sigs: str) -> None:
        """Send ``sigs`` in order to the steps of ``ranks``, from a thread (``scancel --signal`` waits until the
        node answers: ``MessageTimeout`` for a node that died)."""
        ids = list(self.steps(ranks).values())
        if not ids:
            return

        def send() -> None:
            for sig in sigs:
                try:
                    _run([_exe("scancel"), f"--signal={sig}", *ids], timeout_s=30.0)
                except SlurmError:
                    pass
        threading.Thread(target=send, name=f"hspmd-scancel-{self.job_id}", daemon=True).start()

    def _cancel_steps(self, ranks: Sequence[int]) -> None:
        """Cancel the steps of ``ranks`` (slurmctld records it at once and kills their tasks on a live node)."""
        ids = list(self.steps(ranks).values())
        if ids:
            try:
                _run([_exe("scancel"), *ids], timeout_s=15.0)
            except SlurmError:
                pass

    def dump_stack(self, rank: int) -> None:
        if self.poll().get(rank, 0) is None:
            self._signal([rank], "USR1", "CONT")

    def kill(self, grace_s: float = 0.5, ranks: Sequence[int] | None = None) -> None:
        """Close the workers' stdin, SIGCONT + SIGTERM their steps, cancel the steps after ``grace_s``; then wait
        for their ``srun`` to end (SIGKILL to it after :data:`STEP_EXIT_S`: on a node that died or was cut off
        it would wait for Slurm's ``DOWN``).  Idempotent."""
        with self._lock:
            procs = {r: p for r, p in self._procs.items() if ranks is None or r in ranks}
            self._killing |= set(procs)
            if ranks is None:
                self._quiet.set()
        for r in procs:
            self._stdin[r].close()
        running = [r for r, p in procs.items() if p.poll() is None]
        if running:
            self._signal(running, "CONT", "TERM")
        deadline = time.monotonic() + grace_s
        for p in procs.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        late = [r for r, p in procs.items() if p.returncode is None]
        with self._lock:
            self._escalated |= set(late)
        if late:
            self._cancel_steps(late)
        deadline = time.monotonic() + min(self.kill_timeout_s, STEP_EXIT_S)
        for r in late:
            try:
                procs[r].wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.unconfirmed.add(r)
                try:
                    os.killpg(procs[r].pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in procs.values():
            p.wait()
