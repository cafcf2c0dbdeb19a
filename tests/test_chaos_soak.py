"""A chaos soak on a real Slurm cluster (issue 25 item 5): one elastic job keeps losing a random worker and keeps
getting its capacity back, with checkpoints being written all along.

Three nodes (:class:`hspmd_sdk.testing.slurm.LocalSlurm`: one H800, two H20, one fake GPU each, the workers compute
on the CPU with gloo) train one job.  A seeded RNG (the seed is printed) picks, fault after fault, one of

* ``kill``: SIGKILL of the worker process of a random live rank (found in its node's namespace: the task that
  ``slurmstepd`` runs, not the ``srun`` client here);
* ``stop``: SIGSTOP of that process (it stays alive, frozen: the job's heartbeats name it hung and stop it);
* ``cut``: the node's link taken down (:meth:`LocalSlurm.cut_node`); once the job has given the rank up the link
  comes back and the node is restarted (the worker left on it ends; its peers' connections to it fail at once),

waits until the job recovered (the failure's event is ``done``), and then, at random or when a single rank is
left, grows the job back onto every node it lost (``job.grow(extend_cluster(job.cluster,
Cluster.from_slurm(nodes=...)))``: the planner's plan for the grown cluster).  Every step of every rank is
emulated slower by the same factor (newcomers too: :func:`_pace_newcomers`), so that faults land mid-run.

What is checked, against references independent of the job: every loss any rank reported equals the
single-device model's loss of that step (fp32, relative 1e-5); the job ends ``succeeded`` within its time;
``job.events`` is exactly one ``failure`` event per fault (naming the lost launch rank) and one ``grow`` event per
grow, in order, all ``done``; nothing is left on any node (``ip netns pids``), no ``srun`` here, no Slurm job
(``squeue``); the launcher's open file descriptors and SDK threads are back where they were before the job.

:func:`soak` is the driver; ``benchmarks/bench_soak.py`` runs it with 100 faults and reports recovery times and
throughput against a failure-free run.
"""
from __future__ import annotations

import os
import random
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")

from hspmd_sdk import Cluster, LlamaConfig, Strategy, specialize  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.testing.slurm import LocalSlurm  # noqa: E402
from test_slurm import assert_nothing_left  # noqa: E402
# the same three-node cluster, its fixtures (slurm, on_slurm) and the heterogeneous plan as the elastic Slurm tests
from test_slurm_elastic import HETERO, NODES, on_slurm, slurm  # noqa: E402, F401

HOSTS = [n.name for n in NODES]
#: lr 3e-4, not the 1e-3 of the shorter tests: fp32 roundoff (a different summation order, in any distributed plan)
#: grows with the training dynamics, and at 1e-3 even a failure-free DP2 run of this model leaves 1e-5 of the
#: single-device losses from step 211 on (2e-5 there, 1e-4 by step 224, measured); at 3e-4 a failure-free run of
#: 430 steps stays within 1e-6 (8.4e-7 at most, the heterogeneous plan; 3.4e-7 DP2), so 1e-5 stays a sharp check
#: for the 100-fault benchmark's 430 steps (which checks a failure-free run of that length too).  lr 1e-4 since the
#: benchmark's job runs up to 12 x faults + 30 = 1,230 steps: at 3e-4 its failure-free run of that length left the
#: single-device losses by 6.2e-3 (RESULTS §26); at 1e-4, 430 steps stayed within 2.1e-7
SEQ, SEED, LR = 16, 5, 1e-4
TOL = 1e-5
KINDS = ("kill", "stop", "cut")
SUITE_SEED = 20261202
#: every worker emulates a device this many times slower (a step takes a few tenths of a second)
PACE = 6.0


# ---- the driver ---------------------------------------------------------------------------------------------------
@dataclass
class Fault:
    """One injected fault: what, on which node and launch rank, when (wall clock and the job's last step), and its
    recovery (the ``failure`` event; ``recovered_s``: from the injection until that event was seen ``done``)."""

    kind: str
    host: str
    rank: int
    t: float
    step: int
    event: Any = None
    recovered_s: float | None = None


@dataclass
class Grow:
    hosts: list[str]
    t: float
    event: Any = None
    grown_s: float | None = None


