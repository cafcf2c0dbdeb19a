"""Graph switching C1 -> C2 (paper §7, §10, Table 4; Table 11 strategies), 32 H20, rank 31 failed.

The per-parameter annotations are built here from Table 11: each of the 60 layers' Megatron-style parameters
(column-parallel q/k/v/gate/up split on the output dim 0, row-parallel o/down split on the input dim 1, norms
duplicated) over the TP group of the stage holding the layer, HSize 2 (one subgroup per pipeline), HDim -1
(replicated across pipelines); the embedding on the first stage and the final norm and LM head on the last.

The source shards and the expected destination shards come from the independent layout oracle (``layout_oracle``,
via ``resolve_reference.plain``), never from the SDK's ``local_view``; ``plan_switch``'s own ``simulate`` executes
the plan.  Besides Table 11, random switches (several tensors, DS of up to three keys in random order, HDim and
ratios, failed ranks) are checked the same way.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

import layout_oracle as oracle
from hspmd_sdk.core.annotation import DS, Annotation
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.core.switch import plan_switch, switch_table
from hspmd_sdk.errors import ResolutionError
from resolve_reference import annotation_of, check_destination, fitting_shape, plain

# (ranks, first layer, last layer) per stage, per pipeline -- Table 11
C1 = [[(range(0, 4), 0, 14), (range(4, 8), 15, 29), (range(8, 12), 30, 44), (range(12, 16), 45, 59)],
      [(range(16, 20), 0, 14), (range(20, 24), 15, 29), (range(24, 28), 30, 44), (range(28, 32), 45, 59)]]
C2 = [C1[0],
      [(range(16, 20), 0, 15), (range(20, 24), 16, 31), (range(24, 28), 32, 47), (range(28, 30), 48, 55),
       (range(30, 31), 56, 59)]]
REAL = dict(hidden=6656, ffn=17920, vocab=50304, layers=60)   # Llama 32B, paper Table 6
SMALL = dict(hidden=8, ffn=12, vocab=12, layers=60)


def layer_params(h: int, f: int) -> dict[str, tuple[tuple[int, ...], int]]:
    """Per-layer parameter -> (shape, split key): 0 column-parallel, 1 row-parallel, -1 duplicated."""
    return {"input_norm": ((h,), -1), "q": ((h, h), 0), "k": ((h, h), 0), "v": ((h, h), 0), "o": ((h, h), 1),
            "post_norm": ((h,), -1), "gate": ((f, h), 0), "up": ((f, h), 0), "down": ((h, f), 1)}


def _ann(stages: list[tuple[range, int, int]], key: int) -> Annotation:
    dg = [list(s[0]) for s in stages]
    return Annotation(dg, [DS({key: len(g)}) for g in dg], -1)


def build_plan(strategy: list[list[tuple[range, int, int]]], dims: dict[str, int]) -> dict[str, tuple[Annotation, tuple[int, ...]]]:
    """``name -> (Annotation, shape)`` for every parameter of the model under a Table 11 strategy."""
    h, f, v = dims["hidden"], dims["ffn"], dims["vocab"]
    out: dict[str, tuple[Annotation, tuple[int, ...]]] = {}
    out["embed"] = (_ann([p[0] for p in strategy], 0), (v, h))
    for layer in range(dims["layers"]):
        stages = [next(s for s in p if s[1] <= layer <= s[2]) for p in strategy]
        for name, (shape, key) in layer_params(h, f).items():
            out[f"layers.{layer}.{name}"] = (_ann(stages, key), shape)
    out["final_norm"] = (_ann([p[-1] for p in strategy], -1), (h,))
    out["lm_head"] = (_ann([p[-1] for p in strategy], 0), (v, h))
    return out


CLUSTER = Cluster.homogeneous("H20", 32)
FAILED = (31,)


def _inputs(plan: dict[str, tuple[Annotation, tuple[int, ...]]], rng: np.random.Generator):
    values, inputs = {}, {}
    for name, (ann, shape) in plan.items():
        values[name] = rng.standard_normal(shape).astype(np.float32)
        inputs[name] = oracle.materialize(plain(ann), shape, values[name])  # the oracle's shards
    return values, inputs


@pytest.mark.parametrize("fused,heuristics", [(True, True), (False, True), (False, False), (True, False)])
def test_switch_reproduces_every_destination_layout(fused: bool, heuristics: bool) -> None:
    src, dst = build_plan(C1, SMALL), build_plan(C2, SMALL)
    sw = plan_switch(src, dst, CLUSTER, fused=fused, heuristics=heuristics, failed=FAILED)
    values, inputs = _inputs(src, np.random.default_rng(1))
    for name in inputs:  # the failed rank's state is garbage: it must never be read
        if 31 in inputs[name]:
            inputs[name][31] = np.full_like(inputs[name][31], np.nan)
    out = sw.simulate(inputs)
    assert set(out) == set(dst)
    for name, (ann, shape) in dst.items():  # exactly the oracle's destination shards
        check_destination(ann, shape, values[name], out[name], exact=True)
    if fused:
        pairs = [(m.src, m.dst) for m in sw.steps[0].messages]
        assert len(pairs) == len(set(pairs)), "fused BSR sends one packed message per (sender, receiver)"
    assert all(m.src != 31 for s in sw.steps for m in s.messages)


def random_switch(rng: random.Random, world: int = 8) -> tuple[dict, dict, tuple[int, ...]]:
    """Random ``(src_plan, dst_plan, failed)`` of 1-3 tensors on ``world`` ranks: annotations from the resolution
    generators without Partial (switching moves parameters), the destination on the survivors; a tensor whose
    every copy of some slice is lost is redrawn without failures.  A draw is valid by construction."""
    ndim = rng.randint(1, 3)

    def ann(ranks: range | list[int]) -> Annotation:
        while True:
            a = annotation_of(rng, ranks, ndim)
            if a.hdim != -2 and all(ds.partial == 1 for ds in a.ds_union):
                return a

    failed = tuple(rng.sample(range(world), rng.randint(0, 1)))
    alive = [r for r in range(world) if r not in failed]
    src, dst = {}, {}
    for i in range(rng.randint(1, 3)):
        a, b = ann(range(world)), ann(alive)
        shape = fitting_shape([a, b], ndim, [rng.choice([1, 2]) for _ in range(ndim)])
        src[f"t{i}"], dst[f"t{i}"] = (a, shape), (b, shape)
    lost = {n for n, (a, shape) in src.items()  # a slice held only by failed ranks: no surviving copy
            if _uncovered(a, shape, failed)}
    return src, dst, () if lost else failed


def _uncovered(ann: Annotation, shape: tuple[int, ...], failed: tuple[int, ...]) -> bool:
    """Whether the survivors' oracle boxes miss some element of the tensor."""
    seen = np.zeros(shape, dtype=bool)
    for r, h in oracle.layout(plain(ann), shape).items():
        if r not in failed:
            seen[h.slices] = True
    return not seen.all()


