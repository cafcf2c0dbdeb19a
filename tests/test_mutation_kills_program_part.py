"""Kills for the mutants of hspmd_sdk/core/program_part.py (issue 49): a Program's part for one rank, its JSON and
the compact runs, exactly.  Every test here is in-process and fast (no worker is launched)."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from hspmd_sdk.core import program_part as pp
from hspmd_sdk.core.comm_ops import Message
from hspmd_sdk.core.program_part import (PART_FORMAT, ProgramPartError, no_message, pack_json, part_json,
                                         program_digest, unpack_json)
from hspmd_sdk.core.specialize import ProgramPart

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_program_part import _gpt  # noqa: E402  (the same small GPT programs)


# ---- the placeholder message --------------------------------------------------------------------------------------
def test_program_part_no_message_is_the_exact_placeholder() -> None:
    assert no_message(3) == Message(-1, -1, ((0, 0), (0, 0), (0, 0)), 0)
    assert no_message(1) == Message(src=-1, dst=-1, box=((0, 0),), nbytes=0)
    assert no_message(0).box == ()


# ---- pack_json: each kind of run, exactly ---------------------------------------------------------------------------
PACKED = [
    # arithmetic runs of 3 or more ints (also step 0 and negative steps); 2 ints are no run
    ([0, 4, 8, 12], [{"$A": [0, 4, 4]}]),
    ([1, 1, 1], [{"$A": [1, 0, 3]}]),
    ([9, 6, 3, 0, -3], [{"$A": [9, -3, 5]}]),
    ([5, 7], [5, 7]),
    ([0, 1, 2, 10, 11], [{"$A": [0, 1, 3]}, 10, 11]),
    ([0, 1, "a", 2], [0, 1, "a", 2]),
    ([0, 1, 2, "a"], [{"$A": [0, 1, 3]}, "a"]),
    # a block repeated, each time shifted (3 times or more)
    ([0, 3, 4, 7, 8, 11], [{"$P": [[0, 3], 4, 3]}]),
    ([0, 3, 4, 7], [0, 3, 4, 7]),
    ([0, 3, 4, 7, 8, 11, 12, 15, 99], [{"$P": [[0, 3], 4, 4]}, 99]),
    ([0, 2, 1, 10, 12, 11, 20, 22, 21], [{"$P": [[0, 2, 1], 10, 3]}]),
    ([0, 5, 0, 5, 0, 5], [0, 5, 0, 5, 0, 5]),
    # a run of equal values (R) and of values whose ints change by constant deltas (L)
    ([{"a": 1}, {"a": 1}], [{"$R": [{"a": 1}, 2]}]),
    (["x", "x", "x"], [{"$R": ["x", 3]}]),
    (["x", "y"], ["x", "y"]),
    ([[0, 1], [4, 5], [8, 9]], [{"$L": [[0, 1], [4, 4], 3]}]),
    ([[0, 1], [4, 5], [8, 9], [0, 1]], [{"$L": [[0, 1], [4, 4], 3]}, [0, 1]]),
    ([[0, 1], [4, 6], [8, 11]], [{"$L": [[0, 1], [4, 5], 3]}]),
    ([[0, 1], [4, 6], [8, 12]], [{"$L": [[0, 1], [4, 5], 2]}, [8, 12]]),
    ([{"$ref": 3}, {"$ref": 4}, {"$ref": 5}], [{"$L": [{"$ref": 3}, [1], 3]}]),
    ([[1, 2], [1, 5, 3]], [[1, 2], [1, 5, 3]]),
    ([{"a": 1}, {"b": 1}], [{"a": 1}, {"b": 1}]),
    ([{"$c": "A", "f": [1]}, {"$c": "B", "f": [1]}], [{"$c": "A", "f": [1]}, {"$c": "B", "f": [1]}]),
    ([{"$c": "A", "f": [1]}, {"$c": "A", "f": [2]}], [{"$L": [{"$c": "A", "f": [1]}, [1], 2]}]),
    ([{"$p": "A", "f": [1]}, {"$p": "B", "f": [1]}], [{"$p": "A", "f": [1]}, {"$p": "B", "f": [1]}]),
    ([[1, True], [2, True]], [{"$L": [[1, True], [1], 2]}]),
    ([[1, "s"], [2, "t"]], [[1, "s"], [2, "t"]]),
    ([[1], 7, [1]], [[1], 7, [1]]),
    # values that read as runs are written as runs of themselves; model records are left alone
    ([{"$A": 1}], [{"$R": [{"$A": 1}, 1]}]),
    ([{"$P": 1}, {"$L": 2}, {"$R": 3}], [{"$R": [{"$P": 1}, 1]}, {"$R": [{"$L": 2}, 1]}, {"$R": [{"$R": 3}, 1]}]),
    ([{"$X": 1}], [{"$X": 1}]),
    ([{"$A": 1, "b": 2}], [{"$A": 1, "b": 2}]),
    ([{"$model": "m", "x": [0, 1, 2]}, {"$model": "m", "x": [0, 1, 2]}],
     [{"$model": "m", "x": [0, 1, 2]}, {"$model": "m", "x": [0, 1, 2]}]),
    ({"$model": "m", "x": [0, 1, 2]}, {"$model": "m", "x": [0, 1, 2]}),
    ({"k": [0, 1, 2], "j": {"i": [3, 3, 3]}}, {"k": [{"$A": [0, 1, 3]}], "j": {"i": [{"$A": [3, 0, 3]}]}}),
    ([[0, 1, 2], [0, 1, 2]], [{"$R": [[{"$A": [0, 1, 3]}], 2]}]),
    (7, 7),
    ("s", "s"),
    (None, None),
    ([], []),
]


@pytest.mark.parametrize("value, packed", PACKED)
def test_program_part_pack_json_writes_each_run_exactly(value: Any, packed: Any) -> None:
    assert pack_json(value) == packed
    assert unpack_json(packed) == value


BLOCKS = {
    # a block found after other values (its start and its checks are where it begins), not starting at 0
    "after_a_value": ([5, 0, 3, 4, 7, 8, 11], [5, {"$P": [[0, 3], 4, 3]}]),
    "after_a_string": (["a", 0, 3, 4, 7, 8, 11], ["a", {"$P": [[0, 3], 4, 3]}]),
    "not_at_zero": ([1, 4, 5, 8, 9, 12], [{"$P": [[1, 4], 4, 3]}]),
    # a block of two repeats with no shift is passed over for a longer one
    "unshifted_pair": ([0, 7, 0, 1, 8, 1, 2, 9, 2], [{"$P": [[0, 7, 0], 1, 3]}]),
    # a second block that does not repeat the first ends the count, even where a third would
    "second_differs": ([0, 3, 50, 50, 100, 103], [0, 3, 50, 50, 100, 103]),
}


@pytest.mark.parametrize("case", sorted(BLOCKS))
def test_program_part_pack_json_finds_blocks_where_they_start(case: str) -> None:
    value, packed = BLOCKS[case]
    assert pack_json(value) == packed
    assert unpack_json(packed) == value


def test_program_part_pack_json_finds_blocks_of_up_to_eight() -> None:
    block8 = [0, 5, 1, 7, 2, 9, 3, 4]  # no arithmetic run of 3 inside
    nine = block8 + [8]
    assert pack_json([b + 100 * k for k in range(3) for b in block8]) == [{"$P": [block8, 100, 3]}]
    nines = [b + 100 * k for k in range(3) for b in nine]
    assert pack_json(nines)[0] != {"$P": [nine, 100, 3]} and unpack_json(pack_json(nines)) == nines
    # the block that covers the most ints wins: [0, 1] x 3 (6 ints) before [0, 1, 10] ... (no repeat)
    assert pack_json([0, 9, 10, 19, 20, 29, 7]) == [{"$P": [[0, 9], 10, 3]}, 7]
    # a longer block covering more ints beats a shorter one found first
    two_four = [0, 7, 1, 9, 10, 17, 11, 19, 20, 27, 21, 29]
    assert pack_json(two_four) == [{"$P": [[0, 7, 1, 9], 10, 3]}]
    # a shift of 0 is no block
    assert pack_json([0, 7, 0, 7, 0, 7, 0, 7]) == [0, 7, 0, 7, 0, 7, 0, 7]


def test_program_part_period_reports_block_shift_and_count() -> None:
    assert pp._period([0, 3, 4, 7, 8, 11], 0) == ([0, 3], 4, 3)
    assert pp._period([9, 0, 3, 4, 7, 8, 11], 1) == ([0, 3], 4, 3)
    assert pp._period([0, 3, 4, 7], 0) == ([0, 3], 4, 2)
    assert pp._period([0, 3, 4], 0) == ([], 0, 0)
    assert pp._period([0, 3, "a", 7], 0) == ([], 0, 0)
    assert pp._period([0, 3, 4, 7, 8, 11, 12, 15], 0, longest=2) == ([0, 3], 4, 4)
    assert pp._period([0, 0, 0, 0], 0) == ([], 0, 0)
    assert pp._period([0, 3, 4, 7, 8, "a"], 0) == ([0, 3], 4, 2)


# ---- unpack_json ------------------------------------------------------------------------------------------------------
def test_program_part_unpack_json_expands_each_marker_exactly() -> None:
    assert unpack_json([{"$A": [5, -2, 4]}]) == [5, 3, 1, -1]
    assert unpack_json([{"$A": ["5", "2", "2"]}]) == [5, 7]
    assert unpack_json([{"$P": [[0, 1], 4, 3]}]) == [0, 1, 4, 5, 8, 9]
    assert unpack_json([{"$P": [["0", "1"], "4", "2"]}]) == [0, 1, 4, 5]
    assert unpack_json([{"$L": [[0, [1]], [2, 3], 3]}]) == [[0, [1]], [2, [4]], [4, [7]]]
    # the run's values as written (packed): each is unpacked after its integers are set
    assert unpack_json([{"$L": [[0, [{"$A": [0, 1, 3]}]], [1, 10, 1, 0], 2]}]) == [[0, [0, 1, 2]], [1, [10, 12, 14]]]
    assert unpack_json([{"$L": [{"$ref": 2}, ["3"], "2"]}]) == [{"$ref": 2}, {"$ref": 5}]
    assert unpack_json([{"$R": [{"k": [{"$A": [0, 1, 3]}]}, 2]}]) == [{"k": [0, 1, 2]}] * 2
    assert unpack_json([{"$R": ["x", "3"]}]) == ["x", "x", "x"]
    assert unpack_json([1, {"$A": [0, 1, 0]}, 2]) == [1, 2]
    assert unpack_json({"$model": [{"$A": [0, 1, 3]}]}) == {"$model": [{"$A": [0, 1, 3]}]}
    assert unpack_json({"m": [{"$A": [0, 1, 3]}]}) == {"m": [0, 1, 2]}
    assert unpack_json([{"$A": [0, 1, 2], "b": 1}]) == [{"$A": [0, 1, 2], "b": 1}]
    assert unpack_json([{"$X": [0, 1, 2]}]) == [{"$X": [0, 1, 2]}]
    assert unpack_json([[{"$A": [0, 2, 2]}]]) == [[0, 2]]
    assert unpack_json(3) == 3 and unpack_json("$A") == "$A"


def test_program_part_unpack_json_refuses_a_damaged_run() -> None:
    with pytest.raises(ProgramPartError) as e:
        unpack_json([{"$L": [[0, 1], [1], 2]}])
    assert str(e.value) == "damaged part: a run of [0, 1] with 1 deltas for 2 integers"


# ---- the skeleton of a value and its refill ------------------------------------------------------------------------
def test_program_part_skeleton_and_fill() -> None:
    key, ints = pp._skeleton([1, {"a": 2, "b": [3, "s", True, None, 1.5]}])
    assert ints == [1, 2, 3]
    assert key == pp._skeleton([7, {"a": 8, "b": [9, "s", True, None, 1.5]}])[0]
    assert key != pp._skeleton([7, {"a": 8, "b": [9, "t", True, None, 1.5]}])[0]
    assert key != pp._skeleton([7, {"a": 8, "b": [9, "s", False, None, 1.5]}])[0]
    assert json.loads(key) == [pp._skeleton(0)[0] and json.loads(pp._skeleton(0)[0]),
                               {"a": json.loads(pp._skeleton(0)[0]), "b": [json.loads(pp._skeleton(0)[0]), "s",
                                                                          True, None, 1.5]}]
    assert pp._skeleton(5) == (json.dumps("\u0000int"), [5])
    assert pp._fill([0, {"a": 0, "b": [0, "s", True]}], iter([4, 5, 6])) == [4, {"a": 5, "b": [6, "s", True]}]
    assert pp._fill("s", iter([])) == "s" and pp._fill(0, iter([9])) == 9


def test_program_part_outline() -> None:
    assert pp._outline({"$c": "A", "f": 1}) == (("$c", "f"), "A")
    assert pp._outline({"$p": "B", "f": 1}) == (("$p", "f"), "B")
    assert pp._outline({"a": 1}) == (("a",), None)
    assert pp._outline([1, 2, 3]) == 3
    assert pp._outline("s") is str and pp._outline(1) is int


def test_program_part_linear_run_ends_and_deltas() -> None:
    items: list[Any] = [[0, 1], [2, 4], [4, 7], [6, 9], 5]
    assert pp._linear_run(items, 0, {}) == (3, [2, 3])
    assert pp._linear_run(items, 3, {}) == (4, [])
    assert pp._linear_run(["a", "a", "a"], 0, {}) == (3, [])
    assert pp._linear_run([[0], [0]], 0, {}) == (2, [0])
    assert pp._linear_run([[0], "x"], 0, {}) == (1, [])
    assert pp._linear_run([[0, 1], ["a", 2]], 0, {}) == (1, [0, 0])  # a run of one value: no change, zeros
    assert pp._linear_run([{"$model": 1}, {"$model": 1}], 0, {}) == (1, [])
    assert pp._linear_run([[0], [1]], 1, {}) == (2, [])
    sk: dict[int, Any] = {}
    assert pp._linear_run([[0], [1], [2]], 0, sk) == (3, [1])
    assert sk == {0: pp._skeleton([0]), 1: pp._skeleton([1]), 2: pp._skeleton([2])}


# ---- making a part: every field, for a program whose settings are not the defaults -----------------------------------
def _gpipe_zero1() -> Any:
    """Two pipelines of two one-rank stages (GPT tiny), GPipe, ZeRO-1, recomputation on ranks 0 and 3, unequal
    micro-batches (2 x 1 and 1 x 2)."""
    from hspmd_sdk import Cluster, GPTConfig, Strategy
    from hspmd_sdk.core.specialize import specialize
    from hspmd_sdk.core.strategy_plan import plan_from_strategy

    p0 = {"stages": [{"devices": [0], "layers": [0, 1], "recompute": True}, {"devices": [1], "layers": [2, 3]}],
          "micro_batch_size": 1, "num_micro_batches": 2}
    p1 = {"stages": [{"devices": [2], "layers": [0, 1]}, {"devices": [3], "layers": [2, 3], "recompute": True}],
          "micro_batch_size": 2, "num_micro_batches": 1}
    model, cluster = GPTConfig.preset("tiny"), Cluster.local(4)
    strategy = Strategy.load({"pipelines": [p0, p1], "schedule": "gpipe", "zero1": True})
    return specialize(model, plan_from_strategy(model, strategy, cluster), cluster)


def test_program_part_fields_of_each_rank() -> None:
    import dataclasses

    from hspmd_sdk.core.plan import AnnotationPlan, ExecutionSettings

    prog = _gpipe_zero1()
    st = prog.plan.settings.model_copy(update={"zero1_replicated": ("wte.weight",), "max_seq_len": 64,
                                               "windows": (64, 64)})
    prog = dataclasses.replace(prog, plan=AnnotationPlan(annotations=prog.plan.annotations, settings=st), _micro={})
    assert prog.recompute == frozenset({0, 3}) and prog.micro_batches == (2, 1)
    own = {0: ((0, 0), [[[0], [1]], []], (2, 0), (1, 0)), 1: ((0, 1), [[[0], [1]], []], (2, 0), (1, 0)),
           2: ((1, 0), [[], [[2], [3]]], (0, 1), (0, 2)), 3: ((1, 1), [[], [[2], [3]]], (0, 1), (0, 2))}
    for r, (where, pipes, micro, sizes) in own.items():
        part = prog.part(r, version=4)
        assert (part.rank, part.version, part.world_ranks, part.program_digest) == (r, 4, 4, prog.digest())
        assert part.cluster is None and part.plan == AnnotationPlan(annotations={}, settings=ExecutionSettings(
            schedule="gpipe", zero1=True, zero1_replicated=("wte.weight",), max_seq_len=64))
        assert part.pipelines == pipes and part.micro_batches == micro and part.micro_batch_sizes == sizes
        assert part._where == {r: where} and part.schedules == {where: prog.schedules[where]}
        assert part.recompute == (frozenset({r}) if r in (0, 3) else frozenset())
        assert part.schedule_kind == prog.schedule_kind == "gpipe"
        assert part._node_ranks == {n: frozenset({r}) if r in rs else frozenset()
                                    for n, rs in prog._node_ranks.items()}
        assert part._compute_ops == {n: o for n, o in prog._compute_ops.items() if r in prog._node_ranks[n]}
        assert part._sync_ranks == tuple(frozenset({r}) if r in rs else frozenset() for rs in prog._sync_ranks)
        assert part.pre_reshards == prog.pre_reshards and part.grad_syncs == prog.grad_syncs
        assert part.constraints == prog.constraints and part.bindings == prog.bindings
        assert part.annotations is prog.annotations and part.model is prog.model
        # the plans it keeps: those its executable graph runs, each restricted to the rank
        used = {o.name for o in prog.executable_graph(r).ops if o.comm is not None}
        assert set(part.comm_plans) == {k for k in prog.comm_plans if k in used}
        assert set(part.backward_plans) == {k for k in prog.backward_plans if f"{k}.bwd" in used}
        assert set(part.grad_reduce_plans) == {k for k in prog.grad_reduce_plans if f"{k}.grad_reduce" in used}
        assert set(part.grad_sync_plans) == {k for k in prog.grad_sync_plans if k in used}
        names = set(part.comm_plans) | {f"{k}.bwd" for k in part.backward_plans} | set(part.grad_sync_plans) \
            | {f"{k}.grad_reduce" for k in part.grad_reduce_plans}
        assert part._plan_keys == {n: k for n, k in prog._plan_keys.items() if n in names}
        for plans, whole in ((part.comm_plans, prog.comm_plans), (part.backward_plans, prog.backward_plans),
                             (part.grad_reduce_plans, prog.grad_reduce_plans),
                             (part.grad_sync_plans, prog.grad_sync_plans)):
            for k, plan in plans.items():
                assert plan == pp.restrict_plan(whole[k], r), k


def test_program_part_a_rank_of_no_pipeline_and_shared_plans() -> None:
    """hetero_bsr: the part of each rank; one plan object shared by two keys is restricted once (the same object)."""
    prog = _gpt("hetero_bsr")
    part = prog.part(2)
    assert part.pipelines == [[[0, 1], [2]], []] and part.micro_batches == (3, 0)
    assert part.micro_batch_sizes == (2, 0) and part._where == {2: (0, 1)}
    assert list(part.schedules) == [(0, 1)] and part.recompute == frozenset()
    shared = [(k, j) for k in prog.comm_plans for j in prog.comm_plans
              if k < j and prog.comm_plans[k] is prog.comm_plans[j]]
    for r in prog.ranks:
        p = prog.part(r)
        for k, j in shared:
            if k in p.comm_plans and j in p.comm_plans:
                assert p.comm_plans[k] is p.comm_plans[j]


def test_program_part_refuses_a_rank_outside_the_program_naming_it() -> None:
    prog = _gpt("hetero_bsr")
    with pytest.raises(ProgramPartError) as e:
        prog.part(7)
    assert str(e.value) == ("rank 7 takes part in no operator of this program (ranks [0, 1, 2, 3]); it has no "
                            "part")
    assert prog.part("3").rank == 3  # type: ignore[arg-type]


# ---- restricting a plan ------------------------------------------------------------------------------------------------
def test_program_part_restrict_plan_keeps_the_ranks_own_of_each_operator() -> None:
    from hspmd_sdk.core.comm_ops import CollectiveOp, PointToPointOp, SplitCollectiveOp

    prog = _gpt("hetero_bsr")
    kinds: set[type] = set()
    for plans in (prog.comm_plans, prog.backward_plans, prog.grad_reduce_plans, prog.grad_sync_plans):
        for plan in plans.values():
            for r in prog.ranks:
                got = pp.restrict_plan(plan, r)
                assert got.cluster is None and len(got.ops) == len(plan.ops)
                assert (got.src, got.dst, got.shape, got.dtype) == (plan.src, plan.dst, plan.shape, plan.dtype)
                filler = Message(-1, -1, ((0, 0),) * len(plan.shape), 0)
                for op, mine in zip(plan.ops, got.ops):
                    kinds.add(type(op))
                    if isinstance(op, CollectiveOp):
                        assert mine.groups == tuple(g for g in op.groups if r in g.ranks)
                        assert mine.kind == op.kind and mine.itemsize == op.itemsize
                    elif isinstance(op, SplitCollectiveOp):
                        assert mine.slices == tuple(s for s in op.slices if r in s.ranks)
                        assert mine.in_boxes == tuple(b for b in op.in_boxes if b[0] == r)
                        assert mine.out_boxes == tuple(b for b in op.out_boxes if b[0] == r)
                    elif isinstance(op, PointToPointOp):
                        assert mine.messages == tuple(m if r in (m.src, m.dst) else filler for m in op.messages)
                        assert mine.copies == tuple(c for c in op.copies if c[0] == r)
                        assert mine.in_boxes == tuple(b for b in op.in_boxes if b[0] == r)
                        assert mine.out_boxes == tuple(b for b in op.out_boxes if b[0] == r)
                        assert mine.zero_fill == tuple(z for z in op.zero_fill if z == r)
                    else:
                        assert mine is op
    assert {CollectiveOp, PointToPointOp, SplitCollectiveOp} <= kinds


# ---- the world's groups and pairs ------------------------------------------------------------------------------------
def test_program_part_world_groups_and_pairs_exactly() -> None:
    """hetero_bsr (a TP2 -> TP1 pipeline beside a one-rank pipeline): the TP pair (0, 1); the gradient
    synchronisations of layers 0-1 between the TP2 stage and rank 3 (replicated: 0, 1, 3; split: 0-3 and 1-3) and
    of layers 2-3 between ranks 2 and 3.  Stage boundary: rank 0 sends the activations to rank 2 (one sender of a
    replicated tensor), rank 2 the gradients to ranks 0 and 1."""
    prog = _gpt("hetero_bsr")
    assert pp.world_groups(prog) == ((0, 1), (0, 1, 3), (0, 3), (1, 3), (2, 3))
    assert pp.world_pipeline_pairs(prog) == ((0, 0, 2), (1, 0, 2), (1, 1, 2))
    part = prog.part(1)
    assert part._group_families == (((0, 1), (0, 2)), ((0, 1, 3), (0,)), ((0, 2), (1,)), ((0, 3), (0,)))
    assert part._pair_families == ((0, 2, (0,)), (1, 1, (1,)), (1, 2, (0,)))
    assert part.world_groups == pp.world_groups(prog) and part.world_pipeline_pairs == pp.world_pipeline_pairs(prog)
    g = _gpipe_zero1()
    assert pp.world_groups(g) == ((0, 2), (1, 3))
    assert pp.world_pipeline_pairs(g) == ((0, 0, 1), (0, 2, 3), (1, 0, 1), (1, 2, 3))
    pp4 = _gpt("pp4")  # the tied embedding's Reshard (a parameter, rank 0 -> rank 3) is no stage boundary
    assert pp.world_pipeline_pairs(pp4) == tuple((d, r, r + 1) for d in (0, 1) for r in range(3))


def test_program_part_families_by_shape() -> None:
    assert pp._group_families([(0, 1), (2, 3), (0, 2), (1, 3, 5)]) == \
        (((0, 1), (0, 2)), ((0, 2), (0,)), ((0, 2, 4), (1,)))
    assert pp.world_groups_of((((0, 1), (4, 0)), ((0, 2, 4), (1,)))) == ((0, 1), (1, 3, 5), (4, 5))
    assert pp._pair_families([(0, 0, 2), (1, 0, 2), (1, 1, 2), (0, 4, 6)]) == \
        ((0, 2, (0, 4)), (1, 1, (1,)), (1, 2, (0,)))
    assert pp.world_pairs_of(((1, 2, (4, 0)), (0, 1, (3,)))) == ((0, 3, 4), (1, 0, 2), (1, 4, 6))
    assert pp._group_families([]) == () and pp._pair_families([]) == ()


def test_program_part_world_answers_are_cached_on_the_program(monkeypatch: pytest.MonkeyPatch) -> None:
    """``world_groups``, ``world_pipeline_pairs`` and ``program_digest`` are computed once per Program (the same
    object is returned again); ``part_json`` writes the shared section once per Program."""
    prog = _gpt("hetero_bsr")
    assert pp.world_groups(prog) is pp.world_groups(prog)
    assert pp.world_pipeline_pairs(prog) is pp.world_pipeline_pairs(prog)
    d = program_digest(prog)
    assert d == hashlib.sha256(prog.to_json().encode("utf-8")).hexdigest() and program_digest(prog) is d
    assert prog.digest() is d
    calls: list[int] = []
    real = pp._shared_section
    monkeypatch.setattr(pp, "_shared_section", lambda p: calls.append(1) or real(p))
    texts = [part_json(prog, r) for r in prog.ranks]
    assert len(calls) == 1 and [ProgramPart.from_json(t) for t in texts] == [prog.part(r) for r in prog.ranks]


# ---- the part's JSON --------------------------------------------------------------------------------------------------
def test_program_part_json_header_and_compact_form() -> None:
    prog = _gpt("hetero_bsr")
    d = prog.digest()
    for text in (prog.part(2, version=3).to_json(), part_json(prog, 2, version=3)):
        assert text.startswith('{"format":"hspmd-program-part/1","rank":2,"digest":"%s","version":3,"objects":['
                               % d), text[:200]
        data = json.loads(text)
        assert list(data) == ["format", "rank", "digest", "version", "objects", "root"]
        assert json.dumps(data, separators=(",", ":")) == text
        assert data["root"] == {"$ref": data["root"]["$ref"]} and data["format"] == PART_FORMAT
        back = ProgramPart.from_json(text)
        assert back == prog.part(2, version=3) and back.version == 3
    assert part_json(prog, 0) != part_json(prog, 3)


def test_program_part_json_writes_each_equal_record_once() -> None:
    """A part's records are distinct (equal ones written once); ``part_json``'s shared section (what every part
    holds alike) comes first and is distinct in itself, and so are the rank's own records after it."""
    prog = _gpt("tp2xpp2xdp2")

    def distinct(objects: list[Any]) -> bool:
        keys = [json.dumps(o, sort_keys=True) for o in objects]
        return len(set(keys)) == len(keys)

    alone = unpack_json(json.loads(prog.part(5).to_json())["objects"])
    assert distinct(alone) and len(alone) < len(json.loads(prog.to_json())["objects"])
    count, ids, text, keep = pp._shared_section(prog)
    shared = unpack_json(json.loads("[" + text + "]"))
    assert len(shared) == count and distinct(shared) and keep
    assert all(id(a) in ids for a in prog.annotations.values())  # every tensor's annotation is shared
    assert sorted(set(ids.values())) == list(range(count))
    launched = unpack_json(json.loads(part_json(prog, 5))["objects"])
    assert launched[:count] == shared and distinct(launched[count:])