@dataclass
class SoakRun:
    seed: int
    steps: int
    faults: list[Fault] = field(default_factory=list)
    grows: list[Grow] = field(default_factory=list)
    job: Any = None
    result: Any = None
    seconds: float = 0.0
    fault_seconds: float = 0.0  #: from the launch to the last fault's recovery
    first_step_s: float = 0.0  #: from the launch to the first step reported (workers' start-up)

    def counts(self) -> dict[str, int]:
        return {k: sum(f.kind == k for f in self.faults) for k in KINDS}


def _program(cluster: Cluster, data: dict):
    model = LlamaConfig.preset("tiny")
    return specialize(model, plan_from_strategy(model, Strategy.load(data), cluster), cluster,
                      bindings={"B": 8, "S": SEQ})


def launch_job(steps: int, *, checkpoint_dir: Path | None = None, checkpoint_every: int = 1,
               heartbeat_s: float = 0.3, pace: float = PACE):
    """The job on n1-n3 (HETERO, elastic, every rank ``pace`` times slower); returns it and its transport."""
    from hspmd_sdk.runtime import SlurmTransport
    from hspmd_sdk.runtime.control.train import launch

    cluster = Cluster.from_slurm(nodes=HOSTS)
    transport = SlurmTransport()
    options: dict[str, Any] = {}
    if checkpoint_dir is not None:
        options.update(checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, keep=3)
    job = launch(_program(cluster, HETERO), cluster, steps=steps, seed=SEED, seq_len=SEQ, lr=LR,
                          transport=transport, device="cpu", timeout_s=60, heartbeat_s=heartbeat_s, elastic=True,
                          progress=False, slowdown={r: pace for r in cluster.ranks}, grow_back=False, **options)
    return job, transport  # (grow_back=False: the soak grows back itself, at random, and checks each grow)


def _pace_newcomers(job: Any, count: int, pace: float) -> None:
    """The emulation covers the workers a grow starts too: their launch ranks (the next ``count``) get the same
    slowdown in the spec the grow copies (test emulation: the real devices would all be equally fast)."""
    with job._lock:
        n = job.spec.world_size
        job.spec = job.spec.model_copy(update={"slowdown": {**job.spec.slowdown,
                                                            **{n + i: pace for i in range(count)}}})


def _wait(cond: Callable[[], bool], timeout: float, what: str, job: Any = None) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if job is not None and job.status.value != "running":
            try:
                why = repr(job.wait(timeout=5))
            except BaseException as e:  # noqa: BLE001 - the job's own reason, quoted
                why = f"{type(e).__name__}: {e}"
            raise AssertionError(f"the job ended ({job.status.value}) while waiting for {what}: {why[-3000:]}")
        assert time.monotonic() < end, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.02)


def worker_pid(lab: LocalSlurm, host: str, rank: int) -> int:
    """The worker process of launch rank ``rank`` on ``host`` (the task in the node's namespace)."""
    want = ["-m", "hspmd_sdk.runtime.workers.worker", "--rank", str(rank)]
    for pid in lab.node_pids(host):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(args[i:i + 4] == want for i in range(len(args))):
            return pid
    raise AssertionError(f"no worker of rank {rank} on {host} (processes there: {lab.node_pids(host)})")


def _jobs_on(host: str) -> list[str]:
    """Slurm jobs still active on ``host`` (``squeue``)."""
    import subprocess

    r = subprocess.run(["squeue", "-h", "-w", host, "-o", "%i %T"], capture_output=True, text=True, timeout=30)
    return r.stdout.split("\n")[:-1] if r.returncode == 0 else ["(squeue failed)"]


def _live(job: Any) -> dict[str, int]:
    """Host -> the launch rank running there now (the current plan's ranks)."""
    ctl = job.controller
    with ctl._lock:
        cur = ctl.current
        return {cur.cluster.node_of(r).host: l for r, l in cur.to_launch.items()}


