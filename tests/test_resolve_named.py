"""Named cases of communication resolution: Figures 7-11 of the paper, the volume formulas, the errors."""
from __future__ import annotations

import numpy as np
import pytest

from hspmd_sdk.core.annotation import Annotation
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.core.comm_ops import CollectiveOp, PointToPointOp, SplitCollectiveOp
from hspmd_sdk.core.resolve import resolve
from hspmd_sdk.errors import ResolutionError, ShapeError

from resolve_reference import check_destination, source_inputs


def plan_and_check(src: str, dst: str, shape: tuple[int, ...], cluster: Cluster | None = None, dtype="float32"):
    s, d = Annotation(src), Annotation(dst)
    plan = resolve(s, d, shape, dtype=dtype, cluster=cluster)
    rng = np.random.default_rng(7)
    value = rng.standard_normal(shape)
    check_destination(d, shape, value, plan.simulate(source_inputs(s, shape, value, rng)))
    return plan


CASES = [
    # (name, src, dst, shape, kinds)
    ("identity", "[0,1] S0x2", "[0,1] S0x2", (4, 4), ["Identity"]),
    ("sendrecv", "[0,1] S0x2", "[2,3] S0x2", (4, 4), ["SendRecv"]),
    ("sendrecv-permuted", "[0,1] S0x2", "[1,0] S0x2", (4, 4), ["SendRecv"]),
    ("sendrecv-partial", "[0,1] P2", "[2,3] P2", (4, 4), ["SendRecv"]),
    ("sendrecv-regrouped-summands", "[0,1] P2 | [2,3] P2", "[0,3] P2 | [2,1] P2", (4, 4), ["SendRecv"]),
    ("allreduce", "[0,1] P2", "[0,1] D2", (4, 4), ["AllReduce"]),
    ("allreduce-with-split", "[0-3] P2 S1x2", "[0-3] D2 S1x2", (4, 4), ["AllReduce"]),
    ("allreduce-partly", "[0-3] P4", "[0-3] P2 D2", (4, 4), ["AllReduce"]),
    ("reducescatter", "[0,1] P2", "[0,1] S0x2", (4, 4), ["ReduceScatter"]),
    ("reducescatter-dup", "[0-3] D2 P2", "[0-3] D2 S1x2", (4, 4), ["ReduceScatter"]),
    ("allgather", "[0,1] S1x2", "[0,1] D2", (4, 4), ["AllGather"]),
    ("allgather-multikey", "[0-3] D2 S0x2", "[0-3] D4", (4, 4), ["AllGather"]),
    ("allgather-partly", "[0-3] S0x4", "[0-3] S0x2 D2", (8, 4), ["AllGather"]),
    ("alltoall", "[0,1] S0x2", "[0,1] S1x2", (4, 4), ["AllToAll"]),
    ("localsplit", "[0,1] D2", "[0,1] S0x2", (4, 4), ["LocalSplit"]),
    ("localsplit-multikey", "[0-3] S0x2 D2", "[0-3] S0x4", (8, 4), ["LocalSplit"]),
    ("dup-split-reorder-needs-bsr", "[0-3] D2 S0x2", "[0-3] S0x4", (8, 4), ["BSR"]),
    ("per-subgroup-ops", "[0,1] P2 | [2,3] S0x2 ; hdim=0", "[0,1] S0x2 | [4,5] S0x2 ; hdim=0", (4, 4),
     ["ReduceScatter", "SendRecv"]),
    ("per-subgroup-bsr", "[0,1] S1x2 | [2,3] S0x2", "[0,1] D2 | [4,5,6] S1x3", (6, 6), ["AllGather", "BSR"]),
    # Figure 9: top tier, same DS Union
    ("split-allreduce", "[0,1] S0x2 | [2,3] S0x2 ; hdim=-2", "[0,1] S0x2 | [2,3] S0x2", (4, 4),
     ["SplitAllReduce"]),
    ("split-allreduce-hetero-tp", "[0-3] S0x4 | [4,5] S0x2 ; hdim=-2", "[0-3] S0x4 | [4,5] S0x2", (8, 4),
     ["SplitAllReduce"]),
    ("split-allreduce-hetero-dup", "[0-3] D2 S0x2 | [4,5] S0x2 | [6] R ; hdim=-2",
     "[0-3] D2 S0x2 | [4,5] S0x2 | [6] R", (4, 4), ["SplitAllReduce"]),
    ("split-reducescatter", "[0,1] S1x2 | [2,3] S1x2 ; hdim=-2", "[0,1] S1x2 | [2,3] S1x2 ; hdim=0", (4, 4),
     ["SplitReduceScatter"]),
    ("split-reducescatter-hetero", "[0-3] S1x4 | [4,5] S1x2 ; hdim=-2",
     "[0-3] S1x4 | [4,5] S1x2 ; hdim=0 ratios=2:1", (6, 8), ["SplitReduceScatter"]),
    ("split-allgather", "[0,1] S1x2 | [2,3] S1x2 ; hdim=0", "[0,1] S1x2 | [2,3] S1x2", (4, 4),
     ["SplitAllGather"]),
    ("split-allgather-hetero", "[0-3] S1x4 | [4,5] S1x2 | [6] R ; hdim=0 ratios=2:1:1",
     "[0-3] S1x4 | [4,5] S1x2 | [6] R", (8, 8), ["SplitAllGather"]),
    # Figure 10: a bottom-tier step aligns the DS Union, then the top tier aligns the HDim
    ("rs-then-split-allgather", "[0,1] P2 | [2,3] P2 ; hdim=0", "[0,1] S1x2 | [2,3] S1x2", (4, 4),
     ["ReduceScatter", "SplitAllGather"]),
    # §5.3: BSR, and BSR after reducing a Partial source
    ("bsr-hsize-change", "[0,1] S0x2", "[2,3,4] S1x3", (6, 6), ["BSR"]),
    ("bsr-hetero-tp", "[0-3] S0x4 | [4,5] S0x2", "[0,1] S0x2 | [2-5] S0x4", (8, 4), ["BSR"]),
    ("bsr-hratios", "[0,1] S0x2 | [2] R ; hdim=0 ratios=2:1", "[0,1] S0x2 | [2] R ; hdim=0", (12, 2), ["BSR"]),
    ("bsr-partial-source", "[0,1] P2", "[2,3,4] S1x3", (6, 6), ["AllReduce", "BSR"]),
    ("bsr-top-partial-source", "[0,1] P2 | [2] R ; hdim=-2", "[3,4] S0x2", (6, 6),
     ["AllReduce", "SplitAllReduce", "BSR"]),
    ("bsr-partial-destination", "[0,1] S0x2", "[2,3] P2", (4, 4), ["BSR"]),
]


