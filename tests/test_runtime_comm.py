"""The communication executors on real processes (gloo): CommPlans, autograd reshards, graph switching.

One 8-rank job runs every case (entry ``hspmd_sdk.testing.comm_cases:run_all``) so process start-up is paid
once.  The cases are seeded random annotation pairs (``resolve_reference.random_pair``, the generators of
``test_resolve_property``, at most 8 ranks) plus a few named ones so that every operator kind appears.  The workers
build their source tensors from a seeded global tensor and write what they end up with to files; the expectations are computed here from
the global tensor and the independent layout oracle alone (``layout_oracle`` through
``resolve_reference.check_destination`` / ``boxes``, never the SDK's ``local_view``), and the autograd cases
against single-process torch autograd.
"""
from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import pytest
import torch

from hspmd_sdk.core.annotation import DS, Annotation
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.core.resolve import resolve
from hspmd_sdk.core.switch import plan_switch
from hspmd_sdk.runtime import launch
from hspmd_sdk.runtime.workers.comm import CommExecutionError, backward_plan_for, comm_groups, execute, gradient_layout

from resolve_reference import boxes, check_destination, random_pair

WORLD = 8
N_RANDOM = 110
ALL_KINDS = {"Identity", "SendRecv", "LocalSplit", "AllReduce", "ReduceScatter", "AllGather", "AllToAll",
             "SplitAllReduce", "SplitReduceScatter", "SplitAllGather", "BSR"}


def named_pairs() -> list[tuple[Annotation, Annotation, tuple[int, ...]]]:
    """Pairs that pin down one operator kind each (Figures 8-10 and the §5.1 cases)."""
    a = Annotation
    return [
        (a([[0, 1, 2, 3]], [DS({0: 4})]), a([[0, 1, 2, 3]], [DS({0: 4})]), (8, 4)),               # Identity
        (a([[0, 1]], [DS({1: 2})]), a([[2, 3]], [DS({1: 2})]), (4, 6)),                           # SendRecv
        (a([[0, 1]], [DS({-1: 2})]), a([[0, 1]], [DS({0: 2})]), (4, 6)),                          # LocalSplit
        (a([[0, 1, 2]], [DS({-2: 3})]), a([[0, 1, 2]], [DS({-1: 3})]), (3, 5)),                   # AllReduce
        (a([[3, 1, 2, 0]], [DS({-2: 4})]), a([[3, 1, 2, 0]], [DS({1: 4})]), (2, 8)),              # ReduceScatter
        (a([[0, 1, 2, 3]], [DS({0: 2, -2: 2}, [0, -2])]), a([[0, 1, 2, 3]], [DS({0: 4})]), (8, 3)),
        (a([[2, 0, 3, 1]], [DS({1: 4})]), a([[2, 0, 3, 1]], [DS({-1: 4})]), (3, 8)),              # AllGather
        (a([[0, 1, 2, 3]], [DS({0: 2, 1: 2}, [1, 0])]), a([[0, 1, 2, 3]], [DS({0: 2, -1: 2})]), (4, 4)),
        (a([[1, 0, 2]], [DS({0: 3})]), a([[1, 0, 2]], [DS({1: 3})]), (6, 9)),                     # AllToAll
        (a([[0, 1], [2, 3]], [DS({0: 2}), DS({0: 2})], -2), a([[0, 1], [2, 3]], [DS({0: 2}), DS({0: 2})], -1),
         (4, 3)),                                                                                  # SplitAllReduce
        (a([[0, 1], [2, 3, 4, 5]], [DS({1: 2}), DS({1: 4})], -2),
         a([[0, 1], [2, 3, 4, 5]], [DS({1: 2}), DS({1: 4})], 0, [1, 2]), (6, 8)),                 # SplitReduceScatter
        (a([[0, 1], [2, 3, 4]], [DS({1: 2}), DS({1: 3})], 0, [2, 1]),
         a([[0, 1], [2, 3, 4]], [DS({1: 2}), DS({1: 3})], -1), (6, 6)),                            # SplitAllGather
        (a([[0, 1, 2]], [DS({0: 3})]), a([[3, 4], [5, 6, 7]], [DS({1: 2}), DS({0: 3})], 0, [1, 2]), (9, 6)),  # BSR
        (a([[0, 1], [2, 3]], [DS({-2: 2}), DS({1: 2})], -2), a([[4, 5, 6]], [DS({0: 3})]), (3, 4)),  # P -> BSR
        (a([[0, 1, 2, 3]], [DS({1: 4})]), a([[4, 5], [6, 7]], [DS({-2: 2}), DS({0: 2})]), (4, 4)),  # BSR -> P
        (a([[0, 1, 2, 3]], [DS({-1: 2, 0: 2}, [-1, 0])]), a([[0, 1, 2, 3]], [DS({-1: 2, 1: 2}, [-1, 1])]),
         (4, 4)),                                                                                  # AllToAll x2
        (a([[0, 1], [2, 3, 4]], [DS({0: 2}), DS({0: 3})], 1), a([[0, 1], [2, 3, 4]], [DS({1: 2}), DS({1: 3})], 1),
         (6, 12)),                                                                                 # AllToAll, HSize 2
        (a([[0, 1, 2, 3]], [DS({-1: 4})]), a([[0, 1, 2, 3]], [DS({0: 2, 1: 2})]), (4, 4)),       # LocalSplit
        (a([[0, 1], [2, 3]], [DS({0: 2}), DS({1: 2})], 0), a([[4, 5], [6, 7]], [DS({0: 2}), DS({1: 2})], 0),
         (4, 4)),                                                                                  # SendRecv, HSize 2
        # DS with three keys on 8 ranks (random pairs on at most 8 ranks rarely draw one)
        (a([list(range(8))], [DS({-2: 2, 0: 2, 1: 2}, [-2, 0, 1])]),
         a([list(range(8))], [DS({-1: 2, 0: 2, 1: 2}, [-1, 0, 1])]), (4, 4)),                      # AllReduce
        (a([list(range(8))], [DS({0: 2, -1: 2, 1: 2}, [0, -1, 1])]),
         a([[3, 1, 2, 0, 7, 5, 6, 4]], [DS({1: 2, 0: 4}, [1, 0])]), (8, 4)),                        # BSR
        (a([list(range(8))], [DS({-2: 2, -1: 2, 0: 2}, [0, -1, -2])]),
         a([list(range(8))], [DS({1: 2, 0: 2, -2: 2}, [-2, 1, 0])]), (4, 6)),                      # AllReduce, BSR
    ]


