"""The control plane at scale, measured by simulation (issue 45 item 2): the real launcher, job and controller
against thousands of simulated workers (:mod:`sim_workers`, :mod:`sim_host`: the real protocol, no torch work).

Per world size (1,024 / 4,096 / 10,240 ranks, hosts of 8), one elastic job of Llama ``tiny`` (4 layers) on TP2
pipelines (``world / 2`` of them, one micro-batch each), whose workers get their own Program parts:

* ``launch_s``: the ``launch()`` call (the launch spec, every rank's launch line with its part, written to the
  simulated hosts); ``ready_s``: from the call to every rank ``ready``;
* ``step_cpu_s``: the launcher process's CPU seconds a step, in steady state (reading every rank's metric and
  beat lines, the job's and controller's bookkeeping), with ``step_s`` of simulated step;
* ``failure``: one rank lost (as by SIGKILL): ``detect_s`` (the exit to the recovery's start: the controller's
  debounce included), ``decide_s`` (replan + specialize + the switch plan), ``sent_s`` (the loss to the last
  survivor's ``reconfigure`` written), ``done_s`` (to every survivor ``switched``);
* ``switch`` (before the failure): ``job.switch`` to PP2 pipelines on the same pairs of ranks: ``call_s`` (plan +
  every part written), ``done_s`` (to every rank ``switched``);
* ``launch_bytes`` / ``reconfigure_bytes`` / ``switch_bytes``: per rank (max, mean) and in total;
* ``rss_mb``: the launcher's peak resident memory.

The fitted exponent of each figure against the world size (``seconds = c * ranks^k``) is printed and written.

Run: ``python benchmarks/bench_control.py`` (``--ranks 1024 4096`` for fewer points; ``--parts-70b 1024 10240``
writes every rank's Program part of Llama-70B, the ``bench_scale`` strategy, in one process instead).  Figures:
``benchmarks/results/control.json``.  Goals (issue 45, at 10,240 simulated ranks): all ready < 60 s, failure
detected < 2 s, recovery decided and every message sent < 10 s, launcher memory < 4 GB; a launch message per
worker that does not grow with the world.
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_workers import SimTransport  # noqa: E402

from hspmd_sdk import Cluster, LlamaConfig, Strategy, specialize  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.runtime.control.train import launch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = LlamaConfig.preset("tiny")
SEQ = 16


def _pipe(stages: list[tuple[list[int], list[int]]]) -> dict[str, Any]:
    return {"stages": [{"devices": d, "layers": l} for d, l in stages], "micro_batch_size": 1,
            "num_micro_batches": 1}


def strategies(world: int) -> tuple[Strategy, Strategy, Cluster]:
    """TP2 pipelines on every pair of ranks, and PP2 pipelines (two stages of two layers) on the same pairs."""
    tp2 = Strategy.load({"pipelines": [_pipe([([2 * i, 2 * i + 1], [0, 3])]) for i in range(world // 2)],
                         "name": f"TP2 x {world // 2}"})
    pp2 = Strategy.load({"pipelines": [_pipe([([2 * i], [0, 1]), ([2 * i + 1], [2, 3])]) for i in range(world // 2)],
                         "name": f"PP2 x {world // 2}"})
    return tp2, pp2, Cluster.mixed({"H800": world // 2, "H20": world // 2})


def program(strategy: Strategy, cluster: Cluster) -> Any:
    return specialize(MODEL, plan_from_strategy(MODEL, strategy, cluster), cluster,
                      bindings={"B": cluster.num_ranks // 2, "S": SEQ})


def _wait(what: str, cond: Callable[[], bool], timeout: float) -> float:
    t0 = time.perf_counter()
    while not cond():
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.05)
    return time.perf_counter()


def _bytes(sent: list[tuple[int, int]]) -> dict[str, float]:
    sizes = [b for _, b in sent]
    return {"max": max(sizes), "mean": round(sum(sizes) / len(sizes), 1), "total": sum(sizes), "messages": len(sizes)} \
        if sizes else {}


def run_world(world: int, *, processes: int, step_s: float, steps: int) -> dict[str, Any]:
    """One elastic job on ``world`` simulated ranks: launch, steady steps, one lost rank, one user switch."""
    t0 = time.perf_counter()
    slow = max(1.0, world / 1024)  # the waits' limits grow with the world (a loaded machine at 4,096 ranks)
    tp2, pp2, cluster = strategies(world)
    first, second = program(tp2, cluster), program(pp2, cluster)
    build_s = time.perf_counter() - t0
    transport = SimTransport(processes, step_s=step_s)
    out: dict[str, Any] = {"ranks": world, "hosts": len(cluster.nodes), "sim_processes": processes,
                           "step_s": step_s, "build_s": round(build_s, 3)}
    try:
        t_call = time.perf_counter()
        job = launch(first, cluster, steps=steps, seq_len=SEQ, elastic=True, transport=transport, progress=False,
                     preflight=False, resource_check=False, timeout_s=600, heartbeat_s=1.0)
        out["launch_s"] = round(time.perf_counter() - t_call, 3)

        t_ready = _wait("every rank ready", lambda: job.startup().phases.get("rendezvous") is not None, 600 * slow)
        out["ready_s"] = round(t_ready - t_call, 3)
        # steady steps: the launcher's CPU a step
        _wait("step 2", lambda: job.metrics.last_step() >= 2, 120)
        c0, s0, w0 = time.process_time(), job.metrics.last_step(), time.perf_counter()
        _wait("step 6", lambda: job.metrics.last_step() >= s0 + 4, 120)
        c1, s1, w1 = time.process_time(), job.metrics.last_step(), time.perf_counter()
        out["step_cpu_s"] = round((c1 - c0) / (s1 - s0), 4)
        out["step_wall_s"] = round((w1 - w0) / (s1 - s0), 4)
        # a user switch to PP2 pipelines on the same ranks
        t_call2 = time.perf_counter()
        ev = job.switch(second)
        call_s = time.perf_counter() - t_call2
        out["switch"] = {"call_s": round(call_s, 3)}
        _wait("the switch", lambda: ev.done, 300 * slow)
        out["switch"] = {"call_s": round(call_s, 3), "sent_s": round(transport.last_sent["switch"] - t_call2, 3),
                         "done_s": round(time.perf_counter() - t_call2, 3), "plan_s": round(ev.seconds["plan"], 3)}
        out["switch_bytes"] = _bytes(transport.sent.get("switch", []))
        # one rank lost
        lost = world // 2 + 3
        t_lose = time.perf_counter()
        transport.lose([lost])
        _wait("the recovery", lambda: any(e.reason == "failure" and e.done for e in job.events), 300 * slow)
        t_done = time.perf_counter()
        event = next(e for e in job.events if e.reason == "failure")
        sent = transport.sent.get("reconfigure", [])
        out["failure"] = {"detect_s": round(event.seconds.get("detect", 0.0), 3),
                          "decide_s": round(event.seconds.get("plan", 0.0) + event.seconds.get("specialize", 0.0), 3),
                          "sent_s": round(transport.last_sent["reconfigure"] - t_lose, 3),
                          "done_s": round(t_done - t_lose, 3), "survivors": len(sent),
                          "failed_ranks": list(event.failed_ranks), "whole_messages": sum(
                              1 for _ in transport.whole.get("reconfigure", ()))}
        out["reconfigure_bytes"] = _bytes(sent)
        job.stop()
        job.wait(timeout=120)
        out["launch_bytes"] = _bytes(transport.sent["launch"])
        out["status"] = str(job.status.value if hasattr(job.status, "value") else job.status)
    except (TimeoutError, RuntimeError) as e:  # what was measured before it is kept (a failed job, a wait's limit)
        out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        for kind in ("launch", "switch", "reconfigure"):
            out.setdefault(f"{kind}_bytes", _bytes(transport.sent.get(kind, [])))
    finally:
        transport.close()
        out["sim_hosts_left"] = len(transport.alive())
    out["rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def parts_70b(world: int) -> dict[str, Any]:
    """Every rank's Program part of Llama-70B (the ``bench_scale`` strategy on ``world`` mixed ranks) written in one
    process, as a launcher writes them (``part_json``): seconds (wall and CPU) in all and a part, and the classes
    whose first part was made whole."""
    from bench_scale import MODEL as LLAMA_70B, scale_strategy

    from hspmd_sdk.core.program_part import part_json

    strategy, cluster = scale_strategy(world)
    prog = specialize(LLAMA_70B, plan_from_strategy(LLAMA_70B, strategy, cluster), cluster)
    prog.digest()
    t0, c0, nbytes = time.perf_counter(), time.process_time(), 0
    for r in prog.ranks:
        nbytes += len(part_json(prog, r))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    writer = prog._micro[("part_writer",)]
    return {"ranks": world, "parts": len(prog.ranks), "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "ms_per_part_cpu": round(cpu / len(prog.ranks) * 1e3, 2), "classes": len(writer._classes),
            "fallbacks": writer.fallbacks, "mean_part_bytes": nbytes // len(prog.ranks),
            "rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "load": Path("/proc/loadavg").read_text().split()[0]}


def fit_exponent(xs: list[float], ys: list[float]) -> float | None:
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if y > 0]
    if len(pts) < 2:
        return None
    mx, my = sum(p[0] for p in pts) / len(pts), sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return round(sum((p[0] - mx) * (p[1] - my) for p in pts) / den, 3) if den else None


FIGURES = (("launch_s",), ("ready_s",), ("step_cpu_s",), ("failure", "detect_s"), ("failure", "decide_s"),
           ("failure", "sent_s"), ("failure", "done_s"), ("switch", "call_s"), ("launch_bytes", "max"), ("launch_bytes", "total"),
           ("rss_mb",))


def _get(row: dict[str, Any], path: tuple[str, ...]) -> float | None:
    v: Any = row
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return float(v) if isinstance(v, (int, float)) else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 10240])
    p.add_argument("--processes", type=int, default=4, help="simulated host processes")
    p.add_argument("--step-s", type=float, default=1.0, help="seconds of a simulated step")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--out", default=str(RESULTS / "control.json"))
    p.add_argument("--parts-70b", type=int, nargs="*", default=[], metavar="RANKS",
                   help="only write every rank's Program part of Llama-70B at these world sizes (no launch)")
    args = p.parse_args(argv)
    if args.parts_70b:
        rows = []
        for world in args.parts_70b:
            rows.append(parts_70b(world))
            print(json.dumps(rows[-1]), flush=True)
        out = {"parts_70b": rows}
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        return out
    rows = []
    for world in args.ranks:
        print(f"== {world} simulated ranks", flush=True)
        try:
            row = run_world(world, processes=args.processes, step_s=args.step_s, steps=args.steps)
        except (TimeoutError, RuntimeError) as e:  # the figures of the other world sizes are still written
            row = {"ranks": world, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(json.dumps(row), flush=True)
        rows.append(row)
    fits = {".".join(f): fit_exponent([r["ranks"] for r in rows], [_get(r, f) or 0.0 for r in rows])
            for f in FIGURES}
    out = {"rows": rows, "exponents": fits, "load": Path("/proc/loadavg").read_text().split()[:3]}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print("exponents:", json.dumps(fits))
    return out


if __name__ == "__main__":
    main()
