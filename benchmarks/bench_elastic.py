"""Benchmark: reconfiguration of a running job (paper §7, §9 (b), §10; Tables 4 and 5).

Six parts, each against a named peer or the paper's figures:

1. **C1 -> C2 on the paper's cluster, planned** (pure core, the real 32B Llama, Table 11's strategies, 32 H20
   with rank 31 lost): seconds of the online phases -- planning (``replan_elastic``), specialization of C2,
   planning the switch of every parameter and Adam moment -- against Table 5 (planning 0.05-1.2 s,
   specialization 6.2-7.9 s, switching 2.2-5.3 s), and the bytes each rank sends over NVLink and over IB under
   fused BSR and under the unfused baseline without heuristics, against Table 4.
2. **The switch on real processes** (gloo, CPU): one reconfiguration (8 ranks, two TP2 pipelines, the last rank
   lost) moved by fused BSR, per-tensor BSR with and without heuristics, and a gather-everything broadcast of
   torch collectives (every survivor rebuilds each tensor whole); every method checked against the new layout
   built directly.
3. **Elastic recovery in a training job vs checkpoint-and-restart**: a worker SIGKILLed in step 2's backward of a
   6-rank job (two pipelines of three stages), for the tiny Llama and a 14M-parameter one: the event's breakdown
   (detect, plan, specialize, switch) and the time until the redone step is done, against stopping everything
   and relaunching the survivors' plan from a checkpoint (``bench_checkpoint.restart``), which also loses every
   step since that checkpoint.
4. **A straggler**: a 2-rank data-parallel job whose rank 1 turns 4x slower: median step time before, while
   slowed under the old plan, and after the replan, against the simulator's predicted gain on the slowed cluster.
5. **Growing back vs checkpoint-and-restart** (issue 25): the 6-rank job of part 3 loses a rank, shrinks in
   memory, then grows back onto a new worker (``job.grow``): the time until every worker switched and until the
   first grown step is done, against checkpointing the 5-rank plan and relaunching the 6-rank plan from it, with
   workers forked from the fork server and with fresh processes (``LocalTransport(fork=False)``).
6. **A straggler in a mixed-length run**: candidates TP2 and two one-rank pipelines, rank 1 turning 4x slower:
   median step time after the dispatch was repriced, against the same run without ``straggler=`` (the same steps
   and sequences).

Figures are written to ``benchmarks/results/elastic.json``.  ``--quick`` runs fewer repeats.

Run: ``python benchmarks/bench_elastic.py``
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hspmd_sdk import Cluster, LlamaConfig, Strategy, launch, specialize  # noqa: E402
from hspmd_sdk.core.model_spec import model_json  # noqa: E402
from hspmd_sdk.core.reconfigure import plan_program_switch  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.models.registry import class_path  # noqa: E402
from hspmd_sdk.planner.elastic import renumber, replan_elastic, slowed_cluster, survivor_cluster  # noqa: E402

EXAMPLES = REPO / "hspmd_sdk" / "examples"
RESULTS = REPO / "benchmarks" / "results" / "elastic.json"
SEQ, SEED, LR = 32, 0, 1e-3
MB = 2 ** 20
#: a 14M-parameter Llama (166 MB of parameters and Adam moments) that a 2-core CPU trains in a few seconds a step
SMALL = LlamaConfig(vocab_size=4096, hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=6,
                    ffn_hidden_size=1024, max_seq_len=128)

#: Table 4 of the paper, MB sent per rank ``(NVLink, IB)``
PAPER_TABLE4 = {
    "unfused, no heuristics": {4: (0, 748), 5: (0, 747), 6: (0, 747), 7: (0, 747), 8: (0, 1495), 9: (0, 1495),
                               10: (0, 1495), 11: (0, 1495), 12: (0, 5517), 13: (0, 11496), 14: (0, 8222),
                               15: (0, 11496)},
    "fused BSR": {8: (0, 747), 9: (0, 747), 10: (0, 747), 11: (0, 747), 15: (0, 11496), 20: (748, 0),
                  21: (748, 0), 22: (748, 0), 23: (748, 0), 24: (0, 748), 25: (0, 748), 26: (0, 748), 27: (0, 748),
                  28: (5517, 0), 29: (11496, 0), 30: (8222, 0)},
}
PAPER_TABLE5 = {"plan": (0.05, 1.2), "specialize": (6.2, 7.9), "switch": (2.2, 5.3)}


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def pipe(stages: list[tuple[list[int], list[int]]], mbs: int, n: int) -> dict[str, Any]:
    return {"stages": [{"devices": d, "layers": l} for d, l in stages], "micro_batch_size": mbs,
            "num_micro_batches": n}


def program_of(model: Any, data: Any, cluster: Cluster, batch: int = 8) -> Any:
    strategy = data if isinstance(data, Strategy) else Strategy.load(data, model=model, cluster=cluster)
    return specialize(model, plan_from_strategy(model, strategy, cluster), cluster,
                      bindings={"B": batch, "S": SEQ})


def _timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


# ---- 1. C1 -> C2, planned ---------------------------------------------------------------------------------------
def per_rank_mb(plan: Any, cluster: Cluster) -> dict[int, tuple[float, float]]:
    """MB each rank sends over intra-node (NVLink) and inter-node (IB) links under a switch plan."""
    out: dict[int, list[float]] = {}
    for step in plan.steps:
        for m in step.messages:
            row = out.setdefault(m.src, [0.0, 0.0])
            row[0 if cluster.link(m.src, m.dst).cls == "intra" else 1] += m.nbytes / MB
    return {r: (a, b) for r, (a, b) in sorted(out.items())}


def paper_c1_c2() -> dict[str, Any]:
    model = LlamaConfig.preset("llama-32b")
    c32 = Cluster.model_validate_json((EXAMPLES / "h20_32.json").read_text())
    c31 = Cluster.model_validate_json((EXAMPLES / "h20_31.json").read_text())
    c1 = Strategy.load(json.loads((EXAMPLES / "table11_c1.json").read_text()), model=model, cluster=c32)
    c2 = Strategy.load(json.loads((EXAMPLES / "table11_c2.json").read_text()), model=model, cluster=c31)
    src = specialize(model, plan_from_strategy(model, c1, c32), c32)
    plan_s, replanned = _timed(lambda: replan_elastic(model, c32, c1, [31], seq_len=4096))
    spec_s, dst = _timed(lambda: specialize(model, plan_from_strategy(model, c2, c31), c31))
    out: dict[str, Any] = {"seconds": {"plan (replan_elastic)": plan_s, "specialize C2": spec_s},
                           "replanned": replanned.summary(model, c31), "methods": {}}
    print(f"C1 -> C2 (32B, 32 H20, rank 31 lost): planning {plan_s:.2f} s (paper 0.05-1.2 s), specialization "
          f"{spec_s:.2f} s (paper 6.2-7.9 s, incl. creating NCCL groups)")
    for name, kw in (("fused BSR", {}), ("unfused BSR", {"fused": False}),
                     ("unfused, no heuristics", {"fused": False, "heuristics": False})):
        secs, sw = _timed(lambda: plan_program_switch(src, dst, c32, failed=[31], **kw))
        sent = per_rank_mb(sw, c32)
        total = sum(a + b for a, b in sent.values())
        row: dict[str, Any] = {"plan_s": secs, "estimated_switch_s": sw.estimated_time(), "total_mb": total,
                               "sent_mb": {str(r): v for r, v in sent.items()}}
        print(f"  {name:<24} switch planned in {secs:.2f} s; {total / 1024:.1f} GiB in all; estimated switch "
              f"{sw.estimated_time():.2f} s on H20 links (paper measured 2.2-5.3 s)")
        paper = PAPER_TABLE4.get(name)
        if paper is not None:
            ratios = [(sent[r][0] + sent[r][1]) / (a + b) for r, (a, b) in paper.items() if r in sent]
            same_links = all(r in sent and (sent[r][0] > 0) == (a > 0) and (sent[r][1] > 0) == (b > 0)
                             for r, (a, b) in paper.items())
            row.update({"paper_senders": sorted(paper), "same_senders": sorted(sent) == sorted(paper),
                        "same_link_classes": same_links, "mb_over_paper": [min(ratios), max(ratios)]})
            print(f"    vs Table 4: same senders {sorted(sent) == sorted(paper)}, same NVLink/IB split {same_links}, "
                  f"each rank's MB / paper's {min(ratios):.2f}-{max(ratios):.2f}")
            for r in sorted(set(sent) | set(paper)):
                a, b = sent.get(r, (0.0, 0.0))
                pa, pb = paper.get(r, (0, 0))
                print(f"      R{r:<3} ours {a:8.0f} | {b:8.0f}   paper {pa:6d} | {pb:6d}")
        out["methods"][name] = row
    return out


# ---- 2. the switch on real processes ----------------------------------------------------------------------------
def switch_methods(repeats: int) -> dict[str, Any]:
    from hspmd_sdk.runtime import LocalTransport, launch

    model, world = SMALL, 8
    cluster = Cluster.local(world)
    src = {"pipelines": [pipe([([0, 1], [0, 2]), ([2, 3], [3, 5])], 2, 2),
                         pipe([([4, 5], [0, 2]), ([6, 7], [3, 5])], 2, 2)]}
    survivors, _ = survivor_cluster(cluster, [world - 1])
    dst_strategy = replan_elastic(model, cluster, Strategy.load(src, model=model, cluster=cluster), [world - 1],
                                  seq_len=SEQ)
    src_prog = program_of(model, src, cluster)
    dst_prog = program_of(model, dst_strategy, survivors)
    payload = {"model": model_json(model), "model_class": class_path(model), "cluster": cluster.model_dump(),
               "bindings": {"B": 8, "S": SEQ}, "src_plan": src_prog.plan.model_dump(),
               "dst_plan": dst_prog.plan.model_dump(), "dst_cluster": survivors.model_dump(),
               "failed": [world - 1], "seed": SEED, "repeats": repeats}
    before = load()
    res = launch(None, cluster, steps=1, entry="benchmarks._switch_peers:switch_methods_entry", payload=payload,
                 timeout_s=900, transport=LocalTransport(cwd=str(REPO))).wait()
    per_rank = [res.results[r] for r in sorted(res.results)]
    methods = list(per_rank[0]["times"])
    out: dict[str, Any] = {"state_mb": model_mb(model), "from": "2 pipelines x 2 stages x TP2 (8 ranks)", "to": dst_strategy.name,
                           "load_before": before, "load_after": load(), "methods": {}}
    fused = max(r["times"]["fused BSR"] for r in per_rank)
    print(f"switch on real processes ({world} ranks, rank {world - 1} lost, {model_mb(model):.0f} MB of state):")
    for m in methods:
        secs = max(r["times"][m] for r in per_rank)  # barriers on both sides: every rank's time is the same span
        correct = all(r["correct"][m] for r in per_rank)
        sent = sum(r["sent"].get(m, 0) for r in per_rank) / MB if m in per_rank[0]["sent"] else None
        busiest = max(r["sent"].get(m, 0) for r in per_rank) / MB if m in per_rank[0]["sent"] else None
        out["methods"][m] = {"seconds": secs, "ratio_to_fused": secs / fused, "correct": correct,
                             "sent_mb": sent, "busiest_sender_mb": busiest,
                             "messages": sum(r["messages"].get(m, 0) for r in per_rank),
                             "plan_s": max(r["plan_s"].get(m, 0.0) for r in per_rank)}
        vol = f"{sent:7.1f} MB sent, busiest rank {busiest:6.1f} MB" if sent is not None else "(torch broadcasts)"
        print(f"  {m:<28} {secs * 1e3:8.1f} ms  x{secs / fused:5.2f} of fused  {vol}  new layout exact: {correct}")
    return out


def model_mb(model: Any) -> float:
    return sum(12 * _numel(s) for s in model.param_shapes().values()) / MB


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# ---- 3. elastic recovery vs checkpoint-and-restart --------------------------------------------------------------
SIX = {"pipelines": [pipe([([0], [0, 0]), ([1], [1, 2]), ([2], [3, 3])], 2, 2),
                     pipe([([3], [0, 1]), ([4], [2, 2]), ([5], [3, 3])], 2, 2)]}
SIX_SMALL = {"pipelines": [pipe([([0], [0, 1]), ([1], [2, 3]), ([2], [4, 5])], 2, 2),
                           pipe([([3], [0, 1]), ([4], [2, 3]), ([5], [4, 5])], 2, 2)]}


def elastic_recovery(model: Any, data: dict, steps: int = 5, kill: int = 4, at_step: int = 2) -> dict[str, Any]:
    from hspmd_sdk.runtime.control.train import launch

    cluster = Cluster.local(6)
    job = launch(program_of(model, data, cluster), cluster, steps=steps, seed=SEED, seq_len=SEQ, lr=LR,
                          elastic=True, fault_injection=[{"rank": kill, "step": at_step, "at": "backward"}],
                          heartbeat_s=0.5, timeout_s=300)
    res = job.wait(timeout=900)
    event = next(e for e in res.events if e.reason == "failure" and e.done)
    times = {s: max(m.step_time for ms in res.metrics.values() for m in ms if m.step == s) for s in range(steps)}
    before = med([times[s] for s in range(1, at_step)])
    after = med([times[s] for s in range(at_step + 1, steps)])
    return {"seconds": dict(event.seconds), "bytes": dict(event.bytes), "strategy": event.strategy.name,
            "redone_step_s": times[at_step], "recovered_s": event.seconds["total"] + times[at_step],
            "step_before_s": before, "step_after_s": after, "losses": list(res.losses)}


def restart_peer(model: Any, data: dict, kill: int = 4) -> dict[str, float]:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_checkpoint import restart  # the checkpoint-and-restart path, timed (bench_checkpoint.py)

    six = Cluster.local(6)
    five, mapping = survivor_cluster(six, [kill])
    strategy = replan_elastic(model, six, Strategy.load(data, model=model, cluster=six), [kill], seq_len=SEQ)
    with tempfile.TemporaryDirectory() as d:
        return restart(program_of(model, data, six), six, program_of(model, renumber(strategy, mapping), five), five,
                       Path(d),
                       seq_len=SEQ)


def recovery_vs_restart(rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, model, data in (("tiny Llama", LlamaConfig.preset("tiny"), SIX),
                               ("14M Llama", SMALL, SIX_SMALL)):
        el = [elastic_recovery(model, data) for _ in range(rounds)]
        rs = [restart_peer(model, data) for _ in range(rounds)]
        e = {k: med([r["seconds"][k] for r in el]) for k in el[0]["seconds"]}
        row = {"elastic": {"median_seconds": e, "recovered_s": med([r["recovered_s"] for r in el]),
                           "step_before_s": med([r["step_before_s"] for r in el]),
                           "step_after_s": med([r["step_after_s"] for r in el]), "bytes": el[0]["bytes"],
                           "strategy": el[0]["strategy"], "rounds": el},
               "restart": {"median_seconds": {k: med([r[k] for r in rs]) for k in rs[0]}, "rounds": rs}}
        rec, rst = row["elastic"]["recovered_s"], row["restart"]["median_seconds"]["total"]
        row["restart_over_elastic"] = rst / rec
        out[label] = row
        print(f"elastic recovery, {label} ({model_mb(model):.0f} MB of state), rank 4 killed in step 2:  detect "
              f"{e['detect']:.2f} s, plan {e['plan']:.2f} s, specialize {e['specialize']:.2f} s, switch "
              f"{e['switch']:.2f} s = {e['total']:.2f} s; redone step done after {rec:.2f} s  | checkpoint-and-"
              f"restart to the first step: {rst:.2f} s (x{rst / rec:.1f}), plus the steps since the checkpoint")
    return out


# ---- 5. growing back vs checkpoint-and-restart --------------------------------------------------------------------
def _transport(fork: bool) -> Any:
    from hspmd_sdk.runtime.transports.transport import LocalTransport

    return lambda: LocalTransport(fork=fork)


def grow_back(model: Any, data: dict, fork: bool, kill: int = 4) -> dict[str, Any]:
    """A 6-rank elastic job loses rank ``kill`` in step 2 (it shrinks to 5 in memory), then grows back to 6 ranks
    (a new local worker, the original 6-rank plan): the grow event's parts, and the wall time from ``job.grow`` until
    every worker switched (the newcomer started, joined the larger world and received its state).  The job has
    steps enough to train on while a fresh newcomer starts (it is cancelled once the grow is measured): nearer its
    end a grow waits for its newcomers at the boundary (``grow.NEAR_THE_END``)."""
    from hspmd_sdk.runtime.control.train import launch

    six = Cluster.local(6)
    job = launch(program_of(model, data, six), six, steps=400, seed=SEED, seq_len=SEQ, lr=LR, elastic=True,
                          fault_injection=[{"rank": kill, "step": 2, "at": "backward"}], heartbeat_s=0.5,
                          timeout_s=300, transport=_transport(fork)())
    try:
        deadline = time.monotonic() + 300
        while not any(e.reason == "failure" and e.done for e in job.events):
            if time.monotonic() > deadline or job.status.value != "running":
                raise RuntimeError(f"no recovery: {job.status}, {[str(e) for e in job.events]}")
            time.sleep(0.01)
        shrink = next(e for e in job.events if e.reason == "failure")
        t0 = time.perf_counter()
        event = job.grow(six, program_of(model, data, six))  # the original plan (planning it is timed apart)
        requested = time.perf_counter() - t0
        while not event.done:
            if time.monotonic() > deadline or job.status.value != "running":
                raise RuntimeError(f"no grow: {job.status}, {[str(e) for e in job.events]}")
            time.sleep(0.005)
        wall = time.perf_counter() - t0
        step = event.step
        while job.metrics.last_step() < step and job.status.value == "running":
            time.sleep(0.005)
        first = time.perf_counter() - t0
    finally:
        job.cancel()
    return {"shrink_seconds": dict(shrink.seconds), "grow_seconds": dict(event.seconds), "bytes": dict(event.bytes),
            "request_s": requested, "grow_done_s": wall, "first_grown_step_done_s": first,
            "strategy": event.strategy.name if event.strategy is not None else None}


def restart_grow_peer(model: Any, data: dict, fork: bool, kill: int = 4) -> dict[str, float]:
    """Checkpoint-and-restart onto the same ranks: the survivors' plan on 5 ranks checkpoints, every worker is
    stopped, the 6-rank plan is relaunched from the checkpoint until its first step is done."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_checkpoint import restart

    six = Cluster.local(6)
    five, mapping = survivor_cluster(six, [kill])
    strategy = replan_elastic(model, six, Strategy.load(data, model=model, cluster=six), [kill], seq_len=SEQ)
    with tempfile.TemporaryDirectory() as d:
        return restart(program_of(model, renumber(strategy, mapping), five), five, program_of(model, data, six), six,
                       Path(d), seq_len=SEQ, transport=_transport(fork))