def make_cases(seed: int = 2024) -> list[tuple[Annotation, Annotation, tuple[int, ...]]]:
    """The named pairs, then ``N_RANDOM`` seeded random ones (bottom / top / random relations in turn)."""
    rng = random.Random(seed)
    cases = named_pairs()
    relations = ["bottom", "top", "random"]
    while len(cases) < len(named_pairs()) + N_RANDOM:
        # at most WORLD ranks, the generators shared with test_resolve_property; every draw is valid by
        # construction (``fitting_shape``), so none is dropped: one that failed to resolve would fail the test
        src, dst, shape = random_pair(rng, relations[len(cases) % 3], range(rng.randint(2, WORLD)), 1024)
        cases.append((src, dst, shape))
    return cases


def _slices(ann: Annotation, shape: tuple[int, ...], rank: int) -> tuple[slice, ...]:
    """The oracle's box of ``rank`` as slices."""
    return tuple(slice(a, b) for a, b in boxes(ann, shape)[rank])


def switch_layouts() -> tuple[dict[str, Any], dict[str, Any], list[int]]:
    """A C1 -> C2-like switch on 8 ranks: DP4 x TP2 (and two other layouts) -> 7 survivors after rank 5 fails,
    with heterogeneous subgroups (HDim 0, ratios 4:3) for one tensor."""
    a = Annotation
    src = {
        "w_qkv": (a([[0, 1], [2, 3], [4, 5], [6, 7]], [DS({1: 2})] * 4), (12, 12)),
        "w_out": (a([[0, 1, 2, 3], [4, 5, 6, 7]], [DS({0: 2, -1: 2}), DS({0: 2, -1: 2})]), (14, 6)),
        "bias": (a([list(range(8))], [DS({-1: 8})]), (12,)),
    }
    dst = {
        "w_qkv": (a([[0, 1, 2], [3, 4, 6]], [DS({1: 3}), DS({0: 3})]), (12, 12)),
        "w_out": (a([[0, 1, 2, 3], [4, 6, 7]], [DS({0: 4}), DS({0: 3})], 0, [8, 6]), (14, 6)),
        "bias": (a([[0, 1, 2, 3, 4, 6, 7]], [DS({-1: 7})]), (12,)),
    }
    return src, dst, [5]


