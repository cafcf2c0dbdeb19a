"""Benchmark: the chaos soak (issue 25 item 5) at length -- one elastic job on a real Slurm cluster that keeps
losing a random worker (SIGKILL), having one frozen (SIGSTOP) and losing a node's network (the node's link down,
then back and the node restarted), and keeps getting its capacity back (``job.grow``), with a checkpoint after
every step.

The cluster is :class:`hspmd_sdk.testing.slurm.LocalSlurm` (three nodes, one H800 and two H20, each a network
namespace with its own ``slurmd``; the workers compute on the CPU with gloo, every rank emulated ``PACE`` times
slower so that faults land mid-step).  The driver is :func:`tests/test_chaos_soak.soak` (the suite runs it with
10 faults); here it runs ``--faults`` faults (default 100) in one job, then a failure-free run of the same job
(same plan, pace and checkpoints) for the throughput baseline.

Reported (and written to ``benchmarks/results/soak.json``):

* **faults survived**: faults injected, each recovered (its ``failure`` event ``done``), the job ``succeeded`` (or
  ``stopped`` by ``job.stop()`` once the faults were over), every loss any rank reported equal to the
  single-device model's (fp32, relative 1e-5), every fault and grow exactly one event, nothing left on any node and
  no ``srun``/Slurm job left; per kind;
* **recovery**: median and worst seconds from the injection to the recovery event seen ``done`` (wall clock,
  polled every 20 ms), per kind, and the event's own ``seconds["total"]`` (detect + plan + specialize +
  switch, from the first evidence of the failure: for SIGSTOP and a cut link it excludes the heartbeat silence
  before the launcher suspects the rank); grows: median and worst seconds from ``job.grow`` to its event ``done``
  (a newcomer's ``srun`` and Python start-up included);
* **steps per minute** from the first step to the job's end, under faults and failure-free (startup excluded).
  The soak's steps include the ones redone after reloading a checkpoint and the time spent at grow boundaries
  waiting for newcomers; after grows the job runs the planner's plan for three ranks, not the initial one.

Run (root, Slurm's daemons installed: ``apt-get install -y slurm-wlm munge``)::

    python benchmarks/bench_soak.py                 # 100 faults
    python benchmarks/bench_soak.py --faults 30     # shorter
    python benchmarks/bench_soak.py --seed 123      # repeat a run's choices (timing still varies)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

RESULTS = REPO / "benchmarks" / "results" / "soak.json"


def _stats(xs: list[float]) -> dict[str, float | None]:
    return {"median": round(statistics.median(xs), 3) if xs else None, "worst": round(max(xs), 3) if xs else None,
            "n": len(xs)}


def _steps_per_min(run: Any) -> float:
    span = run.seconds - run.first_step_s
    return round((run.steps - 1) / span * 60.0, 2) if span > 0 else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", type=int, default=100)
    ap.add_argument("--steps", type=int, default=None, help="the soak job's steps (default 4 per fault + 30)")
    ap.add_argument("--baseline-steps", type=int, default=None,
                    help="steps of the failure-free run (default: as many as the soak's, so that it also shows the "
                         "loss tolerance holds for that many steps without faults)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--dump", type=Path, default=None,
                    help="also write every step's relative loss error (job and per rank) and every event here (JSON)")
    args = ap.parse_args(argv)

    import test_chaos_soak as soak_mod
    from hspmd_sdk import LlamaConfig
    from hspmd_sdk.runtime.control.train import reference_training
    from hspmd_sdk.testing.slurm import LocalSlurm, slurm_unavailable
    from test_slurm import assert_nothing_left

    why = slurm_unavailable()
    if why:
        print(f"bench_soak: cannot run a local Slurm cluster here: {why}")
        return 2
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    steps = args.steps or 12 * args.faults + 30  # a bound: the faulted job stops once its faults are over
    args.steps_given_for_baseline = bool(args.baseline_steps)
    args.baseline_steps = args.baseline_steps or steps
    print(f"chaos soak: {args.faults} faults, {steps} steps, seed {seed}")
    reference = reference_training(LlamaConfig.preset("tiny"), steps=max(steps, args.baseline_steps),
                                   seed=soak_mod.SEED, global_batch=8, seq_len=soak_mod.SEQ, lr=soak_mod.LR)
    out: dict[str, Any] = {"faults_requested": args.faults, "steps": steps, "seed": seed, "pace": soak_mod.PACE,
                           "nodes": [f"{n.name} ({n.kind})" for n in soak_mod.NODES], "checkpoint_every": 1}
    with LocalSlurm(soak_mod.NODES, slurmd_timeout_s=120) as lab, tempfile.TemporaryDirectory() as tmp:
        os.environ.update(lab.env)
        soak_mod.settle()
        fds, threads = soak_mod.open_fds(), soak_mod.hspmd_threads()
        run = soak_mod.soak(lab, faults=args.faults, seed=seed, steps=steps, checkpoint_dir=Path(tmp) / "soak",
                            deadline_s=24 * 3600.0, stop_when_done=True)
        ok: dict[str, Any] = {}
        try:
            soak_mod.check_soak(run, reference)
            ok["checks"] = "passed"
        except AssertionError as e:
            ok["checks"] = f"FAILED: {str(e)[:2000]}"
        try:
            assert_nothing_left(lab, within=30.0)
            ok["nothing_left"] = True
        except AssertionError as e:
            ok["nothing_left"] = f"FAILED: {e}"
        soak_mod.settle()
        ok["fds_back"] = soak_mod.open_fds() == fds
        ok["threads_back"] = soak_mod.hspmd_threads() == threads
        left = sorted(p.name for p in (Path(tmp) / "soak").iterdir() if p.name.startswith(".tmp"))
        ok["checkpoint_temp_dirs_left"] = left
        if not args.steps_given_for_baseline:  # the failure-free run trains as many steps as the faulted one did
            args.baseline_steps = len(run.result.losses) if run.result is not None else args.baseline_steps
        base = soak_mod.soak(lab, faults=0, seed=seed, steps=args.baseline_steps,
                             checkpoint_dir=Path(tmp) / "base", deadline_s=3600.0)
        base_max_err = max(abs(a - b) / abs(b) for a, b in zip(base.result.losses, reference.losses))
        base_losses_equal = all(abs(a - b) <= soak_mod.TOL * abs(b)
                                for a, b in zip(base.result.losses, reference.losses))

    faults = run.faults
    survived = ([f for f in faults if f.recovered_s is not None] if run.job.status.value in ("succeeded", "stopped")
                else [])  # stopped: ended by job.stop() once the faults were over (stop_when_done)
    out.update({
        "faults_injected": len(faults), "faults_survived": len(survived), "per_kind": run.counts(),
        "grows": len(run.grows), "job_status": run.job.status.value,
        "recovery_s": _stats([f.recovered_s for f in faults if f.recovered_s is not None]),
        "recovery_s_by_kind": {k: _stats([f.recovered_s for f in faults if f.kind == k and f.recovered_s])
                               for k in soak_mod.KINDS},
        "event_total_s": _stats([f.event.seconds["total"] for f in faults if f.event is not None]),
        "from_checkpoint": sum(1 for f in faults if f.event is not None and f.event.source == "checkpoint"),
        "grow_s": _stats([g.grown_s for g in run.grows if g.grown_s is not None]),
        "soak_seconds": round(run.seconds, 1), "fault_phase_seconds": round(run.fault_seconds, 1),
        "startup_s": round(run.first_step_s, 2),
        "steps_per_min": {"soak": _steps_per_min(run), "failure_free": _steps_per_min(base),
                          "failure_free_steps": base.steps, "failure_free_seconds": round(base.seconds, 1),
                          "failure_free_losses_equal": base_losses_equal,
                          "failure_free_max_rel_err": base_max_err},
        "checks": ok,
        "faults": [{"kind": f.kind, "host": f.host, "rank": f.rank, "step": f.step,
                    "recovered_s": None if f.recovered_s is None else round(f.recovered_s, 3),
                    "event": None if f.event is None else {
                        "step": f.event.step, "source": f.event.source,
                        "seconds": {k: round(v, 3) for k, v in f.event.seconds.items()}}} for f in faults],
    })
    if args.dump is not None:
        ref = reference.losses
        per_rank: dict[int, float] = {}
        for r in run.job.metrics.ranks():
            for m in run.job.metrics.rank(r):
                if m.loss is not None:
                    err = abs(m.loss - ref[m.step]) / abs(ref[m.step])
                    per_rank[m.step] = max(per_rank.get(m.step, 0.0), err)
        args.dump.write_text(json.dumps({
            "seed": seed,
            "final_rel_err": [abs(a - b) / abs(b) for a, b in zip(run.result.losses, ref)],
            "rank_rel_err": [per_rank.get(s) for s in range(steps)],
            "events": [{"step": e.step, "reason": e.reason, "failed_ranks": e.failed_ranks, "source": e.source,
                        "checkpoint_step": e.checkpoint_step, "strategy": str(e.strategy), "ranks": e.ranks}
                       for e in run.result.events]}, indent=1, default=str) + "\n")
    sp = out["steps_per_min"]
    sp["ratio"] = round(sp["soak"] / sp["failure_free"], 3) if sp["failure_free"] else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")

    rec, ev, gr = out["recovery_s"], out["event_total_s"], out["grow_s"]
    rows = [("faults injected / survived", f"{len(faults)} / {len(survived)}"),
            ("per kind", ", ".join(f"{k} {v}" for k, v in run.counts().items())),
            ("recovered from a checkpoint", str(out["from_checkpoint"])),
            ("grows", str(len(run.grows))),
            ("recovery, injection -> done (median / worst)", f"{rec['median']} / {rec['worst']} s"),
            *[(f"  {k}", f"{v['median']} / {v['worst']} s") for k, v in out["recovery_s_by_kind"].items()],
            ("event total (median / worst)", f"{ev['median']} / {ev['worst']} s"),
            ("grow, request -> done (median / worst)", f"{gr['median']} / {gr['worst']} s"),
            ("steps/min under faults", str(sp["soak"])),
            ("steps/min failure-free", str(sp["failure_free"])),
            ("ratio", str(sp["ratio"])),
            ("checks", json.dumps(ok))]
    width = max(len(a) for a, _ in rows)
    print()
    for a, b in rows:
        print(f"{a:<{width}}  {b}")
    print(f"\nwritten to {args.out}")
    return 0 if ok.get("checks") == "passed" and ok.get("nothing_left") is True else 1


if __name__ == "__main__":
    sys.exit(main())
