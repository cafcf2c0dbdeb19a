"""The planners against exhaustive search on small instances (issue 29, item 2).

Each test enumerates, by brute force written here (independently of the planners' searches), every valid strategy
of a small instance -- TP groups inside nodes, their split into pipelines and the order of stages in each, the
layer split of every pipeline, the micro-batch size and count of every pipeline -- and prices every one of them.
Two prices:

* **from first principles** (:func:`_step_time`, no ``hspmd_sdk.planner`` code): with free communication
  (``comm_scale=0``), no embedding/head (``include_embedding=False``) and a free optimizer
  (``optimizer_bytes_per_param=0``), a step is the slowest pipeline's 1F1B makespan, which this file computes with
  its own event loop from the stage times ``layers x FLOPs / (TP x peak x MFU)`` (FLOPs counted by hand from the
  Llama shapes; backward = 2 forwards).  On that space the step simulator must agree with it exactly, and the
  planners must find its optimum;
* **the planners' own stated objective**, the step simulator (:func:`hspmd_sdk.planner.simulate`, with
  communication, embedding, head, optimizer and memory), on which :func:`plan_hetero` and :func:`replan_elastic`
  pick their result.  There the search of the planner is what is tested: it must return the optimum of the
  exhaustive space within a tolerance justified at each assertion.  Two gaps were found this way: plan_hetero's
  pre-simulation ranking missed the optimum by 5% (its gradient-sync estimate priced every sync on the inter-node
  link; fixed: the link to the replicas), and replan_elastic's pruning to the running TP degrees costs 2x after
  one failure (a strict xfail, with the figures).

The mixed-length planner: its interval DP (:func:`_interval_plan`) against every merge of the base intervals and
every method and count per merged interval, and its dispatch (:class:`Dispatcher`) against every assignment of a
step's sequences to pipelines and micro-batches -- both priced from first principles (hand FLOPs, hand 1F1B
formula), so that a wrong pipeline cost in ``planner/mixed_cost.py`` (e.g. one 8% too high) fails here.
"""
from __future__ import annotations

import itertools
import math
from typing import Iterator, Sequence

import pytest

from hspmd_sdk import LlamaConfig
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.core.strategy import Strategy

pytest.importorskip("pulp")
pytest.importorskip("pyomo")

# ---- the small instance -----------------------------------------------------------------------------------------
#: A 4-layer Llama wide enough that compute dominates a step on these devices (so the planners have real choices)
MODEL = LlamaConfig(name="exh", vocab_size=8000, hidden_size=1024, num_layers=4, num_heads=8, num_kv_heads=8,
                    ffn_hidden_size=2816, max_seq_len=2048)
SEQ = 2048
GB = 4
#: two device kinds, one node of two each: ranks 0, 1 are H800 (node 0), ranks 2, 3 are H20 (node 1)
CLUSTER = Cluster.mixed({"H800": 2, "H20": 2}, per_node=2)


# ---- enumeration (written for this test) -----------------------------------------------------------------------
def _set_partitions(items: Sequence) -> Iterator[list[list]]:
    """Every partition of ``items`` into non-empty blocks (each partition once)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]
        yield [[first]] + part


def _tp_groupings(cluster: Cluster, wanted: set[int], degrees: Sequence[int] = (1, 2)
                  ) -> Iterator[list[tuple[int, ...]]]:
    """Every way to cut each node's ``wanted`` ranks into TP groups of the allowed degrees (groups inside nodes)."""
    per_node = []
    for node in cluster.nodes:
        here = [r for r in node.ranks if r in wanted]
        if not here:
            continue
        opts = [[tuple(sorted(b)) for b in part] for part in _set_partitions(here)
                if all(len(b) in degrees for b in part)]
        per_node.append(opts)
    for combo in itertools.product(*per_node):
        yield [g for node_groups in combo for g in node_groups]