def _json(ann: Annotation) -> Any:
    return ann.model_dump(mode="json")


BSR_SRC = Annotation([[0, 1]], [DS({0: 2})])
BSR_DST = Annotation([[2, 3, 4]], [DS({1: 3})])
BSR_SHAPE = (4, 6)


# ---- the one job ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cases = make_cases()
    sw_src, sw_dst, failed = switch_layouts()
    out_dir = tmp_path_factory.mktemp("comm")
    payload = {
        "out_dir": str(out_dir),
        "cases": [{"src": _json(s), "dst": _json(d), "shape": list(sh), "seed": i} for i, (s, d, sh) in
                  enumerate(cases)],
        "megatron": {"seed": 7},
        "bsr_grad": {"src": _json(BSR_SRC), "dst": _json(BSR_DST), "shape": list(BSR_SHAPE), "seed": 11},
        "switch": {"src": {n: [_json(a), list(s)] for n, (a, s) in sw_src.items()},
                   "dst": {n: [_json(a), list(s)] for n, (a, s) in sw_dst.items()}, "failed": failed, "seed": 100},
    }
    t0 = time.perf_counter()
    job = launch(cluster=Cluster.local(WORLD), entry="hspmd_sdk.testing.comm_cases:run_all", steps=1,
                 payload=payload, timeout_s=120)
    result = job.wait(timeout=240)
    wall = time.perf_counter() - t0
    files = {r: dict(np.load(out_dir / f"rank{r}.npz")) for r in range(WORLD)}
    return {"cases": cases, "results": result.results, "files": files, "wall": wall,
            "switch": (sw_src, sw_dst, failed)}


# ---- CommPlans -----------------------------------------------------------------------------------------------
def test_every_pair_reproduces_the_destination_layout(run: dict[str, Any]) -> None:
    cases, files = run["cases"], run["files"]
    assert len(cases) >= 100
    seen: dict[str, int] = {}
    for i, (src, dst, shape) in enumerate(cases):
        plan = resolve(src, dst, shape, "float64")
        assert run["results"][0]["kinds"][i] == plan.kinds  # the workers resolved the same plan
        for k in plan.kinds:
            seen[k] = seen.get(k, 0) + 1
        value = np.random.default_rng(i).standard_normal(shape)  # the global tensor the workers drew
        out = {r: files[r][f"case{i}"] for r in dst.ranks}
        try:
            check_destination(dst, shape, value, out)
        except AssertionError as e:  # pragma: no cover - the message names the case
            raise AssertionError(f"case {i}: {src} -> {dst} {shape}, kinds {plan.kinds}: {e}") from None
    assert set(seen) == ALL_KINDS, f"kinds not covered: {ALL_KINDS - set(seen)}"
    print(f"\n{len(cases)} pairs, kinds: {dict(sorted(seen.items()))}, job {run['wall']:.1f} s, "
          f"worker timings {run['results'][0]['seconds']}, {run['results'][0]['groups']} groups")


def test_comm_groups_lists_every_collective_rank_set() -> None:
    plans = [resolve(s, d, sh) for s, d, sh in named_pairs()]
    groups = comm_groups(plans)
    assert groups == sorted(set(groups)) and all(len(g) >= 2 and list(g) == sorted(g) for g in groups)
    assert (0, 1, 2) in groups and (0, 1, 2, 3) in groups  # AllReduce / ReduceScatter groups
    assert comm_groups([resolve(BSR_SRC, BSR_DST, BSR_SHAPE)]) == []  # point-to-point needs no group