@pytest.mark.parametrize("name,src,dst,shape,kinds", CASES, ids=[c[0] for c in CASES])
def test_named_case(name: str, src: str, dst: str, shape: tuple[int, ...], kinds: list[str]) -> None:
    plan = plan_and_check(src, dst, shape, Cluster.local(8))
    assert plan.kinds == kinds
    assert plan.render().startswith("Reshard")


def test_collective_groups_are_the_devices_that_differ_in_the_changing_coordinate() -> None:
    plan = plan_and_check("[0-3] P2 S1x2", "[0-3] D2 S1x2", (4, 4))
    op = plan.ops[0]
    assert isinstance(op, CollectiveOp)
    assert sorted(g.ranks for g in op.groups) == [(0, 2), (1, 3)]
    plan = plan_and_check("[0-3] D2 S0x2", "[0-3] D4", (4, 4))
    assert sorted(g.ranks for g in plan.ops[0].groups) == [(0, 1), (2, 3)] and plan.ops[0].dim == 0


def test_split_collectives_run_one_collective_per_slice_over_its_holders() -> None:
    plan = plan_and_check("[0-3] S0x4 | [4,5] S0x2 ; hdim=-2", "[0-3] S0x4 | [4,5] S0x2", (8, 4))
    op = plan.ops[0]
    assert isinstance(op, SplitCollectiveOp)
    # the finest slices are TP4's rows: each is held by one rank of each subgroup
    assert [(s.box[0], s.ranks) for s in op.slices] == [((0, 2), (0, 4)), ((2, 4), (1, 4)), ((4, 6), (2, 5)),
                                                        ((6, 8), (3, 5))]
    dup = plan_and_check("[0-3] D2 S0x2 | [4,5] S0x2 ; hdim=-2", "[0-3] D2 S0x2 | [4,5] S0x2", (4, 4)).ops[0]
    first = dup.slices[0]
    assert first.ranks == (0, 2, 4) and first.contributors == (0, 4) and first.receivers == (0, 2, 4)


