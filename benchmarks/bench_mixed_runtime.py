"""Scenario (c) on real workers: measured step time of mixed-length training with per-step plans against the two
baselines of the paper's §9 (c), the simulator's prediction beside each measured figure, and how much of the
per-step planning the workers waited for.

* **ours** (HSPMD): ``plan_mixed`` candidates, one per maximum length (``max_seq_lens``), ``launch(programs, ...)``:
  per step the launcher's dispatcher (ahead, in a thread) assigns the step's sequences to the cheapest candidate's
  pipelines as packed micro-batches (one row of whole sequences, attention within each), the job switches by fused
  BSR when the choice changes; measured step times include the switches; **ours, padded**: the same with
  ``packing=False`` (``rows x longest`` micro-batches, padding masked out of the loss);
* **packed (Megatron/DeepSpeed)**: the same tokens a step packed into ``CONTEXT``-token rows (the fixed-length
  path: ``launch(program, data="stdlib", seq_len=CONTEXT)``, packed standard-library bytes: the token count, not
  the content, sets the time), every symmetric strategy on the 4 ranks (DP4, DP2 x TP2, DP2 x PP2, TP2 x PP2)
  measured and the fastest kept;
* **HotSPa (per-step)**: ``plan_hotspa``'s homogeneous strategy per length bucket, run as candidates of the same
  runtime (each step under the bucket of its longest sequence, switching between buckets' strategies; packed
  micro-batches like ours).  HotSPa
  proper runs every bucket of a step in turn inside the step (switching within it); the runtime switches only at
  step boundaries, so this is the step-granular variant; the simulator's intra-step HotSPa figure is printed
  beside it.

Workloads (``--workload``, see ``WORKLOADS``): 4 local CPU workers of one kind (the paper's scenario-(c) testbed is
homogeneous too: 32 H20), a 4-layer Llama; ``short``: hidden 128, context 256, 2,048 tokens a step, documents cut
to ``sqrt(bytes) / 2`` bytes; ``long``: hidden 64, context 1,024, 4,096 tokens a step, documents cut to
``sqrt(bytes)`` bytes (97% shorter than 310 tokens: the paper's 97% below a quarter of the context).  Data: the
standard-library files, one document each (long-tailed).  Cost model: ``profile_model(link=True)`` on this machine
(``cores=2``: four workers share two cores): the compute lines, the executor's fixed cost per micro-batch and
gloo's link, for the planners, the dispatcher and the predictions alike.  ``--zero1`` runs ours with ZeRO-1 (the
packed baselines never use it; without the flag both sides keep full optimizer state).

Run: ``python benchmarks/bench_mixed_runtime.py --workload long [--repeats 3] [--steps N] [--json FILE]`` (several
minutes on 2 cores); results in ``benchmarks/results/mixed_runtime_<workload>.json``.  Loads are recorded per
configuration (the machine is shared).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hspmd_sdk import Cluster, LlamaConfig, launch, specialize
from hspmd_sdk.core.strategy import Strategy
from hspmd_sdk.core.strategy_plan import plan_from_strategy
from hspmd_sdk.planner import CostModel, plan_hotspa, plan_mixed, simulate, simulate_hotspa
from hspmd_sdk.runtime import profile_model
from hspmd_sdk.planner.mixed import MixedEntry, MixedPlan
from hspmd_sdk.runtime.data import Documents, LengthBatches, length_distribution
from hspmd_sdk.runtime.control.mixed import planning_summary

WARMUP = 2
CLUSTER = Cluster.local(4)


@dataclass(frozen=True)
class Workload:
    """A model (Llama, 4 layers, vocabulary 256), its context, the tokens of a step, how the documents are cut
    (``factor * sqrt(bytes)`` bytes), the length boundaries ``plan_mixed`` considers and HotSPa's buckets."""

    name: str
    hidden: int
    heads: int
    context: int
    tokens: int
    factor: float
    boundaries: tuple[int, ...]
    hotspa_buckets: tuple[int, ...]

    @property
    def model(self) -> LlamaConfig:
        return LlamaConfig(name=f"bench-{self.name}", vocab_size=256, hidden_size=self.hidden, num_layers=4,
                           num_heads=self.heads, ffn_hidden_size=2 * self.hidden, max_seq_len=self.context)


