"""Kills for the mutants of ``hspmd_sdk/core/switch.py`` that ``tests/test_switch.py`` let live
(``scripts/mutation.sh switch``; issue 29): packing torch tensors as the runtime does, the Partial-source check at
both tiers, per-tensor dtypes, destinations that are Partial (zero-filled ranks), heuristics in a fused plan, the
plan's own flags, the errors naming the plan and the tensor, and the printed table.  Expected values are worked out
by hand for small layouts on a 2 x 2 cluster, not by the module."""
from __future__ import annotations

import html

import numpy as np
import pytest
import torch

from hspmd_sdk.core.annotation import Annotation
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.core.switch import _pack, _unpack, plan_switch, switch_table
from hspmd_sdk.errors import ResolutionError, ShapeError

#: hosts a (ranks 0, 1) and b (ranks 2, 3)
TWO_BY_TWO = Cluster.load({"nodes": [{"host": "a", "kind": "H800", "ranks": [0, 1]},
                                     {"host": "b", "kind": "H800", "ranks": [2, 3]}]})
#: w (8 x 4, 128 bytes) duplicated on ranks 0 and 2 goes whole to rank 3; v (4 x 4) from rows on 0/1 to columns on 2/3
SRC = {"w": (Annotation("[0,2] D2"), (8, 4)), "v": (Annotation("[0,1] S0x2"), (4, 4))}
DST = {"w": (Annotation("[3] R"), (8, 4)), "v": (Annotation("[2,3] S1x2"), (4, 4))}


@pytest.mark.parametrize("lib", ["torch", "numpy"])
def test_pack_and_unpack_round_trip_bytes_of_several_dtypes(lib: str) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([1.5, -2.0, 3.25, 1e10], dtype=np.float64)
    a, b = (torch.from_numpy(a), torch.from_numpy(b)) if lib == "torch" else (a, b)
    buf = _pack([a, b])
    assert type(buf) is type(a) and tuple(buf.shape) == (24 + 32,) and str(buf.dtype).endswith("uint8")
    x, y = _unpack(buf, 0, 24, a, (2, 3)), _unpack(buf, 24, 32, b, (4,))
    assert type(x) is type(a) and x.dtype == a.dtype and tuple(x.shape) == (2, 3) and (x == a).all()
    assert y.dtype == b.dtype and (y == b).all()
    x[0, 0] = 99  # a copy, not a view of the buffer
    assert int(buf[0]) == 0


def test_simulate_moves_torch_tensors_as_the_runtime_does() -> None:
    plan = plan_switch(SRC, DST, TWO_BY_TWO)
    w, v = torch.arange(32, dtype=torch.float32).reshape(8, 4), torch.arange(16, dtype=torch.float32).reshape(4, 4)
    out = plan.simulate({"w": {0: w.clone(), 2: w.clone()}, "v": {0: v[:2].clone(), 1: v[2:].clone()}})
    assert isinstance(out["w"][3], torch.Tensor) and torch.equal(out["w"][3], w)
    assert torch.equal(out["v"][2], v[:, :2]) and torch.equal(out["v"][3], v[:, 2:])


def test_a_partial_source_is_refused_at_either_tier() -> None:
    dst = {"w": (Annotation("[0,1] D2"), (4, 4))}
    for ann in ("[0,1] P2", "[0] R | [1] R ; hdim=-2"):  # bottom tier; top tier only (its DS are not partial)
        with pytest.raises(ResolutionError, match=r"tensor 'w' is Partial in src_plan"):
            plan_switch({"w": (Annotation(ann), (4, 4))}, dst)


def test_dtypes_per_tensor_set_the_bytes_moved() -> None:
    plan = plan_switch(SRC, DST, TWO_BY_TWO, dtype={"w": "float64", "v": "float16"})
    assert {t.name: t.itemsize for t in plan.tensors} == {"w": 8, "v": 2}
    assert sum(m.nbytes for s in plan.steps for m in s.messages) == 32 * 8 + 4 * (4 * 2)  # w whole; 4 2x2 v pieces