def soak(lab: LocalSlurm, *, faults: int, seed: int, steps: int, checkpoint_dir: Path,
         p_grow: float = 0.5, gap: int = 1, deadline_s: float = 600.0, stop_when_done: bool = False,
         log: Callable[[str], None] = print) -> SoakRun:
    """Run one job of at most ``steps`` steps and inject ``faults`` faults (module docstring); returns the record
    with the job's result.  Faults stop early (and the record has fewer) when fewer than ``6`` steps remain.
    ``stop_when_done``: once the faults are over, stop the job (``job.stop()``: it ends after the step it is in)
    instead of training its remaining steps: ``steps`` is then a bound (the job trains on while a grow's
    newcomers start, so how many steps the faults take varies)."""
    from hspmd_sdk.runtime.control.grow import extend_cluster

    rng = random.Random(seed)
    run = SoakRun(seed=seed, steps=steps)
    t0 = time.monotonic()
    job, _ = launch_job(steps, checkpoint_dir=checkpoint_dir)
    run.job = job
    kinds: list[str] = []
    try:
        _wait(lambda: job.metrics.last_step() >= 0, 120, "step 0", job)
        run.first_step_s = time.monotonic() - t0
        _wait(lambda: job.metrics.last_step() >= 1, 120, "step 1", job)
        done_step = job.metrics.last_step()
        while len(run.faults) < faults:
            _wait(lambda: job.metrics.last_step() >= done_step + gap, 120, "the next step", job)
            if job.metrics.last_step() + 6 >= steps:
                log(f"soak: only {steps - job.metrics.last_step() - 1} steps left, stopping the faults")
                break
            live = _live(job)
            if not kinds:
                kinds = rng.sample(KINDS, len(KINDS))
            kind = kinds.pop()
            host = rng.choice(sorted(live))
            rank = live[host]
            pid = worker_pid(lab, host, rank)
            fault = Fault(kind, host, rank, time.time(), job.metrics.last_step())
            t_inject = time.monotonic()
            if kind == "kill":
                os.kill(pid, signal.SIGKILL)
            elif kind == "stop":
                os.kill(pid, signal.SIGSTOP)
            else:
                lab.cut_node(host)
            run.faults.append(fault)
            if kind == "cut":  # once the job gave the rank up, the link comes back and the node restarts
                _wait(lambda: rank not in job.pids(), 60, f"rank {rank} given up after the cut of {host}", job)
                lab.restore_node(host)
                lab.restart_node(host)

            def recovered() -> Any:
                return next((e for e in job.events if e.reason == "failure" and rank in e.failed_ranks
                             and e.done), None)
            _wait(lambda: recovered() is not None, 120, f"the recovery from the {kind} of rank {rank} on {host}",
                  job)
            fault.recovered_s = time.monotonic() - t_inject
            fault.event = recovered()
            done_step = job.metrics.last_step()
            log(f"soak: {time.monotonic() - t0:.1f} s: fault {len(run.faults)}: {kind} rank {rank} on {host} at "
                f"step {fault.step}: recovered in {fault.recovered_s:.2f} s ({fault.event})")
            # grow back onto the lost nodes Slurm has freed (a cut node's old allocation ends only some seconds
            # after its restart): at random, or when a single rank is left (then waiting for a node to be free)
            lost = [h for h in HOSTS if h not in _live(job)]
            if len(run.faults) >= faults or job.metrics.last_step() + 6 >= steps:
                continue
            if len(lost) == len(HOSTS) - 1:
                t_free = time.monotonic()
                _wait(lambda: any(not _jobs_on(h) for h in lost), 120, f"Slurm to free one of {lost}", job)
                log(f"soak: {time.monotonic() - t0:.1f} s: waited {time.monotonic() - t_free:.2f} s for a free node")
            elif rng.random() >= p_grow:
                continue
            ready = [h for h in lost if not _jobs_on(h)]
            if ready and job.metrics.last_step() + 6 < steps:
                grown = extend_cluster(job.cluster, Cluster.from_slurm(nodes=ready))
                _pace_newcomers(job, len(ready), PACE)
                g = Grow(ready, time.time())
                t_grow = time.monotonic()
                g.event = job.grow(grown)
                run.grows.append(g)
                _wait(lambda: g.event.done, 120, f"the grow onto {ready}", job)
                g.grown_s = time.monotonic() - t_grow
                done_step = job.metrics.last_step()
                log(f"soak: {time.monotonic() - t0:.1f} s: grew onto {ready} in {g.grown_s:.2f} s ({g.event})")
            if time.monotonic() - t0 > deadline_s:
                log("soak: out of time, stopping the faults")
                break
        run.fault_seconds = time.monotonic() - t0
        if stop_when_done:
            job.stop()
        run.result = job.wait(timeout=max(60.0, steps * 2.0))
    except BaseException:
        job.cancel()
        raise
    run.seconds = time.monotonic() - t0
    return run