#: ``short``: hidden 128, context 256 -- attention is a small part of a full row's time, per-token and per-
#: micro-batch costs dominate (what a padded micro-batch wastes is not won back);
#: ``long``: hidden 64, context 1,024 -- attention is ~55% of a full 1,024-token row's forward and backward time
#: on this CPU (measured: 66 ms a row against 28 ms for the same tokens as 8 rows of 128), about its share of
#: the FLOPs for Llama-7B at the paper's 32K context: the regime of scenario (c).
WORKLOADS = {
    "short": Workload("short", 128, 4, 256, 2048, 0.5, (32, 64, 96, 128, 192, 256), (64, 256)),
    "long": Workload("long", 64, 2, 1024, 4096, 1.0, (128, 256, 384, 512, 768, 1024), (256, 1024)),
}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def documents(w: Workload) -> Documents:
    """The standard library, one document per file, each cut to its first ``w.factor * sqrt(bytes)`` bytes."""
    return Documents([d[: max(2, int(w.factor * np.sqrt(d.size)))] for d in Documents.stdlib().docs],
                     vocab_size=256)


def _strategy(w: Workload, dp: int, tp: int, pp: int, per: int) -> Strategy:
    ranks, layers = list(range(4)), w.model.num_layers
    pipes = []
    for p in range(dp):
        devs = ranks[p * tp * pp:(p + 1) * tp * pp]
        stages = [{"devices": devs[s * tp:(s + 1) * tp],
                   "layers": [s * layers // pp, (s + 1) * layers // pp - 1]} for s in range(pp)]
        pipes.append({"stages": stages, "micro_batch_size": 1, "num_micro_batches": per})
    return Strategy.load({"pipelines": pipes, "name": f"DP{dp}TP{tp}PP{pp}", "zero1": False})


def _step_times(result: Any) -> list[float]:
    steps: dict[int, float] = {}
    for ms in result.metrics.values():
        for m in ms:
            if m.step_time is not None:
                steps[m.step] = max(steps.get(m.step, 0.0), float(m.step_time))
    return [steps[k] for k in sorted(steps)]


def run_packed(w: Workload, steps: int, cost: Any) -> dict[str, Any]:
    """Every symmetric strategy on the packed rows, measured; the fastest is the baseline."""
    MODEL, CONTEXT = w.model, w.context
    rows = w.tokens // CONTEXT
    out = []
    for dp, tp, pp in ((4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2)):
        s = _strategy(w, dp, tp, pp, rows // dp)
        prog = specialize(MODEL, plan_from_strategy(MODEL, s, CLUSTER), CLUSTER, bindings={"B": rows, "S": CONTEXT})
        load = _load()
        t0 = time.perf_counter()
        r = launch(prog, CLUSTER, steps=steps, data="synthetic", seq_len=CONTEXT, timeout_s=300).wait()
        wall = time.perf_counter() - t0
        times = _step_times(r)[WARMUP:]
        sim = simulate(MODEL, s, CLUSTER, seq_len=CONTEXT, cost=cost).step_time
        out.append({"strategy": s.name, "step_s": statistics.mean(times), "steps_s": _step_times(r),
                    "sim_s": sim, "wall_s": wall, "load": load, "load_end": _load()})
        print(f"packed {s.name}: {statistics.mean(times):.3f} s/step (sim {sim:.4f}), load {load}", flush=True)
    best = min(out, key=lambda x: x["step_s"])
    return {"all": out, "best": best}


def run_candidates(w: Workload, name: str, programs: list[Any], docs: Documents, steps: int,
                   cost: Any, packing: bool = True) -> dict[str, Any]:
    TOKENS, CONTEXT = w.tokens, w.context
    load = _load()
    t0 = time.perf_counter()
    job = launch(programs, CLUSTER, steps=steps, data=docs, tokens_per_step=TOKENS, context=CONTEXT, cost=cost,
                 timeout_s=300, packing=packing)
    r = job.wait()
    wall = time.perf_counter() - t0
    summary = planning_summary(job, r)
    times = summary["step_s"]
    switches = [e for e in r.events if e.reason == "length"]
    row = {"name": name, "step_s": statistics.mean(times[WARMUP:]), "steps_s": times, "wall_s": wall,
           "choices": summary["choices"], "prediction_s": summary["estimates"],
           "prediction_mean_s": statistics.mean(summary["estimates"][WARMUP:]), "padding": summary["padding"],
           "plan_ms_mean": 1e3 * statistics.mean(summary["plan_s"][1:]), "plan_ms_max": 1e3 * max(summary["plan_s"]),
           "wait_ms_mean": 1e3 * statistics.mean(summary["wait_s"][1:]), "hidden": summary["hidden"],
           "switches": len(switches),
           "switch_s": [round(e.seconds.get("switch", 0.0), 4) for e in switches],
           "switch_plan_s": [round(e.seconds.get("specialize", 0.0), 4) for e in switches],
           "tokens": [sum(rec["lengths"]) for rec in job.length_planner.records],
           "shapes_step0": job.length_planner.records[0]["shapes"], "packing": packing,
           "micro_batches_per_pipeline": statistics.mean(len(p) for rec in job.length_planner.records
                                                         for p in rec["micro_batches"]),
           "load": load, "load_end": _load()}
    print(f"{name}: {row['step_s']:.3f} s/step (pred {row['prediction_mean_s']:.4f}), {row['switches']} switches, "
          f"planning {row['plan_ms_mean']:.2f} ms/step, {row['hidden']:.1%} hidden, load {load}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds of every configuration")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="short")
    ap.add_argument("--zero1", action="store_true", help="ours with ZeRO-1 (the packed baselines run without)")
    ap.add_argument("--json", default=None, help="default: results/mixed_runtime_<workload>.json")
    args = ap.parse_args()
    w = WORKLOADS[args.workload]
    MODEL, CONTEXT, TOKENS = w.model, w.context, w.tokens
    args.json = args.json or str(Path(__file__).parent / "results" / f"mixed_runtime_{w.name}.json")
    docs = documents(w)
    lengths = length_distribution(docs, CONTEXT)
    batches = LengthBatches(docs, context=CONTEXT, tokens_per_step=TOKENS, seed=0)
    print(f"{len(lengths)} sequences; length percentiles 50/90/97/99: {np.percentile(lengths, [50, 90, 97, 99])}; "
          f"{(lengths == CONTEXT).mean():.1%} full-context chunks", flush=True)
    t0 = time.perf_counter()
    # compute lines, the executor's fixed cost per micro-batch, and gloo's link (the TP and gradient collectives)
    cost = profile_model(MODEL, "cpu", threads=1, base=CostModel(cores=2), link=True)
    profile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = plan_mixed(MODEL, CLUSTER, lengths.tolist(), tokens_per_batch=TOKENS, context_len=CONTEXT,
                      boundaries=list(w.boundaries), cost=cost, zero1=args.zero1, packing=True)
    plan_s = time.perf_counter() - t0
    print(plan.summary(), flush=True)
    t0 = time.perf_counter()
    ours = plan.programs(MODEL, CLUSTER)
    spec_s = time.perf_counter() - t0
    hot = plan_hotspa(MODEL, CLUSTER, lengths.tolist(), tokens_per_batch=TOKENS, context_len=CONTEXT,
                      buckets=list(w.hotspa_buckets), cost=cost)
    print(hot.summary(), flush=True)
    entries = [MixedEntry(max_seq_len=b, windows=[b] * s.dp_degree, strategy=s, methods=[s.name] * s.dp_degree)
               for b, s in zip(hot.buckets, hot.strategies)]
    hot_programs = MixedPlan(context_len=CONTEXT, tokens_per_batch=TOKENS, entries=entries).programs(MODEL, CLUSTER)
    hot_sim = [simulate_hotspa(MODEL, CLUSTER, hot, batches.step_lengths(k), cost=cost).step_time
               for k in range(args.steps)]
    rows = {"workload": {"name": w.name, "model": MODEL.model_dump(mode="json"), "context": CONTEXT,
                         "tokens_per_step": TOKENS, "compression": f"{w.factor} * sqrt(bytes)", "zero1": args.zero1,
                         "sequences": int(len(lengths)),
                         "percentiles_50_90_97_99": np.percentile(lengths, [50, 90, 97, 99]).tolist(),
                         "full_context_fraction": float((lengths == CONTEXT).mean()), "steps": args.steps,
                         "warmup": WARMUP},
            "plan": plan.summary(), "plan_s": plan_s, "profile_s": profile_s, "specialize_s": spec_s, "hotspa_plan": hot.summary(),
            "hotspa_sim_intra_step_s": hot_sim}
    rows["profile"] = cost.profiles["cpu"].model_dump(mode="json", exclude={"points"})
    rounds = []
    for k in range(args.repeats):  # interleaved: every configuration once a round, under the same load
        print(f"--- round {k}", flush=True)
        rounds.append({"ours": run_candidates(w, "ours (HSPMD, per-step heterogeneous)", ours, docs, args.steps,
                                              cost),
                       "ours_padded": run_candidates(w, "ours, padded micro-batches", ours, docs, args.steps, cost,
                                                     packing=False),
                       "hotspa": run_candidates(w, "HotSPa (per-step homogeneous switching)", hot_programs, docs,
                                                args.steps, cost),
                       "packed": run_packed(w, args.steps, cost)})
    rows["rounds"] = rounds
    med = {name: statistics.median(r[name]["step_s"] for r in rounds) for name in ("ours", "ours_padded", "hotspa")}
    packed_names = [x["strategy"] for x in rounds[0]["packed"]["all"]]
    per_packed = {n: statistics.median(next(x["step_s"] for x in r["packed"]["all"] if x["strategy"] == n)
                                       for r in rounds) for n in packed_names}
    best = min(per_packed, key=per_packed.get)
    med["packed"] = per_packed[best]
    tokens = statistics.mean(rounds[0]["ours"]["tokens"][WARMUP:])
    rows["median_step_s"] = {**med, "packed_strategy": best, "packed_all": per_packed}
    rows["speedup_vs_packed"] = med["packed"] / med["ours"]
    rows["speedup_vs_hotspa"] = med["hotspa"] / med["ours"]
    rows["per_round"] = [{"x_packed": min(x["step_s"] for x in r["packed"]["all"]) / r["ours"]["step_s"],
                          "x_hotspa": r["hotspa"]["step_s"] / r["ours"]["step_s"], "load": r["ours"]["load"]}
                         for r in rounds]
    rows["tokens_per_s"] = {"ours": tokens / med["ours"], "hotspa": tokens / med["hotspa"],
                            "packed": TOKENS / med["packed"]}
    print(f"\nmedian over {args.repeats} rounds: ours {med['ours']:.3f} s/step (padded {med['ours_padded']:.3f}) | "
          f"packed best ({best}) "
          f"{med['packed']:.3f} | HotSPa per-step {med['hotspa']:.3f} | x packed {rows['speedup_vs_packed']:.2f} | "
          f"x HotSPa {rows['speedup_vs_hotspa']:.2f} | per round {rows['per_round']}")
    print("paper: Hydraulis 1.32-2.66x over packed SPMD; HSPMD's Figure 17 as a plot only")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    print(f"written {args.json}")


if __name__ == "__main__":
    main()