def test_a_partial_destination_fills_all_but_one_summand_with_zeros() -> None:
    src = {"w": (Annotation("[0] R"), (4,)), "v": (Annotation("[0] R"), (4,))}
    dst = {"w": (Annotation("[1,2] P2"), (4,)), "v": (Annotation("[1] R"), (4,))}
    fused = plan_switch(src, dst)
    assert fused.steps[0].zero_fill == (("w", 2),)
    assert [(m.src, m.dst, m.nbytes) for m in fused.steps[0].messages] == [(0, 1, 32)]
    unfused = plan_switch(src, dst, fused=False)
    assert [s.zero_fill for s in unfused.steps] == [(("w", 2),), ()]


def test_a_fused_plan_without_heuristics_is_the_first_owner_s() -> None:
    """w is held on 0 (host a) and 2 (host b), wanted on 3 (host b): the heuristics send it over the node's own
    link from 2; without them it comes from 0, over the network -- fused or not."""
    def w_sender(plan) -> set[int]:
        return {m.src for s in plan.steps for m in s.messages if any(i.tensor == "w" for i in m.items)}

    assert w_sender(plan_switch(SRC, DST, TWO_BY_TWO)) == {2}
    assert w_sender(plan_switch(SRC, DST, TWO_BY_TWO, heuristics=False)) == {0}
    assert w_sender(plan_switch(SRC, DST, TWO_BY_TWO, fused=False, heuristics=False)) == {0}


def test_the_plan_says_how_it_was_made() -> None:
    plan = plan_switch(SRC, DST, TWO_BY_TWO, fused=False, heuristics=False, empty=[3, 3])
    assert (plan.fused, plan.heuristics, plan.failed, plan.empty) == (False, False, (), (3,))
    assert plan_switch(SRC, DST).fused is True and plan_switch(SRC, DST).heuristics is True
    assert all(t[3] == 1 for step in plan.transfers() for t in step)  # one packed message each


def test_errors_name_the_plan_and_the_tensor() -> None:
    ann = Annotation("[0,1] S0x2")
    with pytest.raises(ResolutionError, match=r"^src_plan: tensor 'w' has an annotation but no shape"):
        plan_switch({"w": ann}, {"w": (ann, (4,))})
    with pytest.raises(ResolutionError, match=r"^dst_plan: tensor 'w' has an annotation but no shape"):
        plan_switch({"w": (ann, (4,))}, {"w": ann})
    with pytest.raises(TypeError, match=r"^dst_plan: expected a mapping"):
        plan_switch({"w": (ann, (4,))}, [ann])
    with pytest.raises(ShapeError, match="'w'"):
        plan_switch({"w": (ann, (3,))}, {"w": (Annotation("[0] R"), (3,))})  # 3 rows do not split in 2


def test_the_table_gives_the_method_the_totals_the_failures_and_the_estimate() -> None:
    plan = plan_switch(SRC, DST, None, fused=False, heuristics=False)
    assert str(plan) == switch_table(plan) == plan.render() == (
        "Unfused BSR w/o heuristics: 2 tensors, 5 messages in 2 step(s); total 192 B intra-node + 0 B inter-node\n"
        "Sender: intra B | inter B\n"
        "R0: 160 | 0   R1: 32 | 0 ")  # no cluster: every link counts as intra-node
    assert plan._repr_html_() == f"<pre>{html.escape(str(plan))}</pre>"
    timed = plan_switch(SRC, DST, TWO_BY_TWO)
    head = str(timed).split("\n")[0]
    assert head == (f"Fused BSR with heuristics: 2 tensors, 5 messages in 1 step(s); total 128 B intra-node + 64 B "
                    f"inter-node; est. {timed.estimated_time():.3f} s")
    survivors = plan_switch({"w": (Annotation("[0,1] D2"), (2 ** 20,))}, {"w": (Annotation("[2] R"), (2 ** 20,))},
                            TWO_BY_TWO, failed=[0])
    lines = str(survivors).split("\n")
    assert lines[0] == ("Fused BSR with heuristics: 1 tensors, 1 messages in 1 step(s); total 0 MB intra-node + 4 MB "
                        f"inter-node; failed ranks [0]; est. {survivors.estimated_time():.3f} s")
    assert lines[1] == "Sender: intra MB | inter MB" and lines[2] == "R1: 0 | 4"
    near = plan_switch({"w": (Annotation("[0] R"), (2 ** 20,))}, {"w": (Annotation("[1] R"), (2 ** 20,))}, TWO_BY_TWO)
    assert str(near).split("\n")[0].startswith("Fused BSR with heuristics: 1 tensors, 1 messages in 1 step(s); total "
                                               "4 MB intra-node + 0 MB inter-node; est. ")