# ---- the test -----------------------------------------------------------------------------------------------------
def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def hspmd_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("hspmd"))


def settle(timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while hspmd_threads() and time.monotonic() < deadline:
        time.sleep(0.05)


def check_soak(run: SoakRun, reference: Any) -> None:
    """The soak's proofs on the job (losses, events, outcome); the caller checks what is left."""
    job, result = run.job, run.result
    assert job.status.value == ("succeeded" if result.stopped_at is None else "stopped"), job.status
    ref = reference.losses
    assert len(result.losses) == (run.steps if result.stopped_at is None else result.stopped_at)
    assert all(f.event is not None and f.event.step < len(result.losses) for f in run.faults)
    bad = [(r, m.step, m.loss, ref[m.step]) for r in job.metrics.ranks() for m in job.metrics.rank(r)
           if m.loss is not None and abs(m.loss - ref[m.step]) > TOL * abs(ref[m.step])]
    final = [(s, got, ref[s]) for s, got in enumerate(result.losses) if abs(got - ref[s]) > TOL * abs(ref[s])]
    assert bad == [], (f"seed {run.seed}: losses that differ from the single-device model's (rank, step, got, ref): "
                       f"{bad[:12]} ({len(bad)} in all); of the job's final losses {final[:12]}; events around "
                       f"them: {[str(e) for e in result.events if bad and abs(e.step - bad[0][1]) <= 3]}")
    # every fault and every grow is exactly one event, in the order they happened, all done
    expected = sorted([(f.t, "failure", [f.rank]) for f in run.faults] + [(g.t, "grow", []) for g in run.grows])
    got = [(e.reason, e.failed_ranks) for e in result.events]
    assert got == [(r, ranks) for _, r, ranks in expected], f"seed {run.seed}: events {got}"
    assert all(e.done and not e.superseded for e in result.events), [str(e) for e in result.events]
    kinds = {f.rank: f.kind for f in run.faults}
    for failure in result.failures if hasattr(result, "failures") else job.failures:
        assert set(failure.ranks) <= set(kinds), failure


@pytest.fixture(scope="module")
def reference() -> Any:
    from hspmd_sdk.runtime.control.train import reference_training

    return reference_training(LlamaConfig.preset("tiny"), steps=STEPS, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR)


STEPS = 200  # a bound: the job stops once its faults are over
FAULTS = 10


@pytest.mark.timeout(300)
def test_a_job_survives_ten_random_faults_with_equal_losses_and_nothing_left(on_slurm: LocalSlurm, reference,
                                                                             tmp_path: Path) -> None:
    # a fixed sequence in the suite (a red run can be replayed); HSPMD_SOAK_SEED=random draws a new one
    given = os.environ.get("HSPMD_SOAK_SEED", str(SUITE_SEED))
    seed = random.randrange(2**31) if given == "random" else int(given)
    print(f"chaos soak seed {seed} (HSPMD_SOAK_SEED={seed} repeats it)")
    settle()
    fds, threads = open_fds(), hspmd_threads()
    run = soak(on_slurm, faults=FAULTS, seed=seed, steps=STEPS, checkpoint_dir=tmp_path / "ck", stop_when_done=True)
    print(f"seed {seed}: {len(run.faults)} faults {run.counts()}, {len(run.grows)} grows, faults over "
          f"{run.fault_seconds:.1f} s, job {run.seconds:.1f} s; recovery median "
          f"{statistics.median(f.recovered_s for f in run.faults):.2f} s, worst "
          f"{max(f.recovered_s for f in run.faults):.2f} s")
    assert len(run.faults) >= FAULTS, f"seed {seed}: only {len(run.faults)} faults before the job's last steps"
    assert run.fault_seconds <= 180, f"seed {seed}: {FAULTS} faults took {run.fault_seconds:.0f} s"
    check_soak(run, reference)
    assert_nothing_left(on_slurm, within=30.0)
    settle()
    assert hspmd_threads() == threads, hspmd_threads()
    assert open_fds() == fds, sorted(os.listdir("/proc/self/fd"))