def test_program_part_dedup_exactly() -> None:
    x0, x1 = {"$c": "X", "f": [1]}, {"$c": "X", "f": [1]}
    y = {"$c": "Y", "f": [{"$ref": 1}, {"$t": [{"$ref": 0}]}]}
    objects, root, index = pp._dedup([x0, x1, y], [{"$ref": 0}, {"$ref": 1}, {"$ref": 2}])
    assert objects == [{"$c": "X", "f": [1]}, {"$c": "Y", "f": [{"$ref": 0}, {"$t": [{"$ref": 0}]}]}]
    assert root == [{"$ref": 0}, {"$ref": 0}, {"$ref": 1}] and index == {0: 0, 1: 0, 2: 1}
    # unreachable records are dropped; of equal records the first reached is kept (x1, through y), renumbered
    objects, root, index = pp._dedup([x0, x1, y, {"$c": "Z", "f": []}], {"$ref": 2})
    assert objects == [{"$c": "X", "f": [1]}, {"$c": "Y", "f": [{"$ref": 0}, {"$t": [{"$ref": 0}]}]}]
    assert root == {"$ref": 1} and index == {1: 0, 0: 0, 2: 1}
    # records below `fixed` stay where they are; references to them are not followed
    m = {"$model": "cfg", "f": [{"$ref": 9}]}
    objects, root, index = pp._dedup([m, x0, x1, {"$c": "W", "f": {"a": {"$ref": 0}, "b": [{"$ref": 2}]}}],
                                     [{"$ref": 3}, {"$ref": 0}], fixed=1)
    assert objects == [m, {"$c": "X", "f": [1]}, {"$c": "W", "f": {"a": {"$ref": 0}, "b": [{"$ref": 1}]}}]
    assert root == [{"$ref": 2}, {"$ref": 0}] and index == {2: 1, 3: 2}
    # a model record is kept as written (its fields are not references)
    objects, root, index = pp._dedup([m, dict(m)], [{"$ref": 0}, {"$ref": 1}])
    assert objects == [m] and root == [{"$ref": 0}, {"$ref": 0}] and index == {0: 0, 1: 0}


