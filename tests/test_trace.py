"""Measured timelines (issue 27, item 3): ``launch(..., profile=[s])`` records step ``s`` with the torch profiler on
every rank; ``job.trace()`` merges the ranks into one Chrome/Perfetto trace; ``job.timeline()`` puts each rank's
measured phases beside the simulator's prediction for the same Program.

References: the same job run without profiling (the losses must be bit-identical: recording changes nothing), the
Program's own schedule and communication plans (which actions and operators each rank must show), and the
simulator's timeline (the same forward/backward micro-batches, in the same order, on every rank)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hspmd_sdk import Cluster, LlamaConfig, Strategy, specialize  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.errors import PlanValidationError  # noqa: E402
from hspmd_sdk.runtime import launch  # noqa: E402
from hspmd_sdk.runtime.workers.executor import program_comm_plans  # noqa: E402
from hspmd_sdk.runtime.trace import merge, measured_phases, phase_of, phase_totals  # noqa: E402

#: a TP2 stage (ranks 0, 1) then a stage on rank 2: tensor-parallel collectives and stage-boundary messages
PP_TP = {"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, 1]}, {"devices": [2], "layers": [2, 3]}],
                        "micro_batch_size": 2, "num_micro_batches": 2}]}
STEPS, SEQ, RECORDED = 3, 16, 1


# ---- pure ---------------------------------------------------------------------------------------------------------
def test_spans_map_to_the_simulators_phases() -> None:
    assert [phase_of(f"hspmd:{n}") for n in ("F mb0", "B mb3", "SEND_F mb1", "RECV_B mb0", "PRE", "sync",
                                             "optim")] == ["F", "B", "comm", "comm", "comm", "sync", "optim"]
    # the step, POST (counted by its parts) and operators inside an action are not phases of their own
    assert [phase_of(n) for n in ("hspmd:step 3", "hspmd:POST", "hspmd:comm BSR", "c10d::allreduce_")] == [None] * 4


def test_merge_gives_a_track_per_rank_from_the_earliest_span() -> None:
    spans = {0: {1: [{"name": "hspmd:step 1", "ts": 1000.0, "dur": 50.0, "tid": 7},
                     {"name": "hspmd:F mb0", "ts": 1001.0, "dur": 10.0, "tid": 7},
                     {"name": "hspmd:comm AllReduce", "ts": 1003.0, "dur": 2.0, "tid": 7}]},
             3: {1: [{"name": "gloo:send", "ts": 990.0, "dur": 4.0, "tid": 9}]}}
    trace = merge(spans, {0: "rank 0 (a)", 3: "rank 3 (b)"})
    meta = {(e["pid"], e["name"]): e["args"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert meta[(0, "process_name")] == {"name": "rank 0 (a)"} and meta[(3, "process_name")] == {"name": "rank 3 (b)"}
    xs = {(e["pid"], e["name"]): e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert xs[(3, "gloo:send")]["ts"] == 0.0 and xs[(0, "step 1")]["ts"] == 10.0  # from the earliest span
    assert xs[(0, "comm AllReduce")]["cat"] == "comm" and xs[(3, "gloo:send")]["cat"] == "comm"
    assert xs[(0, "F mb0")]["cat"] == "hspmd" and xs[(0, "F mb0")]["dur"] == 10.0


def test_measured_phases_are_relative_to_the_step_and_summed_per_phase() -> None:
    spans = [{"name": "hspmd:step 2", "ts": 5e6, "dur": 4e5, "tid": 1},
             {"name": "hspmd:F mb0", "ts": 5e6 + 1e5, "dur": 1e5, "tid": 1},
             {"name": "hspmd:comm AllReduce", "ts": 5e6 + 1.5e5, "dur": 1e4, "tid": 1},
             {"name": "hspmd:B mb0", "ts": 5e6 + 2e5, "dur": 1.5e5, "tid": 1},
             {"name": "hspmd:POST", "ts": 5e6 + 3.5e5, "dur": 5e4, "tid": 1},
             {"name": "hspmd:sync", "ts": 5e6 + 3.5e5, "dur": 2e4, "tid": 1}]
    phases = measured_phases(spans)
    assert [(p, round(a, 6), round(b, 6)) for p, a, b, _ in phases] == [("F", 0.1, 0.2), ("B", 0.2, 0.35),
                                                                         ("sync", 0.35, 0.37)]
    totals = phase_totals(phases)
    assert totals["F"] == pytest.approx(0.1) and totals["comm"] == 0.0 and totals["optim"] == 0.0


@pytest.mark.parametrize("bad", [3, -1, [0, 7], "1", [True], 1.5])
def test_a_step_outside_the_run_is_refused_before_any_worker(bad) -> None:
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(1)
    prog = specialize(model, plan_from_strategy(model, Strategy.load(
        {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 3]}], "micro_batch_size": 1,
                        "num_micro_batches": 1}]}), cluster), cluster)
    with pytest.raises(PlanValidationError, match="profile"):
        launch(prog, cluster, steps=3, seq_len=SEQ, profile=bad, progress=False)


# ---- one profiled job --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory):
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(3)
    strategy = Strategy.load(PP_TP)
    prog = specialize(model, plan_from_strategy(model, strategy, cluster), cluster)
    runs = {}
    for name, profile in (("plain", None), ("profiled", [RECORDED])):
        job = launch(prog, cluster, steps=STEPS, seq_len=SEQ, profile=profile, progress=False,
                     log_dir=tmp_path_factory.mktemp(name))
        runs[name] = (job, job.wait(timeout=120))
    return model, cluster, strategy, prog, runs


@pytest.mark.timeout(180)
def test_recording_a_step_changes_no_loss(profiled) -> None:
    *_, runs = profiled
    assert runs["profiled"][1].losses == runs["plain"][1].losses  # bit for bit


@pytest.mark.timeout(180)
def test_the_merged_trace_has_a_track_per_rank_with_the_plans_actions_and_communication(profiled) -> None:
    _, _, _, prog, runs = profiled
    job = runs["profiled"][0]
    path = job.trace()
    assert path == job.log_dir / "trace.json"
    trace = json.loads(Path(path).read_text())
    tracks = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert sorted(tracks) == [0, 1, 2] and all(name.startswith(f"rank {r}") for r, name in tracks.items())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert all(e["dur"] >= 0 for e in spans) and min(e["ts"] for e in spans) == 0.0
    for r in (0, 1, 2):
        names = [e["name"] for e in spans if e["pid"] == r]
        # every action of the rank's schedule, named as the Program names it, with a positive duration
        want = {a.kind if a.micro_batch is None else f"{a.kind} mb{a.micro_batch}" for a in prog.schedule(r)}
        got = {e["name"] for e in spans if e["pid"] == r and e["dur"] > 0}
        assert want <= got, (r, want - got)
        assert f"step {RECORDED}" in names and "sync" in names and "optim" in names
    # the tensor-parallel stage's operators by their SPEC names, with the process group's collectives inside
    kinds = {k for plan in program_comm_plans(prog) for k in plan.kinds if k not in ("Identity",)}
    tp = {e["name"][len("comm "):] for e in spans if e["pid"] in (0, 1) and e["name"].startswith("comm ")
          and e["dur"] > 0}
    assert "AllReduce" in tp and tp <= kinds, (tp, kinds)
    assert any(e["name"].startswith(("c10d::", "gloo:")) and e["dur"] > 0 for e in spans if e["pid"] == 2)


@pytest.mark.timeout(180)
def test_the_timeline_puts_the_measured_step_beside_the_simulators(profiled) -> None:
    model, cluster, strategy, _, runs = profiled
    from hspmd_sdk.planner import simulate

    job = runs["profiled"][0]
    tl = job.timeline()
    assert tl.step == RECORDED and tl.why == "" and sorted(tl.measured) == [0, 1, 2]
    want = simulate(model, strategy, cluster, seq_len=SEQ)
    for r in (0, 1, 2):
        measured = [(p, int(label.split("mb")[1])) for p, _, _, label in tl.measured[r] if p in ("F", "B")]
        planned = [(e.kind, e.micro_batch) for e in want.timeline[r] if e.kind in ("F", "B")]
        assert measured == planned, r  # the same micro-batches, in the same order, as the prediction
        assert all(b > a >= 0 for _, a, b, _ in tl.measured[r])
    gaps = {(g["rank"], g["phase"]): g for g in tl.gaps}
    assert len(gaps) == 15 and all(g["predicted_s"] is not None for g in gaps.values())
    assert gaps[(0, "F")]["gap_s"] == pytest.approx(gaps[(0, "F")]["measured_s"] - gaps[(0, "F")]["predicted_s"])
    assert gaps[(2, "F")]["measured_s"] > 0 and gaps[(0, "sync")]["measured_s"] > 0
    fig = tl.figure()
    rows = {y for trace in fig.data for y in trace.y}
    assert rows == {f"{lbl} {side}" for lbl in tl.labels.values() for side in ("measured", "planned")}
    assert "R0" in tl.table() and "measured / predicted" in tl.table()
    with pytest.raises(ValueError, match=r"step 2 was not recorded; recorded steps: \[1\]"):
        job.timeline(step=2)
    with pytest.raises(ValueError, match="no step was recorded"):
        runs["plain"][0].timeline()