def _pipeline_layouts(groups: Sequence[tuple[int, ...]]) -> Iterator[list[tuple[tuple[int, ...], ...]]]:
    """Every split of the TP groups into pipelines, with every order of the stages of each pipeline."""
    for part in _set_partitions(list(groups)):
        for orders in itertools.product(*(itertools.permutations(block) for block in part)):
            yield [tuple(o) for o in orders]


def _compositions(n: int, k: int) -> Iterator[tuple[int, ...]]:
    """Every way to write ``n`` as ``k`` positive parts, in order."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        yield tuple(e - s for s, e in zip((0,) + cuts, cuts + (n,)))


def _batchings(D: int, total: int, common: bool) -> Iterator[tuple[tuple[int, int], ...]]:
    """Every ``(micro_batch_size, num_micro_batches)`` per pipeline with ``sum b * m = total``; ``common``: one
    micro-batch size for all pipelines (the planners' space)."""
    for shares in _compositions(total, D) if D <= total else ():
        per = [[(b, n // b) for b in range(1, n + 1) if n % b == 0] for n in shares]
        for combo in itertools.product(*per):
            if not common or len({b for b, _ in combo}) == 1:
                yield combo


def _strategies(cluster: Cluster, ranks: Sequence[int] | None = None, *, common_b: bool = False,
                min_pipelines: int = 1, zero1: bool = True, recompute: Sequence[bool] = (False,),
                degrees: Sequence[int] = (1, 2), even_spread: bool = False) -> Iterator[Strategy]:
    """Every strategy that uses each of ``ranks`` (default: all) exactly once, TP groups inside nodes of the
    ``degrees``; ``even_spread``: only layouts whose pipelines hold the same number of groups of each kind, give or
    take one (a pruning plan_hetero documents)."""
    wanted = set(cluster.ranks if ranks is None else ranks)
    L, seen = MODEL.num_layers, set()
    for groups in _tp_groupings(cluster, wanted, degrees):
        for layout in _pipeline_layouts(groups):
            D = len(layout)
            if D < min_pipelines or any(len(p) > L for p in layout):
                continue
            if even_spread and not _evenly_spread(cluster, layout):
                continue
            for layers in itertools.product(*(_compositions(L, len(p)) for p in layout)):
                for batching in _batchings(D, GB, common_b):
                    for rc in itertools.product(recompute, repeat=D):
                        key = _canonical(cluster, layout, layers, batching, rc)
                        if key in seen:
                            continue
                        seen.add(key)
                        yield _strategy(layout, layers, batching, rc, zero1)


def _evenly_spread(cluster: Cluster, layout) -> bool:
    for kind in cluster.kinds():
        per = [sum(cluster.kind(g[0]) == kind for g in p) for p in layout]
        if max(per) - min(per) > 1:
            return False
    return True


def _canonical(cluster: Cluster, layout, layers, batching, rc) -> tuple:
    """Strategies that differ only by which device of a node holds what cost the same: one key for them."""
    pipes = []
    for stages, ls, bm, r in zip(layout, layers, batching, rc):
        pipes.append((tuple((cluster.node_index(g[0]), len(g), n) for g, n in zip(stages, ls)), bm, r))
    return tuple(sorted(pipes))


def _strategy(layout, layers, batching, rc, zero1: bool) -> Strategy:
    pipelines = []
    for stages, ls, (b, m), r in zip(layout, layers, batching, rc):
        first, st = 0, []
        for g, n in zip(stages, ls):
            st.append({"devices": list(g), "layers": [first, first + n - 1], "recompute": r})
            first += n
        pipelines.append({"stages": st, "micro_batch_size": b, "num_micro_batches": m})
    return Strategy.load({"pipelines": pipelines, "schedule": "1f1b", "zero1": zero1})


# ---- the first-principles price --------------------------------------------------------------------------------
MFU = 0.45  # CostModel's default_mfu, set explicitly below


def _layer_fwd_flops(rows: int, length: int) -> float:
    """Forward FLOPs of one Llama decoder layer on ``rows`` sequences of ``length`` tokens, by hand: the
    projections (q, o: h x h; k, v: h x kv; gate, up, down: h x f) at 2 FLOPs a multiply-add per token, and
    attention's scores and weighted sum (2 x 2 x length x h per token)."""
    h, kv, f = MODEL.hidden_size, MODEL.num_kv_heads * (MODEL.hidden_size // MODEL.num_heads), MODEL.ffn_hidden_size
    tokens = rows * length
    return 2 * tokens * (2 * h * h + 2 * h * kv + 3 * h * f) + 4 * tokens * length * h


def _stage_seconds(kind: str, tp: int, layers: int, rows: int, length: int, mfu: dict | None = None
                   ) -> tuple[float, float]:
    """(forward, backward) seconds of one stage for one micro-batch: FLOPs / (TP x peak x MFU); backward 2x."""
    rate = CLUSTER.devices[kind].bf16_tflops * 1e12 * (mfu or {}).get(kind, MFU)
    fwd = layers * _layer_fwd_flops(rows, length) / (tp * rate)
    return fwd, 2 * fwd


def _one_f_one_b(fwd: Sequence[float], bwd: Sequence[float], m: int) -> float:
    """Makespan of ``m`` equal micro-batches through stages of ``fwd``/``bwd`` seconds under 1F1B with free
    transfers: stage ``s`` runs ``min(S - s - 1, m)`` forwards, then one forward and one backward in turn, then the
    remaining backwards; a forward waits for the previous stage's forward of its micro-batch, a backward for the
    next stage's backward of it (and its own forward).  Event loop over the stages until every op is placed."""
    S = len(fwd)
    orders = []
    for s in range(S):
        w = min(S - s - 1, m)
        order = [("F", i) for i in range(w)]
        nb = 0
        for i in range(w, m):
            order += [("F", i), ("B", nb)]
            nb += 1
        order += [("B", j) for j in range(nb, m)]
        orders.append(order)
    done: dict[tuple[str, int, int], float] = {}
    pos, clock = [0] * S, [0.0] * S
    while any(pos[s] < len(orders[s]) for s in range(S)):
        progressed = False
        for s in range(S):
            while pos[s] < len(orders[s]):
                op, i = orders[s][pos[s]]
                deps = [("F", s - 1, i)] if op == "F" and s > 0 else \
                    [("B", s + 1, i)] if op == "B" and s < S - 1 else []
                if any(d not in done for d in deps):
                    break
                start = max([clock[s]] + [done[d] for d in deps])
                clock[s] = done[(op, s, i)] = start + (fwd[s] if op == "F" else bwd[s])
                pos[s] += 1
                progressed = True
        assert progressed, "the 1F1B orders deadlock"
    return max(clock)


def _step_time(strategy: Strategy) -> float:
    """The first-principles step: the slowest pipeline's 1F1B makespan (free communication and optimizer)."""
    worst = 0.0
    for p in strategy.pipelines:
        times = []
        for st in p.stages:
            kinds = {CLUSTER.kind(d) for d in st.devices}
            # a TP group runs at the pace of its slowest device
            f = max(_stage_seconds(k, st.tp_degree, st.num_layers, p.micro_batch_size, SEQ)[0] for k in kinds)
            times.append(f)
        worst = max(worst, _one_f_one_b(times, [2 * t for t in times], p.num_micro_batches))
    return worst


def _free_cost(mfu: dict | None = None):
    from hspmd_sdk.planner.cost import CostModel

    return CostModel(comm_scale=0.0, include_embedding=False, optimizer_bytes_per_param=0.0, default_mfu=MFU,
                     mfu=mfu or {})


def _sim(strategy: Strategy, cluster: Cluster, cost) -> tuple[float, bool]:
    from hspmd_sdk.planner import simulate

    r = simulate(MODEL, strategy, cluster, global_batch=GB, seq_len=SEQ, cost=cost)
    return r.step_time, bool(r.oom)


def _exhaustive(cluster: Cluster, cost, **kw) -> tuple[float, Strategy, int]:
    """(best simulated step time that fits in memory, its strategy, strategies tried) over the space of
    :func:`_strategies`."""
    best: tuple[float, Strategy] | None = None
    n = 0
    for s in _strategies(cluster, **kw):
        t, oom = _sim(s, cluster, cost)
        n += 1
        if not oom and (best is None or t < best[0]):
            best = (t, s)
    assert best is not None
    return best[0], best[1], n


# ---- plan_hetero ----------------------------------------------------------------------------------------------------
def test_enumeration_counts_by_hand() -> None:
    """The enumeration itself, on counts done by hand: 4 TP groupings (each node: one TP2 or two TP1); a 2-rank
    layout: 3 ways (one pipeline in 2 orders, or two pipelines); compositions of 4 into 2 parts: 3."""
    assert len(list(_tp_groupings(CLUSTER, set(CLUSTER.ranks)))) == 4
    assert len(list(_pipeline_layouts([(0,), (1,)]))) == 3
    assert len(list(_pipeline_layouts([(0,), (1,), (2,)]))) == 13  # Lah numbers 6 + 6 + 1
    assert list(_compositions(4, 2)) == [(1, 3), (2, 2), (3, 1)]
    # 2 pipelines sharing 4 samples: shares (1,3), (2,2), (3,1) with 1, 2 and 2 ways to batch a share of 2 or 3
    assert len(list(_batchings(2, 4, common=False))) == 2 + 4 + 2
    # one size for both: 1 + 3 and 3 + 1 only at size 1, 2 + 2 at size 1 or 2
    assert len(list(_batchings(2, 4, common=True))) == 1 + 2 + 1
    assert _one_f_one_b([1.0, 1.0], [2.0, 2.0], 4) == pytest.approx((4 + 2 - 1) * 3.0)  # (m + S - 1)(f + b)


def test_simulator_agrees_with_first_principles_on_every_strategy() -> None:
    """With free communication and optimizer, the simulator's step is the slowest pipeline's 1F1B makespan: on
    every strategy of the instance (677 after symmetry), to rounding."""
    cost = _free_cost()
    n = 0
    for s in _strategies(CLUSTER):
        t, oom = _sim(s, CLUSTER, cost)
        assert not oom
        assert t == pytest.approx(_step_time(s), rel=1e-9), s
        n += 1
    assert n > 600


def test_plan_hetero_finds_the_first_principles_optimum() -> None:
    """plan_hetero's strategy, priced from first principles, is the exhaustive optimum: exactly (its objective
    is the simulator, which equals the first-principles price here; no tolerance needed)."""
    from hspmd_sdk.planner import plan_hetero

    cost = _free_cost()
    best = min(_step_time(s) for s in _strategies(CLUSTER))  # any micro-batch size per pipeline
    assert min(_step_time(s) for s in _strategies(CLUSTER, common_b=True)) == pytest.approx(best, rel=1e-12)
    plan = plan_hetero(MODEL, CLUSTER, global_batch=GB, seq_len=SEQ, cost=cost)
    assert plan.ranks == CLUSTER.ranks
    assert _step_time(plan) == pytest.approx(best, rel=1e-9)


def _small_memory(mem_mb: int) -> Cluster:
    from hspmd_sdk.core.cluster import DeviceSpec

    return Cluster.load({"nodes": [n.model_dump() for n in CLUSTER.nodes], "devices": {
        k: DeviceSpec(**{**CLUSTER.devices[k].model_dump(), "memory_mb": mem_mb}) for k in ("H800", "H20")}})


@pytest.fixture(scope="module")
def roomy() -> tuple[float, Strategy, int]:
    """The exhaustive optimum of the simulator with the default cost model on :data:`CLUSTER` (387 strategies)."""
    from hspmd_sdk.planner import CostModel

    return _exhaustive(CLUSTER, CostModel(), common_b=True)


def _check_search_space(cluster: Cluster, best: float, best_s: Strategy) -> None:
    from hspmd_sdk.planner import CostModel, plan_hetero

    cost = CostModel()
    plan = plan_hetero(MODEL, cluster, global_batch=GB, seq_len=SEQ, cost=cost, simulate_top=1000)
    t, oom = _sim(plan, cluster, cost)
    assert not oom and plan.ranks == cluster.ranks
    assert t == pytest.approx(best, rel=1e-9), (plan, best_s)


def test_plan_hetero_search_space_holds_the_simulated_optimum(roomy: tuple[float, Strategy, int]) -> None:
    """With every solved candidate simulated (``simulate_top`` large), plan_hetero returns the exhaustive
    optimum of its own objective (the simulator, with communication, embedding, head, optimizer and memory)
    over the space it documents (TP groups inside nodes, one micro-batch size): exactly.  (Recomputation only adds
    compute; nothing is short of memory here, so it is left out of this space.)"""
    _check_search_space(CLUSTER, roomy[0], roomy[1])


@pytest.mark.slow
def test_plan_hetero_search_space_holds_the_simulated_optimum_when_memory_binds() -> None:
    """As above with 2700 MiB a device (2.0 GiB reserve + model states + activations): 1147 of the 1481 strategies
    (with and without recomputation) do not fit, and the optimum moves to one TP2 -> TP2 pipeline."""
    from hspmd_sdk.planner import CostModel

    cluster = _small_memory(2700)
    best, best_s, _ = _exhaustive(cluster, CostModel(), common_b=True, recompute=(False, True))
    _check_search_space(cluster, best, best_s)


def test_plan_hetero_default_ranking_finds_the_simulated_optimum(roomy: tuple[float, Strategy, int]) -> None:
    """With its default ``simulate_top`` (6 best estimates simulated), plan_hetero should still return the
    optimum within 2% (the most its closed-form estimate may reorder candidates whose simulated times are that
    close; a larger miss means the estimate misranks clearly different plans)."""
    from hspmd_sdk.planner import CostModel, plan_hetero

    cost = CostModel()
    t, _ = _sim(plan_hetero(MODEL, CLUSTER, global_batch=GB, seq_len=SEQ, cost=cost), CLUSTER, cost)
    assert t <= 1.02 * roomy[0]


# ---- replan_elastic ------------------------------------------------------------------------------------------------
#: the running strategy: two pipelines H20 -> H800 (no ZeRO-1, as the paper's elastic runs), all TP1
RUNNING = Strategy.load({"zero1": False, "pipelines": [
    {"micro_batch_size": 1, "num_micro_batches": 2, "stages": [{"devices": [2], "layers": [0, 0]},
                                                                {"devices": [1], "layers": [1, 3]}]},
    {"micro_batch_size": 1, "num_micro_batches": 2, "stages": [{"devices": [3], "layers": [0, 0]},
                                                                {"devices": [0], "layers": [1, 3]}]}]})


@pytest.mark.parametrize("failed", [[3], [0]])
@pytest.mark.parametrize("priced", ["first principles", "simulator"])
def test_replan_elastic_finds_the_optimum_of_its_space(failed: list[int], priced: str) -> None:
    """After a failure, replan_elastic's strategy is the optimum over every strategy on the survivors with at
    least two pipelines (a replica for the next failure), the running strategy's TP degree per kind (TP1) and the
    groups of each kind spread evenly over the pipelines (the prunings the planner documents, the paper's), exactly
    -- priced from first principles and by the simulator.  (Without the even spread the simulated optimum after
    losing rank 0 -- the H800 alone beside an H20 -> H20 pipeline -- is 7.5% faster than the replanned strategy,
    which keeps its H20 -> H800 template.)"""
    from hspmd_sdk.planner import CostModel, replan_elastic

    cost = _free_cost() if priced == "first principles" else CostModel()
    survivors = [r for r in CLUSTER.ranks if r not in failed]
    new = replan_elastic(MODEL, CLUSTER, RUNNING, failed, seq_len=SEQ, cost=cost)
    assert sorted(new.ranks) == survivors and new.dp_degree >= 2 and not new.zero1
    space = dict(ranks=survivors, min_pipelines=2, zero1=False, degrees=(1,), even_spread=True)
    if priced == "first principles":
        best = min(_step_time(s) for s in _strategies(CLUSTER, **space))
        assert _step_time(new) == pytest.approx(best, rel=1e-9)
    else:
        best = _exhaustive(CLUSTER, cost, **space)[0]
        # 3%: the layer ILP splits a pipeline's layers for M // D = 2 micro-batches (hetero.solve_pipelines) before
        # the micro-batch ILP gives the pipelines their real counts (3 and 1 after losing rank 0); for 3 the best
        # split of the H20 -> H800 pipeline is 2 + 2 layers, not the 1 + 3 kept: 2.7% slower (19.57 ms vs 20.10 ms).
        # Losing rank 3 has no such gap: 1e-4, for candidates that close (0.001% apart: 9.77620 vs 9.77609 ms) are
        # ordered by the closed-form estimate, which prices the DP sync on the replicas' link but not the overlap
        tol = 1e-4 if failed == [3] else 0.03
        assert best <= _sim(new, CLUSTER, cost)[0] <= best * (1 + tol)


@pytest.mark.xfail(strict=True, reason="replan_elastic keeps the running strategy's TP degree per device kind (its "
                   "documented pruning, the paper's); after losing rank 0 the optimum regroups the two H20 into "
                   "one TP2 stage: 2.0x faster from first principles than the replanned strategy (and, with the "
                   "simulator, the even spread of kinds over pipelines costs another 7.5%)")
def test_replan_elastic_against_every_tp_degree() -> None:
    from hspmd_sdk.planner import replan_elastic

    cost = _free_cost()
    new = replan_elastic(MODEL, CLUSTER, RUNNING, [0], seq_len=SEQ, cost=cost)
    best = min(_step_time(s) for s in _strategies(CLUSTER, ranks=[1, 2, 3], min_pipelines=2, zero1=False))
    assert _step_time(new) <= 1.02 * best


# ---- the mixed-length planner: dispatch against every assignment --------------------------------------------------
def _pipeline_price(stages: Sequence[tuple[str, int, int]], shapes: Sequence[tuple[int, int]]) -> float:
    """The dispatcher's stated objective for one pipeline (``mixed_cost.PipelineCost``'s docstring), from first
    principles: stages ``(kind, tp, layers)`` with forward + backward seconds by hand FLOPs; the bottleneck stage of
    each micro-batch once per micro-batch, plus one fill and drain (every other stage once) of the micro-batch for
    which that is largest (free transfers)."""
    if not shapes:
        return 0.0
    total, fill = 0.0, 0.0
    for rows, length in shapes:
        ts = [sum(_stage_seconds(k, tp, n, rows, length)) for k, tp, n in stages]
        total += max(ts)
        fill = max(fill, sum(ts) - max(ts))
    return total + fill


#: a candidate of three pipelines of different speeds and windows: H800 alone, H800 -> H20 (2 + 2 layers), H20 TP1
DISPATCH_PIPES = [([0], None), ([1], [3]), ([2], None)]
DISPATCH_STAGES = [[("H800", 1, 4)], [("H800", 1, 2), ("H20", 1, 2)], [("H20", 1, 4)]]


def _dispatch_entry(windows: Sequence[int]):
    from hspmd_sdk.planner.mixed import MixedEntry

    pipes = []
    for first, second in DISPATCH_PIPES:
        stages = [{"devices": first, "layers": [0, 3]}] if second is None else \
            [{"devices": first, "layers": [0, 1]}, {"devices": second, "layers": [2, 3]}]
        pipes.append({"stages": stages, "micro_batch_size": 1, "num_micro_batches": 1})
    strategy = Strategy.load({"pipelines": pipes, "zero1": False})
    return MixedEntry(max_seq_len=max(windows), windows=list(windows), strategy=strategy)


def _groupings(items: Sequence[int], lengths: Sequence[int], window: int) -> Iterator[list[list[int]]]:
    """Every split of ``items`` into padded micro-batches (``rows x longest <= window``)."""
    for part in _set_partitions(list(items)):
        if all(len(b) * max(lengths[i] for i in b) <= window for b in part):
            yield part


def _best_assignment(lengths: Sequence[int], windows: Sequence[int]) -> float:
    """The smallest slowest-pipeline price over every assignment of the sequences to pipelines whose window holds
    them and every split of each pipeline's share into padded micro-batches."""
    P, n = len(windows), len(lengths)
    best_of: dict[tuple[int, tuple[int, ...]], float] = {}

    def pipe_best(p: int, items: tuple[int, ...]) -> float:
        key = (p, items)
        if key not in best_of:
            best_of[key] = min((_pipeline_price(DISPATCH_STAGES[p], [(len(b), max(lengths[i] for i in b))
                                                                     for b in part])
                                for part in _groupings(items, lengths, windows[p])), default=math.inf) \
                if items else 0.0
        return best_of[key]

    best = math.inf
    for where in itertools.product(range(P), repeat=n):
        if any(lengths[i] > windows[p] for i, p in enumerate(where)):
            continue
        best = min(best, max(pipe_best(p, tuple(i for i in range(n) if where[i] == p)) for p in range(P)))
    return best


def _dispatch_cases(count: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.choice([64, 200, 300, 500, 900, 1500, 2000, 3000, 4000]) for _ in range(rng.randint(3, 7))]
            for _ in range(count)]


def test_dispatch_prices_each_pipeline_from_first_principles() -> None:
    """The dispatcher's per-pipeline estimates and its step estimate equal the first-principles price of the
    micro-batches it chose (rel 1e-9): a pipeline cost that is off by any factor fails here."""
    from hspmd_sdk.planner import Dispatcher

    windows = [4096, 2048, 4096]
    d_of = Dispatcher([_dispatch_entry(windows)], MODEL, CLUSTER, cost=_free_cost())
    for lengths in _dispatch_cases(12, seed=1):
        d = d_of(lengths)
        assert sorted(i for p in d.micro_batches for mb in p for i in mb) == list(range(len(lengths)))
        prices = [_pipeline_price(st, shapes) for st, shapes in zip(DISPATCH_STAGES, d.shapes())]
        assert list(d.pipeline_estimates) == pytest.approx(prices, rel=1e-9)
        assert d.estimate == pytest.approx(max(prices), rel=1e-9)  # free optimizer and sync: no tail


def test_dispatch_against_every_assignment() -> None:
    """The dispatcher's assignment against the best of every assignment (brute force, first-principles price).

    The dispatcher is a greedy list scheduler (longest sequence first, to where the estimated finish grows least),
    not an exact solver: e.g. ``[4000, 1500, 1500, 2000]`` ends 7.6% above the optimum (it puts 4000 alone on the
    fast pipeline first).  Over 450 random instances of this kind (3 window sets) it was optimal on all but 7,
    worst 1.076x.  Asserted on 24 random instances and the two worst found: never better than the optimum (that
    would mean a wrong price or an invalid assignment), within 1.1x (the worst seen, with room for none of the
    instances to be new worst cases: they are fixed), optimal on at least 90% of them."""
    from hspmd_sdk.planner import Dispatcher

    windows = [4096, 2048, 4096]
    d_of = Dispatcher([_dispatch_entry(windows)], MODEL, CLUSTER, cost=_free_cost())
    exact, ratios = 0, []
    for lengths in _dispatch_cases(24, seed=7) + [[4000, 1500, 1500, 2000], [200, 200, 200, 300, 500]]:
        d = d_of(lengths)
        for pipe, w in zip(d.shapes(), windows):
            assert all(rows * longest <= w for rows, longest in pipe)
        got = max(_pipeline_price(st, shapes) for st, shapes in zip(DISPATCH_STAGES, d.shapes()))
        best = _best_assignment(lengths, windows)
        assert got >= best * (1 - 1e-9)
        ratios.append(got / best)
        exact += got <= best * (1 + 1e-9)
    assert max(ratios) <= 1.1, ratios
    assert max(ratios) > 1.05  # the known suboptimal instance is (still) there: the brute force can tell
    assert exact >= 0.9 * len(ratios), ratios


# ---- the mixed-length planner: the interval DP against every merge and method -------------------------------------
def test_interval_dp_against_every_plan_priced_from_first_principles() -> None:
    """plan_mixed's DP (``_interval_plan``) against every merge of the base intervals and every method and count
    per merged interval, each priced from first principles: ``c`` pipelines of a method (kind, TP, PP; 4 / PP
    layers a stage) share the interval's micro-batches, ``max(sum / c, largest) + fill`` with ``sum`` the scaled
    bottleneck seconds (one row a sequence, or window-sized padded micro-batches, the cheaper), ``fill`` the other
    PP - 1 stages of the largest.  The DP's documented tie rule (within 2% of the best makespan it uses the most
    devices, then the smaller makespan) is replayed on the enumeration, so the comparison is exact.  The kinds'
    efficiencies make them close in speed, so the optimum uses both."""
    from hspmd_sdk.planner.mixed import Method, _interval_plan, _Methods

    mfu = {"H800": 0.2, "H20": 0.9}
    cl = Cluster.mixed({"H800": 4, "H20": 4}, per_node=4)
    methods = [Method(k, t, p) for k in ("H800", "H20") for t in (1, 2, 4) for p in (1, 2, 4) if t * p <= 4]
    bounds = [1024, 2048, 4096]
    sample = [300] * 30 + [700] * 20 + [1500] * 12 + [3000] * 5 + [4096]
    scale = 16384 / sum(sample)
    found = _interval_plan(_Methods(MODEL, cl, _free_cost(mfu), schedule="1f1b", zero1=True), methods, sample,
                           bounds, scale)
    assert found is not None
    makespan, chosen = found

    def padded(seg: list[int], w: int) -> list[tuple[int, int]]:
        out: list[list[int]] = []
        for x in sorted(seg, reverse=True):
            if out and (len(out[-1]) + 1) * out[-1][0] <= w:
                out[-1].append(x)
            else:
                out.append([x])
        return [(len(b), b[0]) for b in out]

    def seg_time(m: Method, c: int, seg: list[int], w: int) -> float:
        forms = []
        for shapes in ([(1, x) for x in seg], padded(seg, w)):
            ts = [sum(_stage_seconds(m.kind, m.tp, MODEL.num_layers // m.pp, r, x, mfu)) for r, x in shapes]
            forms.append((sum(ts), max(ts), (m.pp - 1) * max(ts), len(ts)))
        total, largest, fill, _ = min(forms)
        return max(total * scale / c, largest) + fill

    edges, plans = [0] + bounds, []
    for cuts in itertools.product([False, True], repeat=len(bounds) - 1):
        segs, lo = [], 0
        for i, cut in enumerate(list(cuts) + [True]):
            if cut:
                segs.append((edges[lo], bounds[i]))
                lo = i + 1
        options = []
        for a, b in segs:
            seg = [x for x in sample if a < x <= b]
            options.append([(seg_time(m, c, seg, b), m, c) for m in methods for c in range(1, 4 // m.devices + 1)]
                           if seg else [(0.0, None, 0)])
        for combo in itertools.product(*options):
            need = {"H800": 0, "H20": 0}
            for _, m, c in combo:
                if m is not None:
                    need[m.kind] += m.devices * c
            if max(need.values()) <= 4:
                plans.append((max(t for t, _, _ in combo), sum(need.values())))
    best = min(t for t, _ in plans)
    most = max(u for t, u in plans if t <= best * 1.02 + 1e-12)
    assert makespan == pytest.approx(min(t for t, u in plans if u == most), rel=1e-9)
    assert {m.kind for m, _, _ in chosen} == {"H800", "H20"}
    assert sum(m.devices * c for m, c, _ in chosen) == most
