"""What a worker receives (SPEC §16, issue 45 item 1): ``Program.part(rank)``.

* a part's JSON round-trips exactly, and its size does not grow with the world for a fixed model and stage shape
  (TP2 x PP2 stages, data parallelism growing from 64 to 1,024 ranks), while the whole Program's does;
* for every rank of several programs (DP, TP, PP, TP x PP x DP, ZeRO-1, the packaged heterogeneous examples) the
  part answers what the whole Program answers for that rank — judged by what the runtime reads of it (each
  communication operator's group, slices, messages and boxes of that rank; the runtime's own ``comm_groups``
  of the whole Program; the pipeline pairs against the strategy's stages) — and refuses, naming both ranks, to answer for another;
* workers launched with their parts (the local launch sends each rank its own) train equal to the single-device
  model.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from hspmd_sdk import Cluster, GPTConfig, LlamaConfig, Strategy
from hspmd_sdk.core.comm_ops import CollectiveOp, PointToPointOp, SplitCollectiveOp
from hspmd_sdk.core.program_part import PART_FORMAT, ProgramPartError, pack_json, part_json, unpack_json
from hspmd_sdk.core.specialize import Program, ProgramPart, specialize
from hspmd_sdk.core.strategy_plan import plan_from_strategy

EXAMPLES = Path(__file__).resolve().parent.parent / "hspmd_sdk" / "examples"
GPT = GPTConfig.preset("tiny")


def _pipe(stages: list[tuple[list[int], list[int]]], mbs: int, n: int) -> dict[str, Any]:
    return {"stages": [{"devices": d, "layers": l} for d, l in stages], "micro_batch_size": mbs,
            "num_micro_batches": n}


def _grid(world: int, *, zero1: bool = False) -> Strategy:
    """TP2 x PP2 stages (two layers each), ``world // 4`` data-parallel pipelines."""
    pipes = [_pipe([([4 * d, 4 * d + 1], [0, 1]), ([4 * d + 2, 4 * d + 3], [2, 3])], 1, 2) for d in range(world // 4)]
    return Strategy.load({"pipelines": pipes, "schedule": "1f1b", "zero1": zero1})


def _program(model: Any, strategy: Strategy, cluster: Cluster) -> Program:
    return specialize(model, plan_from_strategy(model, strategy, cluster), cluster)


def _example(name: str) -> Program:
    index = json.loads((EXAMPLES / "index.json").read_text())["strategies"][name]
    model = LlamaConfig.preset(index["model"])
    cluster = Cluster.load(json.loads((EXAMPLES / index["cluster"]).read_text()))
    strategy = Strategy.load(json.loads((EXAMPLES / name).read_text()))
    return specialize(model, plan_from_strategy(model, strategy, cluster), cluster,
                      bindings={"B": index["global_batch"], "S": model.max_seq_len})


def _gpt(name: str) -> Program:
    one = [([0, 1, 2, 3], [0, 3])]
    strategies = {
        "dp4": [_pipe([([r], [0, 3])], 2, 1) for r in range(4)],
        "tp4": [_pipe(one, 2, 2)],
        "pp4": [_pipe([([r], [r, r]) for r in range(4)], 1, 4)],
        "hetero_bsr": [_pipe([([0, 1], [0, 1]), ([2], [2, 3])], 2, 3), _pipe([([3], [0, 3])], 2, 1)],
    }
    if name == "tp2xpp2xdp2":
        return _program(GPT, _grid(8), Cluster.local(8))
    if name == "dp4_zero1":
        return _program(GPT, Strategy.load({"pipelines": strategies["dp4"], "zero1": True}), Cluster.local(4))
    return _program(GPT, Strategy.load({"pipelines": strategies[name]}), Cluster.local(4))


# ---- what the runtime reads of a communication operator, on one rank (runtime/workers/comm.py) ------------------
def _read_by(op: Any, rank: int) -> Any:
    """The part of ``op`` that rank ``rank``'s executor reads: its collective group; its slice collectives in
    order; its messages with their indices (their tags) and its copies; its boxes.  Written from the executor's
    code, independently of the restriction."""
    if isinstance(op, CollectiveOp):
        return op.kind, op.itemsize, op.dim, op.src_dim, next((g for g in op.groups if rank in g.ranks), None)
    if isinstance(op, SplitCollectiveOp):
        return (op.kind, op.src_hdim, op.dst_hdim, op.itemsize, [s for s in op.slices if rank in s.ranks],
                dict(op.in_boxes).get(rank), dict(op.out_boxes).get(rank))
    if isinstance(op, PointToPointOp):
        return (op.kind, len(op.messages), [(i, m) for i, m in enumerate(op.messages) if rank in (m.src, m.dst)],
                [c for c in op.copies if c[0] == rank], dict(op.in_boxes).get(rank), dict(op.out_boxes).get(rank),
                rank in op.zero_fill)
    return op


def _plan_read_by(plan: Any, rank: int) -> Any:
    return (plan.src, plan.dst, plan.shape, plan.dtype, plan.itemsize, [_read_by(o, rank) for o in plan.ops])


def _ops_read_by(eg: Any, rank: int) -> list[Any]:
    return [(o.name, o.kind, o.phase, o.inputs, o.outputs, o.comm_kinds, o.bytes_sent,
             None if o.comm is None else _plan_read_by(o.comm, rank)) for o in eg.ops]


def _check_rank(prog: Program, part: ProgramPart, r: int) -> None:
    from hspmd_sdk.runtime.workers.comm import comm_groups
    from hspmd_sdk.runtime.workers.executor import program_comm_plans

    whole, mine = prog.executable_graph(r), part.executable_graph(r)
    assert (mine.rank, mine.pipeline, mine.stage, mine.leaves, mine.parameters) == \
        (whole.rank, whole.pipeline, whole.stage, whole.leaves, whole.parameters)
    assert [len(mine.phase(p)) for p in ("Pre", "F", "B", "Post")] == \
        [len(whole.phase(p)) for p in ("Pre", "F", "B", "Post")]
    assert _ops_read_by(mine, r) == _ops_read_by(whole, r)
    assert part.annotations == prog.annotations and part.state_layouts() == prog.state_layouts()
    assert part.graph == prog.graph and part.model == prog.model and part.bindings == prog.bindings
    assert part.digest() == prog.digest() and part.world_ranks == len(prog.ranks)
    # the process groups every rank creates, by the runtime's own functions over the whole Program
    assert comm_groups(program_comm_plans(part)) == [g for g in comm_groups(program_comm_plans(prog)) if r in g]
    assert list(part.world_groups) == comm_groups(program_comm_plans(prog))
    for t in whole.leaves:
        if prog.annotations[t].locate(r) is not None:
            assert part.local_shape(t, r, prog.bindings) == prog.local_shape(t, r, prog.bindings), t
    if whole.pipeline is None:
        assert r not in part.ranks
        return
    p = whole.pipeline
    assert part.ranks == [r] and part.stage_of(r) == prog.stage_of(r) and part.schedule(r) == prog.schedule(r)
    assert (part.num_stages(p), part.num_micro_batches(p), part.micro_batch_size(p)) == \
        (prog.num_stages(p), prog.num_micro_batches(p), prog.micro_batch_size(p))
    assert part.stage_ranks(p, whole.stage) == prog.stage_ranks(p, whole.stage)
    assert (r in part.recompute) == (r in prog.recompute)
    assert part.batch_rows(r, prog.bindings) == prog.batch_rows(r, prog.bindings)
    micro = prog.micro_batch_size(p) or 1
    for o in whole.forward + whole.backward:
        if o.comm is not None and o.name in prog._plan_keys:
            assert _plan_read_by(part.micro_batch_plan(o.name, r, prog.bindings, micro), r) == \
                _plan_read_by(prog.micro_batch_plan(o.name, r, prog.bindings, micro), r), o.name


# ---- round trip ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tp2xpp2xdp2", "hetero_bsr", "dp4_zero1"])
def test_a_part_round_trips_exactly(name: str) -> None:
    prog = _gpt(name)
    for r in prog.ranks:
        part = prog.part(r)
        text = part.to_json()
        back = ProgramPart.from_json(text)
        assert back == part and back.to_json() == text
        assert back.executable_graph(r) == part.executable_graph(r) and back.schedule(r) == part.schedule(r)
        assert back.world_groups == part.world_groups and back.world_pipeline_pairs == part.world_pipeline_pairs
        assert json.loads(text)["format"] == PART_FORMAT
        # the launcher's writer: what every part holds alike written once per Program, the same part read back
        launched = part_json(prog, r)
        assert ProgramPart.from_json(launched) == part and abs(len(launched) - len(text)) < 0.01 * len(text)


def test_a_damaged_or_foreign_text_is_refused_naming_what() -> None:
    prog = _gpt("hetero_bsr")
    with pytest.raises(ProgramPartError, match="not a Program part's JSON of format"):
        ProgramPart.from_json(prog.to_json())
    with pytest.raises(ProgramPartError, match="not a Program part's JSON"):
        ProgramPart.from_json("{")
    data = json.loads(prog.part(1).to_json())
    data["rank"] = 2
    with pytest.raises(ProgramPartError, match="header says rank 2 .* body rank 1"):
        ProgramPart.from_json(json.dumps(data))


# ---- size ------------------------------------------------------------------------------------------------------
def test_a_parts_size_does_not_grow_with_the_world() -> None:
    """TP2 x PP2 stages of GPT tiny, 16 to 256 data-parallel pipelines: the launch message of a rank of the same
    stage is within 5% at 64, 256 and 1,024 ranks (measured: 181 KB at each; the whole Program grows from
    0.4 to 3.5 MB)."""
    begun = time.perf_counter()
    sizes: dict[int, dict[str, int]] = {}
    whole: dict[int, int] = {}
    for world in (64, 256, 1024):
        prog = _program(GPT, _grid(world), Cluster.local(world))
        whole[world] = len(prog.to_json())
        # the first and last rank of a first stage, a last stage's rank, the last rank of the world
        picks = {"first stage, TP rank 0": 0, "first stage, TP rank 1": 1, "last stage": 2, "last rank": world - 1}
        sizes[world] = {k: len(prog.part(r).to_json()) for k, r in picks.items()}
    for k, base in sizes[64].items():
        for world in (256, 1024):
            assert abs(sizes[world][k] - base) <= 0.05 * base, (k, sizes)
    assert whole[1024] > 4 * whole[64] and max(sizes[1024].values()) < whole[1024] / 10, (whole, sizes)
    assert time.perf_counter() - begun < 60


def test_a_launched_part_writes_no_layout_of_the_world_again() -> None:
    """Every annotation a part holds lists the whole world's device groups: ``part_json`` writes them once per
    Program with the records every part shares -- the tensors', the plans' ends and the micro-batch plans' keys --
    so that no rank's part pays O(world) to write them again (measured at 1,024 ranks: 43 ms a part with the keys'
    annotations written per rank, 26 ms shared).  The records a part writes of its own are the same kinds and
    count at 64 and 256 ranks."""
    from hspmd_sdk.core.annotation import Annotation

    own = {}
    for world in (64, 256):
        prog = _program(GPT, _grid(world), Cluster.local(world))
        records = unpack_json(json.loads(part_json(prog, 1))["objects"])
        count, _, _, kept = prog._micro[("part_shared",)]
        shared = {id(o) for o in kept}
        layouts = [a for key in prog._plan_keys.values() for a in key if isinstance(a, Annotation)]
        assert layouts and all(id(a) in shared for a in layouts), world
        own[world] = sorted(r.get("$model") or r.get("$c") or "plain" for r in records[count:])
    assert own[64] == own[256]


# ---- the part answers for its rank what the whole answers ---------------------------------------------------------
@pytest.mark.parametrize("name", ["dp4", "tp4", "pp4", "tp2xpp2xdp2", "dp4_zero1", "hetero_bsr"])
def test_every_ranks_part_answers_like_the_whole_program(name: str) -> None:
    prog = _gpt(name)
    for r in range(8 if name == "tp2xpp2xdp2" else 4):
        _check_rank(prog, prog.part(r), r)


@pytest.mark.parametrize("name", ["example_hetero_tiny.json", "table11_c2.json"])
def test_every_ranks_part_of_a_packaged_example_answers_like_the_whole_program(name: str) -> None:
    prog = _example(name)
    for r in prog.ranks:  # the first and last rank as the worker reads its part (JSON), every rank in memory
        part = ProgramPart.from_json(prog.part(r).to_json()) if r in (prog.ranks[0], prog.ranks[-1]) else \
            prog.part(r)
        _check_rank(prog, part, r)


#: the stages of each program's pipelines, from its strategy (``_gpt``, ``_grid``)
STAGES = {"pp4": [[[0], [1], [2], [3]]], "tp2xpp2xdp2": [[[0, 1], [2, 3]], [[4, 5], [6, 7]]],
          "hetero_bsr": [[[0, 1], [2]], [[3]]]}


def test_the_world_pipeline_pairs_join_adjacent_stages() -> None:
    """Every rank's part carries the same pairs (the runtime makes its point-to-point groups from them); judged by
    the strategy alone: each pair joins two adjacent stages of one pipeline, and every stage boundary has a pair
    in each direction (0: activations, 1: gradients).  A pipeline of one rank per stage has exactly its
    neighbours."""
    for name, pipes in STAGES.items():
        prog = _gpt(name)
        pairs = set(prog.part(prog.ranks[0]).world_pipeline_pairs)
        assert all(set(prog.part(r).world_pipeline_pairs) == pairs for r in prog.ranks), name
        boundaries = [(set(a), set(b)) for stages in pipes for a, b in zip(stages, stages[1:])]
        for d, lo, hi in pairs:
            assert d in (0, 1) and lo < hi and any(lo in a and hi in b for a, b in boundaries), (name, d, lo, hi)
        for a, b in boundaries:
            for direction in (0, 1):
                assert any(d == direction and lo in a and hi in b for d, lo, hi in pairs), (name, a, b, direction)
    assert set(_gpt("pp4").part(0).world_pipeline_pairs) == {(d, r, r + 1) for d in (0, 1) for r in range(3)}


def test_a_part_refuses_other_ranks_naming_both() -> None:
    prog = _gpt("tp2xpp2xdp2")
    part = prog.part(5)
    for call in (lambda: part.executable_graph(4), lambda: part.schedule(4), lambda: part.stage_of(4),
                 lambda: part.batch_rows(4, prog.bindings), lambda: part.local_shape("tokens", 4), lambda: part.part(4),
                 lambda: part.micro_batch_plan("embed.out", 4, prog.bindings, 1)):
        with pytest.raises(ProgramPartError, match="rank 5's part of Program .*; rank 4 is not in it"):
            call()
    assert part.part(5) is part and part.part(5, version=3).version == 3
    with pytest.raises(ProgramPartError, match="rank 9 takes part in no operator"):
        prog.part(9)


# ---- the compact JSON ------------------------------------------------------------------------------------------------
_json = st.recursive(st.one_of(st.integers(-50, 50), st.booleans(), st.none(), st.text(max_size=3)),
                     lambda inner: st.one_of(st.lists(inner, max_size=12),
                                             st.lists(inner, max_size=12).map(lambda v: {"$t": v}),
                                             st.dictionaries(st.text(max_size=3), inner, max_size=3)),
                     max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(value=_json, runs=st.lists(st.tuples(st.integers(-5, 50), st.integers(-4, 4), st.integers(1, 9)),
                                  max_size=4))
def test_compact_json_is_undone_exactly(value: Any, runs: list[tuple[int, int, int]]) -> None:
    """Arbitrary JSON values, and lists made of arithmetic runs, periodic blocks and shifted lists."""
    ints = [a + k * step for a, step, n in runs for k in range(n)]
    periodic = [b + k * 7 for k in range(5) for b in (ints[:3] or [0, 1])]
    shifted = [[a + k * 3 for a in ints[:4] or [1, 2]] for k in range(6)]
    for v in (value, ints, periodic, shifted, [{"$t": s} for s in shifted], [value] * 4 + ints):
        assert unpack_json(pack_json(v)) == v
    assert len(json.dumps(pack_json(list(range(0, 4000, 4))))) < 40
    # values that read as runs (hypothesis found {"$A": ""}): kept as they are
    for v in ([{"$A": ""}], [{"$P": [1]}, 3, {"$L": None}], [{"$R": [1, 2]}] * 3, [[{"$A": [0, 1, 5]}]]):
        assert unpack_json(pack_json(v)) == v
    assert len(json.dumps(pack_json([r for k in range(500) for r in (4 * k, 4 * k + 1)]))) < 40


# ---- launched with parts, equal to the single device ------------------------------------------------------------
def test_workers_launched_with_their_parts_train_equal_to_the_single_device_model(tmp_path: Path) -> None:
    """A TP2 -> TP1 pipeline (a BSR boundary) beside a one-rank pipeline: each worker's launch line carries its
    own part (no whole Program), the workers build their groups from it, and the training equals the
    single-device reference (losses, gradients, parameters)."""
    from hspmd_sdk.runtime.control.train import launch, reference_training
    from hspmd_sdk.runtime.protocol import program_of_run

    from _equivalence import captured_close_to_reference

    prog, cluster = _gpt("hetero_bsr"), Cluster.local(4)
    job = launch(prog, cluster, steps=3, seq_len=16, seed=2, capture_dir=tmp_path)
    whole = len(job.spec.to_line())
    for r in range(4):
        line = job.spec.line_for(r)
        run = json.loads(line)["payload"]["runs"][0]
        assert run["program"] is None and len(line) < whole
        got = program_of_run(run)
        assert isinstance(got, ProgramPart) and got.rank == r and got.digest() == prog.digest()
    assert Program.from_json(job.spec.payload["runs"][0]["program"]) == prog  # the launcher keeps the whole
    result = job.wait()
    ref = reference_training(GPT, steps=3, seed=2, global_batch=8, seq_len=16)
    captured_close_to_reference(tmp_path, result.losses, GPT, ref, seed=2, steps=3, lr=1e-3)


def test_a_ranks_launch_line_is_the_same_size_at_64_256_and_1024_ranks() -> None:
    """The whole launch line a worker of an elastic training run reads (the spec with its run and its part, as
    ``LaunchSpec.line_for`` writes it), for a rank of the same stage shape (TP2 pipelines of Llama tiny, hosts of
    8): within 5% at 64, 256 and 1,024 ranks (the run's launcher-only keys and the spec's per-rank lists do not
    travel whole), and it reads back as the spec, with the rank's part."""
    from hspmd_sdk.runtime.control.runs import checked_training_run
    from hspmd_sdk.runtime.control.start import build_spec
    from hspmd_sdk.runtime.protocol import LAUNCHER_ONLY, PartPayloads, program_of_run
    from hspmd_sdk.runtime.spec import LaunchSpec

    model, sizes = LlamaConfig.preset("tiny"), {}
    for world in (64, 256, 1024):
        cluster = Cluster.mixed({"H800": world // 2, "H20": world // 2})
        pipes = [_pipe([([2 * i, 2 * i + 1], [0, 3])], 1, 1) for i in range(world // 2)]
        program = specialize(model, plan_from_strategy(model, Strategy.load({"pipelines": pipes}), cluster), cluster,
                             bindings={"B": world // 2, "S": 16})
        run = {**checked_training_run(program, steps=3, cluster=cluster, seq_len=16), "elastic": True}
        spec = build_spec(cluster, entry="hspmd_sdk.runtime.workers.worker_entry:train_entry", steps=3,
                          payload={"runs": [run]}, local=False)
        spec = spec.with_rank_payload(PartPayloads.of(spec.payload))
        line = spec.line_for(5)
        back = LaunchSpec.from_line(line)
        assert (back.hosts, back.devices, back.ranks) == (spec.hosts, spec.devices, spec.ranks)
        assert back.hosts[8] == "node1" and back.devices[-1] == "H20"
        got = back.payload["runs"][0]
        assert not set(LAUNCHER_ONLY) & set(got) and program_of_run(got).rank == 5
        sizes[world] = len(line)
    assert max(sizes.values()) <= 1.05 * min(sizes.values()), sizes


def test_runs_whose_features_need_the_whole_program_send_it_whole() -> None:
    from hspmd_sdk.runtime.protocol import PartPayloads, sends_parts

    plain = {"program": "{}", "steps": 1}
    assert sends_parts(plain) and PartPayloads.of({"runs": [plain]}) is not None
    for key, value in (("checkpoint", {"dir": "x"}), ("resume", {"dir": "x"}), ("mixed", {"kind": "mixed"})):
        assert not sends_parts({**plain, key: value}), key
        assert PartPayloads.of({"runs": [{**plain, key: value}]}) is None
    # an elastic run's recoveries and grows send parts too (the launcher re-plans from the versions it keeps)
    assert sends_parts({**plain, "elastic": True})
    assert PartPayloads.of({"program": "{}"}) is None  # an entry's own payload: untouched


# ---- a switch sends each worker its part ---------------------------------------------------------------------------
def _grid_b(world: int) -> Strategy:
    """:func:`_grid`'s stages with other layer cuts (one layer, then three)."""
    pipes = [_pipe([([4 * d, 4 * d + 1], [0, 0]), ([4 * d + 2, 4 * d + 3], [1, 3])], 1, 2) for d in range(world // 4)]
    return Strategy.load({"pipelines": pipes, "schedule": "1f1b"})


def test_a_switch_message_of_a_rank_does_not_grow_with_the_world() -> None:
    """The switch from :func:`_grid` to :func:`_grid_b` (every layer moves between the stages): the message a rank
    of the same stage gets is within 5% at 64, 256 and 1,024 ranks (measured 235 KB on a first stage, 279 KB
    on a last one, at each; the whole message grows from 1.2 to 14.7 MB), and it reads back as that rank's part of the new Program and of the plan."""
    from hspmd_sdk.core.reconfigure import plan_program_switch
    from hspmd_sdk.runtime.protocol import switch_message, switch_of

    sizes: dict[int, dict[int, int]] = {}
    whole: dict[int, int] = {}
    for world in (64, 256, 1024):
        cluster = Cluster.local(world)
        a, b = _program(GPT, _grid(world), cluster), _program(GPT, _grid_b(world), cluster)
        plan = plan_program_switch(a, b, cluster)
        whole[world] = len(json.dumps(switch_message(7, b, plan)))
        sizes[world] = {}
        for r in (0, 1, 2, world - 1):
            msg = json.loads(json.dumps(switch_message(7, b, plan, r)))
            sizes[world][r if r < 3 else -1] = len(json.dumps(msg))
            assert msg["type"] == "switch" and msg["id"] == 7 and "payload" not in msg
            if world == 64:
                part, plan_part = switch_of(msg)
                assert isinstance(part, ProgramPart) and part.rank == r and part.digest() == b.digest()
                assert part.version == 7 and plan_part == plan.part(r)
    for k, base in sizes[64].items():
        for world in (256, 1024):
            assert abs(sizes[world][k] - base) <= 0.05 * base, (k, sizes)
    assert whole[1024] > 4 * whole[64] and max(sizes[1024].values()) < whole[1024] / 10, (whole, sizes)


def test_a_plans_parts_keep_every_message_once_with_its_tag() -> None:
    """The parts of a switch plan over all ranks hold every message of each step twice (its sender's part and its
    receiver's), each time with its index in the whole step as its tag (both ends must use the same), every local
    copy and zero fill once; a rank's part holds nothing of other ranks'."""
    from hspmd_sdk.core.reconfigure import plan_program_switch

    a, b = _gpt("hetero_bsr"), _gpt("tp4")
    plan = plan_program_switch(a, b, Cluster.local(4))
    parts = {r: plan.part(r) for r in range(4)}
    for k, step in enumerate(plan.steps):
        assert step.messages and all(m.tag is None for m in step.messages)
        seen: dict[int, list[int]] = {}
        for r, part in parts.items():
            for m in part.steps[k].messages:
                assert r in (m.src, m.dst) and dataclasses.replace(m, tag=None) == step.messages[m.tag]
                seen.setdefault(m.tag, []).append(r)
            assert all(c[1] == r for c in part.steps[k].copies) and all(z[1] == r for z in part.steps[k].zero_fill)
        assert {t: sorted(rs) for t, rs in seen.items()} == {i: sorted((m.src, m.dst))
                                                          for i, m in enumerate(step.messages)}
        assert sorted(c for p in parts.values() for c in p.steps[k].copies) == sorted(step.copies)
        assert sorted(z for p in parts.values() for z in p.steps[k].zero_fill) == sorted(step.zero_fill)
    assert all(p.tensors == plan.tensors and p.failed == plan.failed for p in parts.values())


def test_a_plans_parts_are_written_with_what_they_share_written_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PlanParts(plan).json(rank)`` (what a launcher sends each worker of a switch or recovery): read back by
    ``unpack_payload`` it is the rank's part, as ``pack_payload(plan.part(rank), compact=True)`` is; the tensors'
    layouts and the cluster, alike in every part, are written once per plan, whatever the number of parts."""
    import hspmd_sdk.core.program_part as pp
    from hspmd_sdk.core.reconfigure import plan_program_switch
    from hspmd_sdk.runtime.protocol import pack_payload, unpack_payload

    cluster = Cluster.local(8)
    model = GPTConfig.preset("tiny")
    plan = plan_program_switch(_program(model, _grid(8), cluster), _program(model, _grid_b(8), cluster), cluster)
    calls: list[int] = []
    real = pp._shared_records
    monkeypatch.setattr(pp, "_shared_records", lambda v: calls.append(1) or real(v))
    parts = pp.PlanParts(plan)
    assert calls == []  # written when the first part is asked for
    for r in range(8):
        text = parts.json(r)
        assert unpack_payload(text) == plan.part(r) == unpack_payload(pack_payload(plan.part(r), compact=True))
    assert calls == [1]
    other = plan_program_switch(_program(model, _grid_b(8), cluster), _program(model, _grid(8), cluster), cluster)
    assert unpack_payload(pp.PlanParts(other).json(3)) == other.part(3) and calls == [1, 1]  # its own records


def _record_control(job: Any) -> list[tuple[dict[str, Any], list[int]]]:
    """Every control message the launcher sends ``job``'s workers from now on, with the ranks it goes to."""
    sent: list[tuple[dict[str, Any], list[int]]] = []
    send = job._send_control

    def spy(msg: dict[str, Any], ranks: Any = None) -> None:
        sent.append((msg, list(ranks or [])))
        send(msg, ranks)

    job._send_control = spy
    return sent


def test_a_switched_job_sends_each_worker_its_part_and_trains_equal_to_the_single_device_model(
        tmp_path: Path) -> None:
    """A job launched with parts (hetero_bsr: a TP2 -> TP1 pipeline beside a one-rank pipeline) switches to DP4
    and back to hetero_bsr: every switch message a worker gets is its own part (none carries the whole), and the
    training equals the single-device reference (losses, gradients, parameters)."""
    from hspmd_sdk.runtime.control.train import launch, reference_training

    from test_switching import LR, SEED, SEQ, TOL, _close, _state_ok

    first, other, cluster = _gpt("hetero_bsr"), _gpt("dp4"), Cluster.local(4)
    job = launch(first, cluster, steps=5, seq_len=SEQ, seed=SEED, lr=LR, capture_dir=tmp_path, hold_at=[1, 3],
                 timeout_s=60)
    sent = _record_control(job)
    for step, program in ((1, other), (3, first)):
        job.wait_held(step)
        event = job.switch(program)
        job.wait_held(step, heard=event)
        job.release(step)
    result = job.wait(timeout=120)
    switches = [(m, rs) for m, rs in sent if m.get("type") == "switch"]
    assert len(switches) == 8 and all(len(rs) == 1 and "payload" not in m for m, rs in switches)
    assert all(ProgramPart.from_json(m["program_part"]).rank == rs[0] for m, rs in switches)
    assert [e.done for e in result.events] == [True, True]
    ref = reference_training(GPT, steps=5, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR)
    assert _close(result.losses, ref.losses) <= TOL, (result.losses, ref.losses)
    _state_ok(tmp_path, GPT, ref)  # parameters and both Adam moments


def test_an_elastic_job_recovers_by_parts_and_trains_equal_to_the_single_device_model(tmp_path: Path) -> None:
    """An elastic job launched with parts (hetero_bsr) loses rank 3 (SIGKILL, every worker held at step 2): the
    reconfigure message each survivor gets carries its own part of the new Program (by its new rank) and of the
    switch plan (none carries the whole), and the training equals the single-device reference (losses,
    parameters and both Adam moments)."""
    import os
    import signal

    from hspmd_sdk.runtime.control.train import launch, reference_training

    from test_switching import LR, SEED, SEQ, TOL, _close, _state_ok

    cluster = Cluster.local(4)
    job = launch(_gpt("hetero_bsr"), cluster, steps=5, seq_len=SEQ, seed=SEED, lr=LR, capture_dir=tmp_path,
                 hold_at=[2], elastic=True, timeout_s=60, heartbeat_s=0.5)
    assert json.loads(job.spec.line_for(0))["payload"]["runs"][0]["program"] is None  # launched with parts
    sent = _record_control(job)
    job.wait_held(2)
    os.kill(job.pids()[3], signal.SIGKILL)
    job.release(2)
    result = job.wait(timeout=120)
    [event] = result.events
    assert event.reason == "failure" and event.failed_ranks == [3] and event.done
    recon = [(m, rs) for m, rs in sent if m.get("type") == "reconfigure"]
    assert sorted(rs[0] for _, rs in recon) == [0, 1, 2] and all(len(rs) == 1 for _, rs in recon)
    assert all("payload" not in m for m, _ in recon)
    assert all(ProgramPart.from_json(m["program_part"]).rank == m["ranks"][rs[0]] for m, rs in recon)
    ref = reference_training(GPT, steps=5, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR)
    assert _close(result.losses, ref.losses) <= TOL, (result.losses, ref.losses)
    _state_ok(tmp_path, GPT, ref)  # parameters and both Adam moments