def grow_vs_restart(rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fork in (True, False):
        how = "forked workers" if fork else "fresh processes"
        gr = [grow_back(LlamaConfig.preset("tiny"), SIX, fork) for _ in range(rounds)]
        rs = [restart_grow_peer(LlamaConfig.preset("tiny"), SIX, fork) for _ in range(rounds)]
        grow_s = med([g["first_grown_step_done_s"] for g in gr])
        shrink_s = med([g["shrink_seconds"]["total"] for g in gr])
        rst = med([r["total"] for r in rs])
        # the time the job does not train: the grow's plan and switch (its newcomers start while it trains on)
        # against the whole restart (nothing trains from the stop to the first step)
        pause_s = med([g["grow_seconds"]["total"] for g in gr])
        row = {"grow": {"median_done_s": med([g["grow_done_s"] for g in gr]), "median_first_step_s": grow_s,
                        "median_pause_s": pause_s,
                        "median_seconds": {k: med([g["grow_seconds"][k] for g in gr]) for k in gr[0]["grow_seconds"]},
                        "rounds": gr},
               "shrink_median_total_s": shrink_s,
               "restart": {"median_seconds": {k: med([r[k] for r in rs]) for k in rs[0]}, "rounds": rs},
               "restart_over_grow": rst / grow_s, "restart_over_grow_pause": rst / pause_s,
               "restart_over_shrink": rst / shrink_s}
        out[how] = row
        print(f"grow back 5 -> 6 ranks, tiny Llama, {how}: done {row['grow']['median_done_s']:.2f} s, first grown "
              f"step done {grow_s:.2f} s, training paused {pause_s:.2f} s; shrink {shrink_s:.2f} s | "
              f"checkpoint-and-restart 5 -> 6 to the first step: {rst:.2f} s (restart / grow's pause "
              f"x{rst / pause_s:.1f}, restart / grow to its first step x{rst / grow_s:.1f}, restart / shrink "
              f"x{rst / shrink_s:.1f})")
    return out


# ---- 4. a straggler ---------------------------------------------------------------------------------------------
def straggler(steps: int = 24, at: int = 6, factor: float = 4.0) -> dict[str, Any]:
    from hspmd_sdk.planner import simulate
    from hspmd_sdk.runtime.control.controller import StragglerWatch
    from hspmd_sdk.runtime.control.train import launch

    model, cluster = SMALL, Cluster.local(2)
    data = {"pipelines": [pipe([([0], [0, 5])], 1, 4), pipe([([1], [0, 5])], 1, 4)]}
    old = Strategy.load(data, model=model, cluster=cluster)
    job = launch(program_of(model, data, cluster), cluster, steps=steps, seed=SEED, seq_len=SEQ, lr=LR,
                          slowdown={1: [(at, factor)]}, straggler=StragglerWatch(margin=2.0, steps=3, warmup=2),
                          timeout_s=300)
    res = job.wait(timeout=900)
    ev = next(e for e in res.events if e.reason == "straggler" and e.done)
    times = {s: max(m.step_time for ms in res.metrics.values() for m in ms if m.step == s) for s in range(steps)}
    healthy = med([times[s] for s in range(1, at)])
    slowed = med([times[s] for s in range(at, ev.step)])
    after = med([times[s] for s in range(ev.step + 1, steps)])
    slow_cluster, cost = slowed_cluster(cluster, {1: factor})
    sim_old = simulate(model, old, slow_cluster, seq_len=SEQ, cost=cost).step_time
    sim_new = simulate(model, ev.strategy, slow_cluster, seq_len=SEQ, cost=cost).step_time
    out = {"healthy_s": healthy, "slowed_old_plan_s": slowed, "after_replan_s": after, "replan_step": ev.step,
           "new_batches": [p.batch for p in ev.strategy.pipelines], "measured_gain": slowed / after,
           "simulated_gain": sim_old / sim_new, "event_seconds": dict(ev.seconds)}
    print(f"straggler (rank 1 x{factor:g} slower from step {at}): step {healthy * 1e3:.0f} ms healthy, "
          f"{slowed * 1e3:.0f} ms slowed under the old plan, {after * 1e3:.0f} ms after the replan at step {ev.step} "
          f"(batches {out['new_batches']}): measured gain x{out['measured_gain']:.2f}, simulator predicted "
          f"x{out['simulated_gain']:.2f}")
    return out


# ---- 6. a straggler in a mixed-length run ------------------------------------------------------------------
def mixed_straggler(steps: int = 24, at: int = 4, factor: float = 4.0) -> dict[str, Any]:
    """Two ranks, candidates TP2 and two one-rank pipelines (SMALL, packed rows of the stdlib documents cut to
    <= 128 tokens, 1024 tokens a step); rank 1 turns ``factor`` x slower at step ``at``.  With ``straggler=True``
    the dispatch is repriced once the watch sees it; the peer is the same run without it (the same steps and
    sequences, priced as launched throughout).  Compared: median step time over the steps after the repricing."""
    import numpy as np

    from hspmd_sdk.runtime.control.controller import StragglerWatch
    from hspmd_sdk.runtime.data import Documents

    two = Cluster.local(2)
    docs = Documents([d[: max(2, int(np.sqrt(d.size) / 2))] for d in Documents.stdlib().docs], vocab_size=4096)
    tp2 = Strategy.load({"pipelines": [pipe([([0, 1], [0, 5])], 1, 1)], "name": "tp2"})
    dp2 = Strategy.load({"pipelines": [pipe([([0], [0, 5])], 1, 1), pipe([([1], [0, 5])], 1, 1)], "name": "dp2"})
    first = specialize(SMALL, plan_from_strategy(SMALL, tp2, two), two)
    runs = {}
    for name, watch in (("straggler", StragglerWatch(margin=2.0, steps=3, warmup=2)), ("peer", None)):
        job = launch([first, dp2], two, steps=steps, seed=SEED, data=docs, tokens_per_step=1024, context=128,
                     slowdown={1: [(at, factor)]}, straggler=watch, timeout_s=300)
        res = job.wait(timeout=900)
        times = {s: max(m.step_time for ms in res.metrics.values() for m in ms if m.step == s) for s in range(steps)}
        runs[name] = (res, times, job.length_planner.records)
    res, times, records = runs["straggler"]
    ev = next(e for e in res.events if e.reason == "straggler")
    peer_times = runs["peer"][1]
    after = med([times[s] for s in range(ev.step + 1, steps)])
    peer_after = med([peer_times[s] for s in range(ev.step + 1, steps)])
    healthy = med([times[s] for s in range(1, at)])
    choices = {"before": sorted({r["choice"] for r in records if r["step"] < ev.step}),
               "after": sorted({r["choice"] for r in records if r["step"] >= ev.step})}
    out = {"healthy_s": healthy, "after_reprice_s": after, "peer_same_steps_s": peer_after, "reprice_step": ev.step,
           "gain": peer_after / after, "choices": choices, "event_seconds": dict(ev.seconds),
           "losses_equal": max(abs(a - b) / abs(b) for a, b in zip(res.losses, runs["peer"][0].losses))}
    print(f"mixed-length straggler (rank 1 x{factor:g} slower from step {at}): {healthy * 1e3:.0f} ms a step "
          f"healthy; repriced at step {ev.step} (candidates {choices['before']} -> {choices['after']}): "
          f"{after * 1e3:.0f} ms a step after it vs {peer_after * 1e3:.0f} ms in the same steps without straggler= "
          f"(x{out['gain']:.2f}); losses of the two runs within {out['losses_equal']:.1e}")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--parts", default="123456", help="which parts to run (default 123456)")
    args = ap.parse_args(argv)
    out: dict[str, Any] = {}
    parts = {"1": ("c1_c2_planned", paper_c1_c2),
             "2": ("switch_methods", lambda: switch_methods(repeats=3 if args.quick else 7)),
             "3": ("recovery_vs_restart", lambda: recovery_vs_restart(rounds=1 if args.quick else 3)),
             "4": ("straggler", straggler),
             "5": ("grow_vs_restart", lambda: grow_vs_restart(rounds=1 if args.quick else 3)),
             "6": ("mixed_straggler", mixed_straggler)}
    for part in sorted(set(args.parts)):
        key, run = parts[part]
        before = load()
        out[key] = {**run(), "load_before": before, "load_after": load()}
        old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        RESULTS.write_text(json.dumps({**old, **out}, indent=1, default=str))  # each part as soon as it is done
    return out


if __name__ == "__main__":
    main()