def test_a_plan_names_one_bsr_operator_per_step() -> None:
    """``SwitchPlan.kinds`` (what ``viz.comm_figure`` puts in the title, as for a ``CommPlan``): one ``BSR`` per
    step -- one for a fused plan, one per tensor unfused."""
    assert plan_switch(SRC, DST, TWO_BY_TWO).kinds == ["BSR"]
    assert plan_switch(SRC, DST, TWO_BY_TWO, fused=False).kinds == ["BSR", "BSR"]


def test_a_rank_s_part_keeps_its_messages_with_their_tags_its_copies_and_zero_fills() -> None:
    """``SwitchPlan.part(rank)``: per step, the messages ``rank`` sends or receives, each tagged with its index in the
    whole step (the whole plan's messages have no tag), the copies and zero fills on ``rank``; all else as the
    whole plan.  One step: v's four pieces 0->2, 0->3, 1->2, 1->3 (indices 0-3), w whole 2->3 (index 4), z copied on
    rank 1 and zero-filled on rank 2 (its Partial destination)."""
    import dataclasses

    src = dict(SRC, z=(Annotation("[0,1] D2"), (2, 2)))
    dst = dict(DST, z=(Annotation("[1,2] P2"), (2, 2)))
    plan = plan_switch(src, dst, TWO_BY_TWO)
    (whole,) = plan.steps
    assert [(m.src, m.dst, m.tag) for m in whole.messages] == [(0, 2, None), (0, 3, None), (1, 2, None),
                                                               (1, 3, None), (2, 3, None)]
    want = {0: ([0, 1], (), ()), 1: ([2, 3], (("z", 1, ((0, 2), (0, 2))),), ()), 2: ([0, 2, 4], (), (("z", 2),)),
            3: ([1, 3, 4], (), ())}
    for rank, (tags, copies, zero_fill) in want.items():
        part = plan.part(rank)
        (step,) = part.steps
        assert [m.tag for m in step.messages] == tags, rank
        assert list(step.messages) == [dataclasses.replace(whole.messages[i], tag=i) for i in tags], rank
        assert (step.copies, step.zero_fill) == (copies, zero_fill), rank
        assert dataclasses.replace(part, steps=plan.steps) == plan
    unfused = plan_switch(src, dst, TWO_BY_TWO, fused=False)
    assert len(unfused.steps) > 1
    assert [[(m.src, m.dst, m.tag) for m in s.messages] for s in unfused.part(3).steps] == \
        [[(m.src, m.dst, i) for i, m in enumerate(s.messages) if 3 in (m.src, m.dst)] for s in unfused.steps]


def test_a_rank_s_part_by_the_index_is_the_part_by_scanning() -> None:
    """``SwitchPlan.part(rank, index=switch_index(plan))`` (a launcher writing every rank's part looks each rank's
    messages, copies and zero fills up instead of scanning) gives exactly ``plan.part(rank)``, fused and unfused,
    for every rank -- including one that takes no part in a step."""
    from hspmd_sdk.core.program_part import switch_index

    src = dict(SRC, z=(Annotation("[0,1] D2"), (2, 2)))
    dst = dict(DST, z=(Annotation("[1,2] P2"), (2, 2)))
    for plan in (plan_switch(src, dst, TWO_BY_TWO), plan_switch(src, dst, TWO_BY_TWO, fused=False)):
        index = switch_index(plan)
        for rank in range(4):
            by_index, scanned = plan.part(rank, index=index), plan.part(rank)
            assert by_index == scanned, rank
            assert [len(s.messages) for s in by_index.steps] == [len(s.messages) for s in scanned.steps]
            assert by_index.steps and any(s.copies for s in plan.part(1, index=index).steps)
    assert any(s.zero_fill for s in plan_switch(src, dst, TWO_BY_TWO).part(2, index=switch_index(
        plan_switch(src, dst, TWO_BY_TWO))).steps)
