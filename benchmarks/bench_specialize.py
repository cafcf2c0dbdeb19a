"""Benchmark: graph specialization of the 60-layer 32B Llama and of GPT-2 (124M, tied embeddings) (paper §6;
the paper's Table 5 reports specialization overheads).

Two cases: the paper's Table 9 strategy (32B on 16 H800 + 16 H20, 32 ranks, ZeRO-1), Table 9's 48-rank strategy
(16 H800 + 32 H20) and a 1024-rank strategy (64 pipelines x 4 stages x TP4, half of them with a TP2+TP2 tail to
keep it heterogeneous).  For each: seconds and tracemalloc peak of ``plan_from_strategy`` + ``specialize``, and
of instantiating every rank's executable graph.  Goals: < 2 s at 48 ranks, < 30 s at 1024 ranks.

Run: ``python benchmarks/bench_specialize.py``
"""
from __future__ import annotations

import gc
import time
import tracemalloc
from pathlib import Path

from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk import GPTConfig, LlamaConfig
from hspmd_sdk.core.specialize import specialize
from hspmd_sdk.core.strategy import Strategy
from hspmd_sdk.core.deduction import clear_caches
from hspmd_sdk.core.strategy_plan import _ann_cached, _ds, plan_from_strategy

EXAMPLES = Path(__file__).resolve().parent.parent / "hspmd_sdk" / "examples"


def strategy_1024() -> Strategy:
    """64 pipelines of 16 ranks: even pipelines TP4 x 4 stages; odd ones TP4 x 3 stages + TP2, TP2."""
    pipelines = []
    rank = 0
    for p in range(64):
        if p % 2 == 0:
            layout = [(4, 0, 14), (4, 15, 29), (4, 30, 44), (4, 45, 59)]
        else:
            layout = [(4, 0, 15), (4, 16, 31), (4, 32, 47), (2, 48, 53), (2, 54, 59)]
        stages = []
        for tp, a, b in layout:
            stages.append({"devices": list(range(rank, rank + tp)), "layers": [a, b]})
            rank += tp
        pipelines.append({"stages": stages, "micro_batch_size": 1, "num_micro_batches": 8})
    return Strategy.load({"pipelines": pipelines, "schedule": "1f1b", "zero1": False, "name": "1024-rank"})


def _run(strategy: Strategy, cluster: Cluster, model: LlamaConfig, all_ranks: bool) -> tuple[float, ...]:
    clear_caches()  # cold run: no memoised deductions or annotations from an earlier case
    _ann_cached.cache_clear()
    _ds.cache_clear()
    t0 = time.perf_counter()
    plan = plan_from_strategy(model, strategy, cluster)
    t1 = time.perf_counter()
    prog = specialize(model, plan, cluster)
    t2 = time.perf_counter()
    peak_spec = tracemalloc.get_traced_memory()[1] if tracemalloc.is_tracing() else 0
    for r in (prog.ranks if all_ranks else prog.ranks[:8]):
        prog.executable_graph(r)
    t3 = time.perf_counter()
    peak_all = tracemalloc.get_traced_memory()[1] if tracemalloc.is_tracing() else 0
    return t1 - t0, t2 - t1, t3 - t2, peak_spec, peak_all, len(prog.ranks), len(prog.pipelines)


def measure(name: str, strategy: Strategy, cluster: Cluster, model: LlamaConfig, all_ranks: bool = True) -> None:
    """Times from a run without tracemalloc (it slows Python down ~2x), peaks from a second run with it."""
    gc.collect()
    t_plan, t_spec, t_graphs, _, _, n_ranks, n_pipes = _run(strategy, cluster, model, all_ranks)
    gc.collect()
    tracemalloc.start()
    *_, peak_spec, peak_all, _, _ = _run(strategy, cluster, model, all_ranks)
    tracemalloc.stop()
    print(f"{name}: {n_ranks} ranks, {n_pipes} pipelines")
    print(f"  plan_from_strategy {t_plan:.2f} s; specialize {t_spec:.2f} s (peak {peak_spec / 1e6:.0f} MB); "
          f"executable graphs of all ranks {t_graphs:.2f} s (peak incl. them {peak_all / 1e6:.0f} MB)")


def gpt_strategy(pipelines: int, tp: int, stages: int, layers: int = 12) -> Strategy:
    """``pipelines`` pipelines of ``stages`` stages of TP ``tp`` over GPT-2's ``layers`` layers (the tied embedding
    and LM head on different stages, so the tied weight moves by BSR and its gradient comes back)."""
    per, rank, out = layers // stages, 0, []
    for _ in range(pipelines):
        st = []
        for s in range(stages):
            st.append({"devices": list(range(rank, rank + tp)), "layers": [s * per, layers - 1 if s == stages - 1
                                                                          else (s + 1) * per - 1]})
            rank += tp
        out.append({"stages": st, "micro_batch_size": 1, "num_micro_batches": 8})
    return Strategy.load({"pipelines": out, "name": f"gpt2 {pipelines}x{stages}xTP{tp}"})


def main() -> None:
    model = LlamaConfig.preset("llama-32b")
    measure("Table 9, 32B, 16 H800 + 16 H20",
            Strategy.load(EXAMPLES / "table9_32b_16h800_16h20.json"), Cluster.mixed({"H800": 16, "H20": 16}),
            model)
    measure("Table 9, 32B, 16 H800 + 32 H20 (48 ranks)",
            Strategy.load(EXAMPLES / "table9_32b_16h800_32h20.json"), Cluster.mixed({"H800": 16, "H20": 32}),
            model)
    measure("1024 ranks, 32B", strategy_1024(), Cluster.homogeneous("H20", 1024), model)
    gpt = GPTConfig.preset("gpt2")
    measure("GPT-2 124M, 48 ranks (12 pipelines x 2 stages x TP2)", gpt_strategy(12, 2, 2),
            Cluster.mixed({"H800": 16, "H20": 32}), gpt)
    measure("GPT-2 124M, 1024 ranks (128 pipelines x 4 stages x TP2)", gpt_strategy(128, 2, 4),
            Cluster.homogeneous("H20", 1024), gpt)


if __name__ == "__main__":
    main()