def test_program_part_from_json_refusals_name_what() -> None:
    prog = _gpt("hetero_bsr")
    for text, got in (("[1]", "'list'"), ('{"format": "x"}', "'x'"), ("{}", "None"), ('"s"', "'str'")):
        with pytest.raises(ProgramPartError) as e:
            ProgramPart.from_json(text)
        assert str(e.value) == f"not a Program part's JSON of format 'hspmd-program-part/1' (got {got})"
    with pytest.raises(ProgramPartError, match="^not a Program part's JSON: "):
        ProgramPart.from_json("[" * 100_000 + "]" * 100_000)
    data = json.loads(prog.part(1).to_json())
    d = prog.digest()
    for key, value, said in (("digest", "0" * 64, f"rank 1 of 000000000000, its body rank 1 of {d[:12]}"),
                             ("rank", 3, f"rank 3 of {d[:12]}, its body rank 1 of {d[:12]}")):
        with pytest.raises(ProgramPartError) as e:
            ProgramPart.from_json(json.dumps({**data, key: value}))
        assert str(e.value) == f"damaged part: its header says {said}"
    assert ProgramPart.from_json(prog.part(1).to_json().encode("utf-8")) == prog.part(1)
    # a Program written in a part's form is not a part
    whole = json.loads(prog.to_json())
    text = json.dumps({"format": PART_FORMAT, "rank": 1, "digest": d, "objects": whole["objects"],
                       "root": whole["root"]})
    with pytest.raises(ProgramPartError, match="^the JSON holds a Program, not a ProgramPart$"):
        ProgramPart.from_json(text)