def test_bsr_prefers_nvlink_and_balances_equal_links() -> None:
    # Figure 11: rank 9 sends to rank 8 over NVLink rather than rank 1 over the network
    cluster = Cluster.homogeneous("H20", 16)
    plan = resolve(Annotation("[0,1] S0x2 | [8,9] S0x2"), Annotation("[8] R"), (4, 4), cluster=cluster)
    op = plan.ops[0]
    assert isinstance(op, PointToPointOp)
    assert [(m.src, m.dst) for m in op.messages] == [(9, 8)] and op.copies == ((8, ((0, 2), (0, 4))),)
    # equal bandwidth: the owners take turns by cumulative bytes sent
    plan = resolve(Annotation("[0,1] D2"), Annotation("[2-5] S0x4"), (8, 4), cluster=cluster)
    senders = sorted(m.src for m in plan.ops[0].messages)
    assert senders == [0, 0, 1, 1]


def test_volume_follows_the_ring_formulas_and_link_classes() -> None:
    cluster = Cluster.homogeneous("H20", 16)
    b = 8 * 8 * 4
    ar = resolve(Annotation("[6-9] P4"), Annotation("[6-9] D4"), (8, 8), cluster=cluster)
    vol = ar.volume()
    assert {r: vol[r]["intra"] + vol[r]["inter"] for r in (6, 7, 8, 9)} == {r: 2 * 3 * b // 4 for r in (6, 7, 8, 9)}
    assert vol[7] == {"intra": 0, "inter": 2 * 3 * b // 4}  # ring successor 8 is on the next node
    ag = resolve(Annotation("[0-3] S0x4"), Annotation("[0-3] D4"), (8, 8), cluster=cluster).volume()
    assert ag[0] == {"intra": 3 * b // 4, "inter": 0}
    rs = resolve(Annotation("[0-3] P4"), Annotation("[0-3] S1x4"), (8, 8), cluster=cluster).volume()
    assert rs[0] == {"intra": 3 * b // 4, "inter": 0}
    a2a = resolve(Annotation("[0,1] S0x2"), Annotation("[0,1] S1x2"), (8, 8), cluster=cluster).volume()
    assert a2a[0] == {"intra": b // 4, "inter": 0}
    ls = resolve(Annotation("[0,1] D2"), Annotation("[0,1] S1x2"), (8, 8), cluster=cluster).volume()
    assert all(v == {"intra": 0, "inter": 0} for v in ls.values())
    sr = resolve(Annotation("[0,1] S0x2"), Annotation("[8,9] S0x2"), (8, 8), dtype="bfloat16", cluster=cluster)
    assert sr.volume()[0] == {"intra": 0, "inter": b // 4}
    # time: the slowest sender's bytes over the IB bandwidth plus one latency
    t = sr.estimated_time()
    assert t == pytest.approx(b / 4 / 25e9 + 5e-6)


def test_simulate_accepts_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    plan = resolve(Annotation("[0,1] S0x2"), Annotation("[2,3,4] S1x3"), (6, 6))
    full = torch.arange(36.0).reshape(6, 6)
    out = plan.simulate({0: full[:3].clone(), 1: full[3:].clone()})
    assert torch.equal(out[3], full[:, 2:4])


def test_errors_name_both_annotations() -> None:
    with pytest.raises(ShapeError, match=r"\[0,1\] S0x2 -> \[2,3\] S1x2.*does not divide"):
        resolve(Annotation("[0,1] S0x2"), Annotation("[2,3] S1x2"), (4, 3))
    with pytest.raises(ResolutionError, match=r"\[0,1\] S0x2 -> \[8,9\] S0x2.*not in"):
        resolve(Annotation("[0,1] S0x2"), Annotation("[8,9] S0x2"), (4, 4), cluster=Cluster.local(4))
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve(Annotation("[0,1] S0x2"), Annotation("[0,1] S0x2"), (4, 4), dtype="float13")
    plan = resolve(Annotation("[0,1] S0x2"), Annotation("[2,3] S0x2"), (4, 4))
    with pytest.raises(ValueError, match="no input for source rank"):
        plan.simulate({0: np.zeros((2, 4))})
    with pytest.raises(ValueError, match="needs a cluster"):
        plan.estimated_time()
