"""Writing every rank's Program part (issue 45): :class:`~hspmd_sdk.core.program_part.ProgramParts`, behind
:func:`~hspmd_sdk.core.program_part.part_json`, writes what the parts of a class of ranks share once for the class
and each rank only its own.  Its text must be byte for byte the general way's: the part made whole
(``Program.part``) and written object by object after the Program's shared records — the path every launcher
took before, written out here as the reference.  Checked for every rank of the programs the part tests use (DP,
TP, PP, TP x PP x DP, ZeRO-1, ZeRO-3, heterogeneous pipelines, the packaged examples, a growing data-parallel
grid), the tiny Llama TP2 job the control harness launches, and a sample of ranks of Llama-70B at 1,024 ranks
(the ``bench_scale`` strategy)."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from hspmd_sdk import Cluster, LlamaConfig, Strategy
from hspmd_sdk.core import program_part as pp
from hspmd_sdk.core.program_part import PART_FORMAT, ProgramPartError, ProgramParts, part_json
from hspmd_sdk.core.specialize import Program, ProgramPart, specialize
from hspmd_sdk.core.strategy_plan import plan_from_strategy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_program_part import GPT, _example, _gpt, _grid, _pipe, _program  # noqa: E402


def _reference(program: Program, rank: int, version: int = 0) -> str:
    """The part's JSON by the general way (``part_json`` before :class:`ProgramParts`): the whole part, its
    records after the Program's shared ones, then the header and the root."""
    part = program.part(rank, version=version)
    objects, root = pp._section_text(pp._shared_section(program), part)
    head = json.dumps({"format": PART_FORMAT, "rank": part.rank, "digest": part.program_digest,
                       "version": part.version}, separators=(",", ":"))[:-1]
    return head + ',"objects":[' + objects + '],"root":' + json.dumps(root, separators=(",", ":")) + "}"


def _same_for(program: Program, ranks: Any, version: int = 0) -> ProgramParts:
    writer = ProgramParts(program)
    for r in ranks:
        got = writer.json(r, version=version)
        want = _reference(program, r, version)
        assert got == want, f"rank {r}: the part's text differs from the general way's at character " \
                            f"{next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"
    assert writer.fallbacks == 0  # every class was written by the fast way (its check passed)
    return writer


def _zero3() -> Program:
    pipes = [_pipe([([2 * d], [0, 1]), ([2 * d + 1], [2, 3])], 1, 2 + d) for d in range(2)]
    return _program(GPT, Strategy.load({"pipelines": pipes, "zero": 3, "schedule": "gpipe"}), Cluster.local(4))