def test_program_part_rank_guard_message_exactly() -> None:
    prog = _gpt("hetero_bsr")
    part = prog.part(1, version=2)
    with pytest.raises(ProgramPartError) as e:
        part.schedule(0)
    assert str(e.value) == (f"schedule: this is rank 1's part of Program {prog.digest()[:12]} (version 2); rank 0 "
                            "is not in it — ask the whole Program, or that rank's part")
    pp.rank_guard(part, "1", "x")  # its own rank, as text: no error


# ---- a switch plan's part -------------------------------------------------------------------------------------------
def test_program_part_plan_parts_json_reads_back_as_the_ranks_part() -> None:
    """``PlanParts(plan).json(rank)``: the compact payload text of ``plan.part(rank)`` (its format, then the packed
    objects and root), which ``unpack_payload`` reads back equal; the records every part holds alike are written
    once per ``PlanParts`` (kept by it, for as long as its owner keeps it) and lead each rank's text."""
    import gc
    import weakref

    from hspmd_sdk import Cluster
    from hspmd_sdk.core.program_json import FORMAT
    from hspmd_sdk.core.reconfigure import plan_program_switch
    from hspmd_sdk.runtime.protocol import unpack_payload

    plan = plan_program_switch(_gpt("hetero_bsr"), _gpt("tp4"), Cluster.local(4))
    parts = pp.PlanParts(plan)
    assert parts.plan is plan
    texts = {r: parts.json(r) for r in range(4)}
    shared = parts.shared
    count, ids, text, _ = shared
    # the shared records are the plan's tensor layouts and its cluster: what every rank's part holds alike
    assert count > 0 and id(plan.cluster) in ids and text
    assert plan.tensors and all(id(t) in ids for t in plan.tensors)
    for r, t in texts.items():
        assert t.startswith('{"format":%s,"packed":{"objects":[%s' % (json.dumps(FORMAT), text)), r
        data = json.loads(t)
        assert list(data) == ["format", "packed"] and list(data["packed"]) == ["objects", "root"]
        assert json.dumps(data, separators=(",", ":")) == t
        assert unpack_payload(t) == plan.part(r)
    assert texts[0] != texts[3] and parts.json(2) == texts[2] and parts.shared is shared
    # another owner of the same plan writes the same texts from records of its own
    again = pp.PlanParts(plan)
    assert again.json(3) == texts[3] and again.shared is not shared
    # nothing but the owner keeps the records (which keep the plan's cluster alive): they go with it and the plan
    gone = (weakref.ref(plan), weakref.ref(plan.cluster))
    del plan, parts, shared, again, ids, _
    gc.collect()
    assert [g() for g in gone] == [None, None]


