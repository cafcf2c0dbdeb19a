"""Kills for the mutants of hspmd_sdk/core/reconfigure.py (issue 49): the lost-state error's text, rank remapping,
the state table, which state counts as lost (box coverage), and what plan_program_switch passes to plan_switch --
on stand-in Programs whose state layouts are written out here."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from hspmd_sdk import Cluster
from hspmd_sdk.core.annotation import Annotation
from hspmd_sdk.core.reconfigure import (LostStateError, _covered, _lost, plan_program_switch, remap_annotation,
                                        state_table)
from hspmd_sdk.errors import ResolutionError

A = Annotation.parse


@dataclass
class Lay:
    annotation: Annotation
    shape: tuple
    dtype: str = "float32"


class Prog:
    """A stand-in Program: state layouts and a cluster."""

    def __init__(self, layouts: dict, cluster=None) -> None:
        self._l, self.cluster = layouts, cluster

    def state_layouts(self):
        return dict(self._l)


# ---- LostStateError ------------------------------------------------------------------------------------------
def test_lost_state_error_text() -> None:
    """Names the tensors (the first 8, then how many in all) and the failed ranks, then the advice."""
    e = LostStateError(["a", "b"], [3, 1])
    assert isinstance(e, ResolutionError) and e.tensors == ["a", "b"] and e.ranks == [3, 1]
    assert e.what == "no surviving copy of a, b: held only by the failed rank(s) [3, 1]"
    assert str(e) == ("no surviving copy of a, b: held only by the failed rank(s) [3, 1]. Without a checkpoint "
                      "this state is lost (run with checkpoint_dir=..., or keep a data-parallel replica of every "
                      "parameter: two pipelines and ZeRO-1 off, as the paper does)")
    names = [f"t{i}" for i in range(9)]
    assert LostStateError(names, [0]).what == ("no surviving copy of t0, t1, t2, t3, t4, t5, t6, t7 ... (9 in all): "
                                               "held only by the failed rank(s) [0]")
    assert LostStateError(names[:8], [0]).what == ("no surviving copy of t0, t1, t2, t3, t4, t5, t6, t7: held only "
                                                   "by the failed rank(s) [0]")


# ---- remap / state table -------------------------------------------------------------------------------------
def test_remap_annotation_keeps_the_layout() -> None:
    """Only the ranks change: DS Union, HDim and ratios stay."""
    ann = A("[0,1] S0x2 | [2,3] S1x2 ; hdim=0 ratios=1:3")
    got = remap_annotation(ann, {0: 7, 1: 6, 2: 5, 3: 4})
    assert got == A("[7,6] S0x2 | [5,4] S1x2 ; hdim=0 ratios=1:3")
    assert got.dg_union == [[7, 6], [5, 4]] and got.hdim == 0 and got.hratios == [1, 3]


def test_state_table_maps_ranks_and_shares_one_remap_per_annotation() -> None:
    """name -> (annotation, shape); with a mapping the ranks are renumbered, one object per distinct annotation
    (a parameter and its moments share it)."""
    w, b = A("[0,1] S0x2"), A("[1] R")
    prog = Prog({"w": Lay(w, (4, 2)), "w.exp_avg": Lay(w, (4, 2)), "b": Lay(b, (3,))})
    assert state_table(prog) == {"w": (w, (4, 2)), "w.exp_avg": (w, (4, 2)), "b": (b, (3,))}
    assert state_table(prog)["w"][0] is w
    t = state_table(prog, {0: 2, 1: 0})
    assert t == {"w": (A("[2,0] S0x2"), (4, 2)), "w.exp_avg": (A("[2,0] S0x2"), (4, 2)), "b": (A("[0] R"), (3,))}
    assert t["w"][0] is t["w.exp_avg"][0] and list(t) == ["w", "w.exp_avg", "b"]


# ---- coverage and lost state ---------------------------------------------------------------------------------
def test_covered_by_a_union_of_boxes() -> None:
    """A box is covered when every cell the others cut it into lies in one of them; boxes that only touch do
    not count."""
    box = ((0, 4), (0, 4))
    assert _covered(box, {((0, 4), (0, 4))})
    assert _covered(box, {((0, 2), (0, 4)), ((2, 4), (0, 4))})
    assert _covered(box, {((0, 2), (0, 2)), ((0, 2), (2, 4)), ((2, 4), (0, 4))})
    assert _covered(box, {((-1, 5), (-1, 5))})
    assert not _covered(box, {((0, 2), (0, 4))})
    assert not _covered(box, {((0, 2), (0, 2)), ((2, 4), (0, 4))})
    assert not _covered(box, {((4, 8), (0, 4)), ((0, 4), (4, 8))})  # touching, not overlapping
    assert not _covered(box, set())
    assert _covered(((2, 3),), {((0, 3),)}) and not _covered(((2, 4),), {((0, 3),)})
    assert _covered(((0, 4),), {((0, 1),), ((1, 4),)}) and not _covered(((0, 4),), {((0, 1),), ((2, 4),)})
    assert not _covered(((0, 4),), {((0, 3),), ((4, 5),)})  # the last cell [3, 4) is missing


def test_lost_names_state_only_dead_ranks_hold() -> None:
    """No dead ranks: nothing; replicated or covered by survivors: kept; a shard only the dead hold: lost, in
    table order."""
    table = {"split": (A("[0,1] S0x2"), (4,)), "dup": (A("[0,1] D2"), (4,)), "far": (A("[2,3] S0x2"), (4,)),
             "pair": (A("[0,1] S0x2 | [2,3] S0x2"), (4,)), "mixed": (A("[0] R | [2,3] S0x2"), (4,)),
             "split2": (A("[0,1] S0x2"), (4,))}
    assert _lost(table, []) == []
    assert _lost(table, [1]) == ["split", "split2"]
    assert _lost(table, [1, 2]) == ["split", "far", "split2"]
    assert _lost(table, [0]) == ["split", "split2"]
    assert _lost(table, [0, 1]) == ["split", "dup", "split2"]
    assert _lost(table, [9]) == []
    # a shard whose halves survive elsewhere: [0] holds rows 0-3, [1,2] split them
    assert _lost({"x": (A("[0] R | [1,2] S0x2"), (4,))}, [0]) == []
    assert _lost({"x": (A("[0,1] S0x2 | [2,3,4] S0x3"), (6,))}, [0]) == []  # rows 0-2 on ranks 2 and 3
    assert _lost({"x": (A("[0,1] S0x2 | [2,3,4] S0x3"), (6,))}, [0, 3]) == ["x"]  # row 2 only on rank 0
    assert _lost({"x": (A("[0,1,2] S0x3 | [3,4] S0x2"), (6,))}, [3]) == []


# ---- plan_program_switch -------------------------------------------------------------------------------------
CL = Cluster.local(4)


def _progs():
    src = Prog({"w": Lay(A("[0,1] S0x2 | [2,3] S0x2"), (4, 2), "float16"),
                "w.exp_avg": Lay(A("[0,1] S0x2 | [2,3] S0x2"), (4, 2))}, cluster=CL)
    dst = Prog({"w": Lay(A("[0] R"), (4, 2), "float16"), "w.exp_avg": Lay(A("[1] R"), (4, 2))})
    return src, dst


def test_switch_moves_every_state_with_the_source_dtypes() -> None:
    """One fused BSR by default, on the source's cluster, each tensor with its source dtype's item size."""
    src, dst = _progs()
    plan = plan_program_switch(src, dst)
    assert [(t.name, t.itemsize, str(t.dst)) for t in plan.tensors] == [("w", 2, "[0] R"), ("w.exp_avg", 4, "[1] R")]
    assert plan.fused and plan.heuristics and plan.failed == () and plan.empty == () and plan.cluster is CL
    other = Cluster.local(6)
    plan = plan_program_switch(src, dst, other, fused=False, heuristics=False)
    assert plan.cluster is other and not plan.fused and not plan.heuristics and len(plan.steps) == 2


def test_switch_in_the_source_numbering() -> None:
    """dst's ranks are mapped into src's numbering; failed and empty ranks are passed on, failed sorted."""
    src, dst = _progs()
    plan = plan_program_switch(src, dst, dst_to_src={0: 3, 1: 2}, failed=[1], empty=[0])
    assert [str(t.dst) for t in plan.tensors] == ["[3] R", "[2] R"]
    assert plan.failed == (1,) and plan.empty == (0,)
    plan = plan_program_switch(src, dst, dst_to_src={0: 3, 1: 2}, failed=(1, 0, 1))
    assert plan.failed == (0, 1)
    assert all(m.src not in (0, 1) for s in plan.steps for m in s.messages)


def test_switch_refuses_lost_state_naming_the_failed_ranks_only() -> None:
    """State held only by failed (or empty) ranks raises LostStateError; its ranks are the failed ones."""
    _, dst = _progs()
    src = Prog({"w": Lay(A("[0,1] S0x2 | [2] R"), (4, 2)), "w.exp_avg": Lay(A("[0,1] S0x2 | [2] R"), (4, 2))})
    with pytest.raises(LostStateError) as info:
        plan_program_switch(src, dst, CL, failed=[2, 0, 0])
    assert info.value.tensors == ["w", "w.exp_avg"] and info.value.ranks == [0, 2]
    with pytest.raises(LostStateError) as info:
        plan_program_switch(src, dst, CL, failed=[0], empty=[2])
    assert info.value.ranks == [0]
    with pytest.raises(LostStateError) as info:
        plan_program_switch(src, dst, CL, empty=[2, 0])
    assert info.value.ranks == [] and info.value.tensors == ["w", "w.exp_avg"]


def test_switch_refuses_programs_of_other_models() -> None:
    """Different state names: the error shows (up to 5 of) the names only one side has, sorted."""
    src, dst = _progs()
    extra = Prog({**dst._l, **{f"z{i}": Lay(A("[0] R"), (1,)) for i in range(6)}, "a": Lay(A("[0] R"), (1,))})
    with pytest.raises(ResolutionError) as info:
        plan_program_switch(src, extra)
    assert str(info.value) == ("the two programs do not hold the same training state (e.g. ['a', 'z0', 'z1', 'z2', "
                               "'z3']): a switch needs the same model")
    with pytest.raises(ResolutionError) as info:
        plan_program_switch(Prog({"q": Lay(A("[0] R"), (1,))}), dst)
    assert "(e.g. ['q', 'w', 'w.exp_avg'])" in str(info.value)