# ---- autograd ------------------------------------------------------------------------------------------------
def test_megatron_f_and_g_match_single_process_autograd(run: dict[str, Any]) -> None:
    rng = np.random.default_rng(7)
    x0, w1, w2 = (torch.tensor(rng.standard_normal(s), requires_grad=True) for s in ((4, 6), (6, 8), (8, 6)))
    x = torch.tanh(x0)
    loss = ((torch.nn.functional.gelu(x @ w1) @ w2 + x) ** 2).sum()
    loss.backward()
    for r in (0, 1):
        f = run["files"][r]
        assert list(f["mlp_kinds"]) == ["Identity", "AllReduce", "AllReduce", "Identity"]  # f fwd/bwd, g fwd/bwd
        np.testing.assert_allclose(f["mlp_loss"], loss.item(), rtol=1e-12)
        np.testing.assert_allclose(f["mlp_dx0"], x0.grad.numpy(), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(f["mlp_dw1"], w1.grad.numpy()[:, 4 * r:4 * r + 4], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(f["mlp_dw2"], w2.grad.numpy()[4 * r:4 * r + 4], rtol=1e-10, atol=1e-12)


def test_bsr_reshard_backward_runs_the_reverse_plan(run: dict[str, Any]) -> None:
    files = run["files"]
    value = np.random.default_rng(11).standard_normal(BSR_SHAPE)
    c = np.random.default_rng(12).standard_normal(BSR_SHAPE)
    assert list(files[2]["bsr_kinds"]) == ["BSR", "BSR"]
    for r in BSR_DST.ranks:
        np.testing.assert_allclose(files[r]["bsr_out"], value[_slices(BSR_DST, BSR_SHAPE, r)])
    for r in BSR_SRC.ranks:  # d(sum(out * C))/dx = C in the source layout
        np.testing.assert_allclose(files[r]["bsr_grad"], c[_slices(BSR_SRC, BSR_SHAPE, r)])
        assert "bsr_out" not in files[r]


def test_gradient_layout_convention() -> None:
    dup, part = Annotation([[0, 1]], [DS({-1: 2})]), Annotation([[0, 1]], [DS({-2: 2})])
    assert gradient_layout(part) == dup and gradient_layout(dup) == dup
    assert gradient_layout(dup, "divergent") == part
    mixed = Annotation([[0, 1, 2, 3]], [DS({-2: 2, 0: 2}, [0, -2])])
    assert gradient_layout(mixed) == Annotation([[0, 1, 2, 3]], [DS({-1: 2, 0: 2}, [0, -1])])
    both = Annotation([[0, 1, 2, 3]], [DS({-2: 2, -1: 2}, [-2, -1])])
    assert gradient_layout(both) == Annotation([[0, 1, 2, 3]], [DS({-1: 4})])
    top = Annotation([[0, 1], [2, 3]], [DS({0: 2}), DS({0: 2})], -2)
    assert gradient_layout(top).hdim == -1 and gradient_layout(gradient_layout(top), "divergent").hdim == -2
    g = resolve(part, dup, (4, 6))
    assert backward_plan_for(g).kinds == ["Identity"]
    f = resolve(dup, dup, (4, 6))
    assert backward_plan_for(f).kinds == ["Identity"]
    assert backward_plan_for(f, grad_dst=gradient_layout(dup, "divergent")).kinds == ["AllReduce"]
    ag = resolve(Annotation([[0, 1]], [DS({0: 2})]), dup, (4, 6))
    assert ag.kinds == ["AllGather"] and backward_plan_for(ag, grad_dst=part).kinds == ["ReduceScatter"]


# ---- graph switching -----------------------------------------------------------------------------------------
def test_switch_reproduces_the_destination_layout_on_the_survivors(run: dict[str, Any]) -> None:
    sw_src, sw_dst, failed = run["switch"]
    plan = plan_switch(sw_src, sw_dst, None, dtype="float64", failed=failed)
    pairs = [(m.src, m.dst) for s in plan.steps for m in s.messages]
    assert len(pairs) == len(set(pairs)) and all(5 not in p for p in pairs)  # one packed message per pair
    assert any(len(m.items) > 1 for s in plan.steps for m in s.messages)  # packing actually happens
    assert len(plan_switch(sw_src, sw_dst, None, dtype="float64", failed=failed, fused=False).steps) == 3
    for mode, shift in (("fused", 0), ("unfused", 0), ("shift3", 3)):
        for name, (ann, shape) in sw_dst.items():
            value = np.random.default_rng(100 + list(sw_src).index(name)).standard_normal(shape)
            for r in ann.ranks:  # plan rank r is played by process (r + shift) % WORLD
                got = run["files"][(r + shift) % WORLD][f"sw_{mode}_{name}"]
                np.testing.assert_array_equal(got, value[_slices(ann, shape, r)], err_msg=f"{mode} {name}")
        assert not any(k.startswith(f"sw_{mode}_") for k in run["files"][(5 + shift) % WORLD])  # the failed rank


# ---- errors and one-process paths (no process group needed) --------------------------------------------------
def test_errors_name_the_rank_and_the_operator() -> None:
    ar = resolve(Annotation([[0, 1, 2]], [DS({-2: 3})]), Annotation([[0, 1, 2]], [DS({-1: 3})]), (3, 5), "float64")
    with pytest.raises(CommExecutionError, match=r"rank 1, op 0 \(AllReduce\).*shape \(2, 5\)"):
        execute(ar, torch.zeros(2, 5, dtype=torch.float64), {}, rank=1)
    with pytest.raises(CommExecutionError, match=r"rank 1, op 0 \(AllReduce\).*no process group for ranks \[0, 1, 2\]"):
        execute(ar, torch.zeros(3, 5, dtype=torch.float64), {}, rank=1)
    with pytest.raises(CommExecutionError, match="rank 2: the local tensor is torch.float32.*float64"):
        execute(ar, torch.zeros(3, 5), {}, rank=2)
    with pytest.raises(CommExecutionError, match="rank 0, op 0 .*holds nothing"):
        execute(ar, None, {}, rank=0)


def test_local_operators_run_in_one_process() -> None:
    value = torch.arange(16.0).reshape(4, 4)
    dup, split = Annotation([[0, 1, 2, 3]], [DS({-1: 4})]), Annotation([[0, 1, 2, 3]], [DS({0: 2, 1: 2})])
    plan = resolve(dup, split, (4, 4))
    assert plan.kinds == ["LocalSplit"]
    for r in range(4):
        got = execute(plan, value.clone(), {}, rank=r)
        assert torch.equal(got, value[_slices(split, (4, 4), r)])
    same = resolve(split, split, (4, 4))
    x = value[:2, :2].clone()
    assert execute(same, x, {}, rank=0) is x  # Identity moves nothing
    assert execute(same, x, {}, rank=7) is None  # a rank outside the destination gets nothing


def test_point_to_point_messages_carry_the_callers_tag_base(monkeypatch: pytest.MonkeyPatch) -> None:
    """Message ``i`` of a point-to-point operator is tagged ``tag_base + i`` in :func:`execute` and in both
    directions of :func:`reshard` -- the tags the training executor's own stage-boundary sends and receives use,
    so a rank that runs a stage-crossing plan through ``reshard`` matches a peer that posts its messages itself."""
    import hspmd_sdk.runtime.workers.comm as comm

    posted: list[tuple[str, int, int]] = []

    def p2p_op(fn: Any, tensor: torch.Tensor, peer: int, tag: int = 0) -> tuple[str, int, int]:
        posted.append(("send" if fn is comm.dist.isend else "recv", peer, tag))
        return posted[-1]

    monkeypatch.setattr(comm.dist, "P2POp", p2p_op)
    monkeypatch.setattr(comm.dist, "batch_isend_irecv", lambda ops: [])
    src, dst = Annotation([[0, 1]], [DS({0: 2})]), Annotation([[1, 0]], [DS({0: 2})])
    plan = resolve(src, dst, (4, 3), "float64")
    (op,) = plan.ops
    assert op.kind == "SendRecv"

    def expected(p: Any, base: int) -> list[tuple[str, int, int]]:
        return [("send", m.dst, base + i) if m.src == 0 else ("recv", m.src, base + i)
                for i, m in enumerate(p.ops[0].messages) if 0 in (m.src, m.dst) and m.src != m.dst]

    x = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    execute(plan, x.detach(), {}, rank=0, tag_base=5000)
    assert posted == expected(plan, 5000) and len(posted) == 2
    posted.clear()
    bp = backward_plan_for(plan)
    out = comm.reshard(x, plan, bp, {}, rank=0, tag_base=2048, backward_tag_base=3072)
    assert posted == expected(plan, 2048)
    posted.clear()
    out.backward(torch.ones_like(out))
    assert posted == expected(bp, 3072) and len(posted) == 2


def test_gradient_buckets_coalesce_slices_across_plans_and_respect_the_cap() -> None:
    """Bucketing (the grad-sync path): slices of many SplitAllReduce plans share one collective per rank set,
    in first-slice order, and a bucket never grows past the cap (unless one slice alone is larger); the first
    bucket of a rank set has its own, smaller cap (DDP's 1 MiB first bucket)."""
    from hspmd_sdk.core import Annotation, resolve
    from hspmd_sdk.runtime.workers.buckets import plan_buckets

    src = Annotation("[0,1] S0x2 | [2,3] S0x2 ; hdim=-2")  # gradients: a summand per pipeline (TP2 each)
    dst = Annotation("[0,1] S0x2 | [2,3] S0x2")
    plans = [resolve(src, dst, (4, 8)) for _ in range(5)]
    assert all(p.kinds == ["SplitAllReduce"] for p in plans)
    items = list(enumerate(plans))
    mine = [s for s in plans[0].ops[0].slices if 0 in s.ranks]
    per_plan = sum(4 * (b - a) * (d - c) for s in mine for (a, b), (c, d) in [s.box])
    one = plan_buckets(items, 0, bucket_bytes=10**9, first_bucket_bytes=None)
    assert len(one) == 1 and one[0].ranks == (0, 2) and len(one[0].members) == 5 * len(mine)
    capped = plan_buckets(items, 0, bucket_bytes=2 * per_plan, first_bucket_bytes=None)
    assert [len(b.members) for b in capped] == [2 * len(mine), 2 * len(mine), len(mine)]
    assert all(b.nbytes <= 2 * per_plan for b in capped)
    assert [i for b in capped for i, _ in b.members] == [i for b in one for i, _ in b.members]
    first = plan_buckets(items, 0, bucket_bytes=10**9, first_bucket_bytes=per_plan)
    assert [b.items for b in first] == [[0], [1, 2, 3, 4]]
    assert plan_buckets(items, 1, bucket_bytes=10**9)[0].ranks == (1, 3)  # rank 1's slices go over {1, 3}


def test_a_plan_for_bf16_tensors_keeps_its_operators_and_halves_its_bytes() -> None:
    """``with_dtype``: a bf16 run sends the same messages and collectives as the fp32 plan, at 2 bytes an element,
    and executes on bf16 tensors (the one-process reference ``simulate`` agrees)."""
    from hspmd_sdk.runtime.workers.comm import with_dtype

    src, dst = Annotation([[0, 1]], [DS({0: 2})]), Annotation([[1, 0]], [DS({0: 2})])
    for a, b in ((src, dst), (Annotation([[0, 1]], [DS({-1: 2})]), src)):
        plan = resolve(a, b, (4, 6))
        half = with_dtype(plan, torch.bfloat16)
        assert half.dtype == "bfloat16" and half.itemsize == 2 and half.kinds == plan.kinds
        assert {r: {k: 2 * v for k, v in d.items()} for r, d in half.volume().items()} == plan.volume()
        assert with_dtype(half, "bfloat16") is half and with_dtype(plan, "float32") is plan
    plan = with_dtype(resolve(Annotation([[0, 1]], [DS({-1: 2})]), src, (4, 6)), torch.bfloat16)  # LocalSplit
    value = torch.arange(24.0).reshape(4, 6).to(torch.bfloat16)
    for r in (0, 1):
        got = execute(plan, value.clone(), {}, rank=r)
        assert got.dtype == torch.bfloat16 and torch.equal(got, value[_slices(src, (4, 6), r)])
    with pytest.raises(CommExecutionError, match="float32 but the plan was resolved for bfloat16"):
        execute(plan, value.float(), {}, rank=0)