# ---- seeded samples of the compact JSON's property test (test_program_part's, without hypothesis) --------------------
def _random_json(rng: Any, depth: int = 0) -> Any:
    k = rng.randrange(8 if depth < 3 else 4)
    if k == 0:
        return rng.randrange(-50, 51)
    if k == 1:
        return rng.choice([True, False, None, "", "a", "$A", "\u0000int"])
    if k == 2:
        return rng.choice([[0, 1, 2], [5, 5, 5], [1, 3], [{"$A": [0, 1, 2]}]])
    if k == 3:
        return {"$ref": rng.randrange(4)}
    if k in (4, 5):
        base = [_random_json(rng, depth + 1) for _ in range(rng.randrange(6))]
        shift = rng.randrange(-3, 4)
        return base + [x + shift * i if type(x) is int else x for i, x in enumerate(base)] * rng.randrange(3)
    if k == 6:
        return {"$t": [_random_json(rng, depth + 1) for _ in range(rng.randrange(5))]}
    return {rng.choice(["a", "b", "$c", "$A", "$R"]): _random_json(rng, depth + 1) for _ in range(rng.randrange(3))}


def test_program_part_compact_json_seeded_samples_round_trip() -> None:
    import random

    rng = random.Random(49)
    for _ in range(400):
        v = [_random_json(rng) for _ in range(rng.randrange(1, 8))]
        runs = [(rng.randrange(-5, 50), rng.randrange(-4, 5), rng.randrange(1, 9)) for _ in range(rng.randrange(4))]
        ints = [a + k * step for a, step, n in runs for k in range(n)]
        shifted = [[a + k * 3 for a in ints[:4] or [1, 2]] for k in range(6)]
        for value in (v, ints, shifted, [{"$t": s} for s in shifted], v * 3 + ints, {"k": v}):
            assert unpack_json(pack_json(value)) == value
    assert len(json.dumps(pack_json(list(range(0, 4000, 4))))) < 40
    assert len(json.dumps(pack_json([r for k in range(500) for r in (4 * k, 4 * k + 1)]))) < 40