def _tiny_llama_tp2(world: int) -> Program:
    """The control harness's job: Llama ``tiny``, TP2 pipelines of one stage (benchmarks/bench_control.py)."""
    model = LlamaConfig.preset("tiny")
    pipes = [_pipe([([2 * d, 2 * d + 1], [0, model.num_layers - 1])], 1, 1) for d in range(world // 2)]
    return _program(model, Strategy.load({"pipelines": pipes}), Cluster.local(world))


@pytest.mark.parametrize("name", ["dp4", "tp4", "pp4", "tp2xpp2xdp2", "dp4_zero1", "hetero_bsr"])
def test_every_ranks_part_text_is_the_general_ways(name: str) -> None:
    prog = _gpt(name)
    _same_for(prog, prog.ranks)
    _same_for(prog, prog.ranks[::-1], version=7)  # classes met in another order, another version


@pytest.mark.parametrize("name", ["example_hetero_tiny.json", "table11_c2.json"])
def test_every_ranks_part_text_of_a_packaged_example_is_the_general_ways(name: str) -> None:
    prog = _example(name)
    _same_for(prog, prog.ranks)


def test_part_text_at_zero3_and_of_the_control_harness_job() -> None:
    prog = _zero3()
    _same_for(prog, prog.ranks)
    prog = _tiny_llama_tp2(16)
    _same_for(prog, prog.ranks)


def test_a_growing_grid_is_written_by_a_fixed_number_of_classes() -> None:
    """TP2 x PP2 pipelines, data parallelism from 16 to 256 ranks: the parts of every rank are the general way's,
    and the number of classes (parts made whole and written by the general way) does not grow with the world."""
    classes = []
    for world in (16, 64, 256):
        prog = _program(GPT, _grid(world), Cluster.local(world))
        ranks = prog.ranks if world < 256 else prog.ranks[:8] + prog.ranks[-8:] + prog.ranks[120:136]
        classes.append(len(_same_for(prog, ranks)._classes))
    assert classes[0] == classes[1] == classes[2] == 2  # one per stage


def test_llama_70b_at_1024_ranks_sample() -> None:
    """The ``bench_scale`` strategy of Llama-70B at 1,024 mixed ranks: a seeded sample of ranks plus the first and
    last of each pipeline."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from bench_scale import MODEL, scale_strategy

    strategy, cluster = scale_strategy(1024)
    prog = specialize(MODEL, plan_from_strategy(MODEL, strategy, cluster), cluster)
    ends = {r for p in prog.pipelines[:7] for r in (p[0][0], p[-1][-1])}
    sample = sorted(ends | set(random.Random(45).sample(prog.ranks, 12)))
    _same_for(prog, sample)


def test_part_json_uses_one_writer_per_program_and_refuses_a_rank_outside() -> None:
    prog = _gpt("hetero_bsr")
    texts = [part_json(prog, r, version=2) for r in prog.ranks]
    writer = prog._micro[("part_writer",)]
    assert isinstance(writer, ProgramParts) and texts == [_reference(prog, r, 2) for r in prog.ranks]
    assert [ProgramPart.from_json(t) for t in texts] == [prog.part(r, version=2) for r in prog.ranks]
    with pytest.raises(ProgramPartError, match="rank 99 takes part in no operator"):
        part_json(prog, 99)


def test_a_class_whose_check_fails_is_written_by_the_general_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first part of each class is checked against the general way; a class that fails is written by it."""
    prog = _gpt("tp2xpp2xdp2")
    monkeypatch.setattr(ProgramParts, "_text", lambda self, cls, rank, version: "not the part")
    writer = ProgramParts(prog)
    assert [writer.json(r) for r in prog.ranks] == [_reference(prog, r) for r in prog.ranks]
    assert writer.fallbacks == len(writer._classes) > 0


def test_a_switch_plans_parts_by_index_are_its_parts() -> None:
    """``SwitchPlan.part(rank, index=switch_index(plan))`` (what ``PlanParts`` writes) is ``plan.part(rank)`` for
    every rank: the control harness's switch (TP2 to PP2 pipelines on the same pairs) and a recovery's (rank 7
    lost, PP2 pipelines on the first three pairs)."""
    from hspmd_sdk.core.program_part import PlanParts, switch_index
    from hspmd_sdk.core.reconfigure import plan_program_switch
    from hspmd_sdk.runtime.protocol import unpack_payload

    model = LlamaConfig.preset("tiny")
    tp2 = _tiny_llama_tp2(8)
    pp2 = _program(model, Strategy.load({"pipelines": [_pipe([([2 * d], [0, 1]), ([2 * d + 1], [2, 3])], 1, 1)
                                                       for d in range(4)]}), Cluster.local(8))
    three = _program(model, Strategy.load({"pipelines": [_pipe([([2 * d], [0, 1]), ([2 * d + 1], [2, 3])], 1, 1)
                                                          for d in range(3)]}), Cluster.local(8))
    for plan in (plan_program_switch(tp2, pp2), plan_program_switch(tp2, three, failed=[7])):
        index, parts = switch_index(plan), PlanParts(plan)
        for r in range(8):
            assert plan.part(r, index=index) == plan.part(r)
            assert unpack_payload(parts.json(r)) == plan.part(r)