def check_switch(src: dict, dst: dict, failed: tuple[int, ...], *, fused: bool, heuristics: bool, seed: int) -> None:
    """Plan the switch, execute it with ``simulate`` on the oracle's source shards (a failed rank's are NaN) and
    compare with the oracle's destination shards, exactly."""
    sw = plan_switch(src, dst, Cluster.local(8), dtype="float64", fused=fused, heuristics=heuristics, failed=failed)
    rng = np.random.default_rng(seed)
    values = {n: rng.standard_normal(shape) for n, (_, shape) in src.items()}
    inputs = {n: oracle.materialize(plain(a), shape, values[n]) for n, (a, shape) in src.items()}
    for n in inputs:
        for r in failed:
            if r in inputs[n]:
                inputs[n][r] = np.full_like(inputs[n][r], np.nan)
    out = sw.simulate(inputs)
    assert set(out) == set(dst)
    for n, (a, shape) in dst.items():
        check_destination(a, shape, values[n], out[n], exact=True)


@pytest.mark.parametrize("seed", range(4))
def test_random_switches_reproduce_the_oracles_destination_layout(seed: int) -> None:
    rng = random.Random(seed)
    for i in range(15):
        src, dst, failed = random_switch(rng)
        try:
            check_switch(src, dst, failed, fused=bool(i % 2), heuristics=i % 3 != 0, seed=i)
        except AssertionError as e:  # pragma: no cover - the message names the case
            raise AssertionError(f"draw {i}: {src} -> {dst}, failed {failed}: {e}") from None


def _max_send_time(sw) -> float:
    worst = 0.0
    for r, v in sw.volume().items():
        t = v["intra"] / (CLUSTER.devices["H20"].intra_bandwidth_gbs * 1e9) + v["inter"] / (CLUSTER.inter_bandwidth_gbs * 1e9)
        worst = max(worst, t)
    return worst