def test_program_part_digest_is_read_from_the_key_the_launcher_fills() -> None:
    """``PartPayloads`` stores the digest of the very text it read a Program from under ``("digest",)`` of the
    Program's memo (not written again to be hashed); ``program_digest`` and every part read it from there."""
    from hspmd_sdk.core.specialize import Program

    prog = Program.from_json(_gpt("hetero_bsr").to_json())
    prog._micro[("digest",)] = "ab" * 32
    assert program_digest(prog) == "ab" * 32 and prog.part(1).program_digest == "ab" * 32


def test_program_part_of_a_rank_outside_every_pipeline() -> None:
    """A rank that takes part in operators but in no pipeline stage (here: rank 3 taken out of the stage map) gets
    empty pipelines, no micro-batches and no schedule."""
    import dataclasses

    prog = _gpt("hetero_bsr")
    cut = dataclasses.replace(prog, _where={k: v for k, v in prog._where.items() if k != 3}, _micro={})
    part = cut.part(3)
    assert part.pipelines == [[], []] and part.micro_batches == (0, 0) and part.micro_batch_sizes == (0, 0)
    assert part.schedules == {} and part._where == {}
    assert pp.make_part(prog, 1, ProgramPart).version == 0  # the default version


def test_program_part_restrict_keeps_the_ranks_own_zero_fill() -> None:
    """A point-to-point operator's zero fills (receivers of zeros) are restricted to the rank's own."""
    import dataclasses

    from hspmd_sdk.core.comm_ops import PointToPointOp

    prog = _gpt("hetero_bsr")
    plan = next(p for p in prog.comm_plans.values() if any(isinstance(o, PointToPointOp) for o in p.ops))
    ops = tuple(dataclasses.replace(o, zero_fill=(0, 2, 3)) if isinstance(o, PointToPointOp) else o
                for o in plan.ops)
    plan = dataclasses.replace(plan, ops=ops)
    for r, want in ((0, (0,)), (1, ()), (2, (2,)), (3, (3,))):
        got = pp.restrict_plan(plan, r)
        assert [o.zero_fill for o in got.ops if isinstance(o, PointToPointOp)] == \
            [want for o in plan.ops if isinstance(o, PointToPointOp)], r