def test_fused_heuristics_beat_the_baseline_on_the_32b_model(capsys) -> None:
    src, dst = build_plan(C1, REAL), build_plan(C2, REAL)
    fused = plan_switch(src, dst, CLUSTER, dtype="bfloat16", failed=FAILED)
    unfused = plan_switch(src, dst, CLUSTER, dtype="bfloat16", fused=False, failed=FAILED)
    base = plan_switch(src, dst, CLUSTER, dtype="bfloat16", fused=False, heuristics=False, failed=FAILED)
    with capsys.disabled():
        print("\n" + switch_table(base) + "\n\n" + switch_table(unfused) + "\n\n" + switch_table(fused))
    fv, bv = fused.volume(), base.volume()
    total = lambda vol: sum(v["intra"] + v["inter"] for v in vol.values())  # noqa: E731
    assert total(fv) == total(bv), "same total volume, only who sends changes (§10)"
    assert sum(v["inter"] for v in fv.values()) <= sum(v["inter"] for v in bv.values())
    assert _max_send_time(fused) <= _max_send_time(base)
    assert fused.estimated_time() < base.estimated_time()
    # Table 4's shape: the baseline sends everything over IB from pipeline 1; the fused scheme uses NVLink
    # inside node 3 (R28-30) and only R31's lost shards (from R15) cross the network in bulk.
    assert all(v["intra"] == 0 for v in bv.values())
    assert {r for r, v in bv.items() if v["inter"]} == set(range(4, 16))
    assert fv[15]["inter"] == bv[15]["inter"] and fv[15]["intra"] == 0
    for r in (28, 29, 30):
        assert fv[r]["inter"] == 0 and fv[r]["intra"] > 0
    for r in (20, 21, 22, 23):  # layer 15 to R16-19 over NVLink
        assert fv[r]["inter"] == 0 and fv[r]["intra"] > 0
    # R28-30 send what R12-14 send in the baseline (up to the duplicated norms, which balance differently)
    for r, b in ((28, 12), (29, 13), (30, 14)):
        assert fv[r]["intra"] == pytest.approx(bv[b]["inter"], rel=1e-3)
    # layers 30-31 for R20-23 are balanced between R8-11 (pipeline 1) and R24-27 (node 3)
    for r in (8, 9, 10, 11, 24, 25, 26, 27):
        assert fv[r]["inter"] > 0
    uv = unfused.volume()  # per-tensor balancing cannot see that R8-11 already sent layer 30
    assert uv[24]["inter"] == 0 and uv[8]["inter"] == fv[8]["inter"] + fv[24]["inter"]


def test_a_slice_held_only_by_failed_ranks_is_an_error() -> None:
    src = {"w": (Annotation("[0,1] S0x2 | [2,3] S0x2"), (4, 4))}
    dst = {"w": (Annotation("[4,5] S1x2"), (4, 4))}
    plan_switch(src, dst, Cluster.local(8), failed=(1,))  # rank 3 still holds rows 2:4
    with pytest.raises(ResolutionError, match=r"slice \[2:4, 0:2\] of tensor 'w' is held only by failed"):
        plan_switch(src, dst, Cluster.local(8), failed=(1, 3))


def test_failed_rank_in_destination_and_missing_tensor_are_errors() -> None:
    src, dst = build_plan(C1, SMALL), build_plan(C2, SMALL)
    with pytest.raises(ResolutionError, match="failed rank"):
        plan_switch(src, dst, CLUSTER, failed=(30,))
    with pytest.raises(ResolutionError, match="not in src_plan"):
        plan_switch({}, dst, CLUSTER)


def test_plan_objects_with_annotations_and_shapes() -> None:
    class Plan:
        def __init__(self, layouts):
            self.annotations = {k: a for k, (a, _) in layouts.items()}
            self.meta = {}

    src, dst = build_plan(C1, SMALL), build_plan(C2, SMALL)
    shapes = {k: s for k, (_, s) in src.items()}
    a = plan_switch(Plan(src), Plan(dst), CLUSTER, shapes=shapes, failed=FAILED)
    b = plan_switch(src, dst, CLUSTER, failed=FAILED)
    assert a.volume() == b.volume()
    with pytest.raises(ResolutionError, match="no shape"):
        plan_switch(Plan(src), Plan(dst), CLUSTER)
