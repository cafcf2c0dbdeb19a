"""Elastic recovery with uneven TP stages (HAP ratios, SPEC §12; issue 28) against the single-device reference.

An uneven stage's ratios describe its devices, so ``replan_elastic`` keeps them on every TP group of the new plan
whose ranks all come from one uneven stage: an untouched stage keeps its own ratios, a shrunk one the survivors'
ratios moved to the nearest ones the model can split (none for one device or equal ratios).  A plan the two-tier
annotation cannot express with them (an uneven stage beside a pipeline splitting the same layer differently) is
planned even.  Checked here:

* the planner alone (pure): the ratios an untouched uneven stage keeps, the ones a shrunk stage gets, the even
  fallback, and that every replanned strategy validates against the model;
* real jobs (``elastic=True``, a worker SIGKILLed mid-step, gloo, fp32): a lost *even* stage beside an uneven one
  (the uneven stage survives with its 3:1 ratios; its lost partner's state comes back from the job's checkpoint in
  the same processes); a lost rank *of* an uneven pair in two uneven pipelines (recovered in memory from the
  replica, the survivors planned even); a TP3 2:1:1 stage shrunk to TP2 3:1 (GPT-2).  Every loss, and the final
  parameters and Adam moments, equal the single-device reference (``reference_training``, which never runs the
  SDK's planner or runtime), with the tolerances of tests/test_switching.py and tests/test_elastic_reload.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pulp")

from hspmd_sdk import Cluster, GPTConfig, LlamaConfig, Strategy, specialize  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.planner import replan_elastic  # noqa: E402
from _procs import assert_no_workers_left  # noqa: E402
from hspmd_sdk.runtime.control.train import launch, reference_training  # noqa: E402
from test_switching import LR, SEED, SEQ, STATE_TOL, TOL, _state_err  # noqa: E402  (its comparison, its settings)

STEPS = 4
FAMILIES = {"llama": LlamaConfig, "gpt": GPTConfig}


def _pipe(stages: list[tuple], mbs: int, n: int) -> dict:
    """``stages``: ``(devices, layers[, ratios])`` each."""
    return {"stages": [{"devices": s[0], "layers": s[1], **({"ratios": s[2]} if len(s) > 2 else {})}
                       for s in stages], "micro_batch_size": mbs, "num_micro_batches": n}


#: an uneven TP2 3:1 first stage beside an even TP1 last stage (3 ranks).  (An uneven pipeline beside an even
#: *pipeline* is refused by Strategy itself: the two-tier annotation cannot express it; tests/test_hap_ratios.py.)
PP2_UNEVEN_FIRST = {"pipelines": [_pipe([([0, 1], [0, 1], [3, 1]), ([2], [2, 3])], 2, 4)]}
#: two pipelines with the same uneven stage (4 ranks; no ZeRO-1: each is the other's replica)
DP2_UNEVEN = {"pipelines": [_pipe([([0, 1], [0, 3], [3, 1])], 2, 2), _pipe([([3, 2], [0, 3], [3, 1])], 2, 2)]}
#: one TP3 2:1:1 stage (3 ranks)
TP3_UNEVEN = {"pipelines": [_pipe([([0, 1, 2], [0, 3], [2, 1, 1])], 4, 2)]}
#: two pipelines, each an uneven first stage and an even last stage (6 ranks; planner tests only)
DP2_PP2_UNEVEN = {"pipelines": [_pipe([([0, 1], [0, 1], [3, 1]), ([2], [2, 3])], 1, 4),
                                _pipe([([3, 4], [0, 1], [3, 1]), ([5], [2, 3])], 1, 4)]}


def _stages(strategy: Strategy) -> list[tuple[list[int], list[int] | None]]:
    """``(devices, ratios in lowest terms or None)`` of every stage, pipeline by pipeline."""
    return [(list(s.devices), list(s.tp_ratios) if s.tp_ratios else None)
            for p in strategy.pipelines for s in p.stages]


def _replan(data: dict, n: int, failed: list[int], family: str = "llama") -> Strategy:
    model = FAMILIES[family].preset("tiny")
    new = replan_elastic(model, Cluster.local(n), data, failed, seq_len=SEQ, global_batch=8)
    assert sorted(new.ranks) == [r for r in range(n) if r not in failed]       # every survivor, no failed rank
    return Strategy.load(new.model_dump(), model=model, cluster=Cluster.local(n), global_batch=8)  # valid


# ---- the planner (pure) ------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_replan_keeps_the_ratios_of_an_untouched_uneven_stage(family: str) -> None:
    """The bug this file was written with: replan_elastic built every new stage without ratios, so a surviving
    3:1 stage came back even (TP2 1:1) -- a different layout from the one its devices were given."""
    new = _replan(PP2_UNEVEN_FIRST, 3, [2], family)             # the even stage lost: [0, 1] takes every layer
    assert _stages(new) == [([0, 1], [3, 1])], new
    assert new.pipelines[0].stages[0].layers == [0, 3]


@pytest.mark.timeout(60)
def test_replan_gives_a_shrunk_uneven_stage_feasible_ratios_or_none() -> None:
    # one device left of the 3:1 pair: no ratios (a single rank; ratios of length 2 would not even validate)
    for lost, alive in ((1, 0), (0, 1)):
        new = _replan(PP2_UNEVEN_FIRST, 3, [lost])
        assert all(r is None for _, r in _stages(new)) and [alive] in [d for d, _ in _stages(new)], new
    # TP3 2:1:1 -> the survivors' ratios: 2:1 cuts the 4 heads (3 parts), its nearest feasible split is 3:1;
    # 1:1 (rank 0 lost) is the even split
    assert _stages(_replan(TP3_UNEVEN, 3, [2])) == [([0, 1], [3, 1])]
    assert _stages(_replan(TP3_UNEVEN, 3, [1])) == [([0, 2], [3, 1])]
    assert _stages(_replan(TP3_UNEVEN, 3, [0])) == [([1, 2], None)]


@pytest.mark.timeout(60)
def test_replan_falls_back_to_even_where_the_annotation_cannot_hold_the_ratios() -> None:
    """An uneven stage beside a pipeline that splits the same layer differently cannot be expressed: the plan is
    even there (and valid), never a strategy that fails to load."""
    new = _replan(DP2_UNEVEN, 4, [2])                           # [0, 1] 3:1 beside [3] alone: even
    assert sorted(d for d, _ in _stages(new)) == [[0, 1], [3]] and all(r is None for _, r in _stages(new)), new
    for lost in (5, 4, 2):
        new = _replan(DP2_PP2_UNEVEN, 6, [lost])
        assert all(r is None for _, r in _stages(new)), (lost, new)
    # an even running strategy is planned exactly as before (no ratios appear)
    even = {"pipelines": [_pipe([([0, 1], [0, 1]), ([2], [2, 3])], 2, 4)]}
    assert _stages(_replan(even, 3, [2])) == [([0, 1], None)]


# ---- real jobs -----------------------------------------------------------------------------------------------------
def _program(model, data: dict, cluster: Cluster):
    return specialize(model, plan_from_strategy(model, Strategy.load(data), cluster), cluster,
                      bindings={"B": 8, "S": SEQ})


def _run(family: str, data: dict, n: int, kill: int, tmp_path: Path, checkpoint: bool):
    """Train ``data`` on ``n`` local ranks, ``kill`` SIGKILLing itself in step 3's backward; with ``checkpoint``,
    synchronous checkpoints after steps 2 and 4 (so the one of step 2 is complete when step 3 starts)."""
    model, cluster = FAMILIES[family].preset("tiny"), Cluster.local(n)
    kw = dict(checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2, checkpoint_async=False, keep=STEPS) \
        if checkpoint else {}
    job = launch(_program(model, data, cluster), cluster, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR,
                          elastic=True, fault_injection=[{"rank": kill, "step": 3, "at": "backward"}],
                          capture_dir=tmp_path / "capture", timeout_s=60, heartbeat_s=0.5, **kw)
    pids = job.pids()
    result = job.wait(timeout=100)
    ref = reference_training(model, steps=STEPS, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR)
    assert len(result.losses) == STEPS
    assert max(abs(a - b) / abs(b) for a, b in zip(result.losses, ref.losses)) <= TOL, (result.losses, ref.losses)
    (event,) = [e for e in result.events if e.reason == "failure"]
    assert event.done and event.failed_ranks == [kill], event
    survivors = {r: p for r, p in pids.items() if r != kill}
    assert {r: p for r, p in job.pids().items() if r != kill} == survivors   # the same processes
    err = _state_err(tmp_path / "capture", model, ref)
    assert max(err.values()) <= STATE_TOL, err
    assert_no_workers_left(list(pids.values()), within=10)  # each worker leads its process group
    # a reload goes back to the checkpoint's step: rank 0 reported steps 2 and 3 twice; in memory, once
    assert [m.step for m in job.metrics.rank(0)].count(2) == (2 if checkpoint else 1)
    return event


@pytest.mark.timeout(120)
def test_a_lost_even_stage_leaves_the_uneven_stage_with_its_ratios(tmp_path: Path) -> None:
    """Rank 2 (the even last stage) dies: its layers and head have no surviving copy, so the survivors [0, 1]
    reload them from the checkpoint of step 2 in the same processes, under the replanned strategy: the uneven
    pair [0, 1] keeps 3:1 and now holds every layer (survivors renumbered 0..1: the same ranks)."""
    event = _run("llama", PP2_UNEVEN_FIRST, 3, 2, tmp_path, checkpoint=True)
    assert event.source == "checkpoint" and event.checkpoint_step == 2, event
    assert _stages(event.strategy) == [([0, 1], [3, 1])], event.strategy
    assert event.strategy.pipelines[0].stages[0].layers == [0, 3]
    # and the plan the survivors ran is uneven: rank 0 holds three quarters of wq, rank 1 one quarter
    wq = event.program.plan.annotations["layers.0.attn.wq"]
    assert wq.hdim == 1 and wq.hratios == [3, 1], wq


@pytest.mark.timeout(120)
def test_a_lost_rank_of_an_uneven_pair_is_recovered_in_memory(tmp_path: Path) -> None:
    """Two pipelines of the same 3:1 stage; rank 2 (the one-quarter rank of [3, 2]) dies: the other pipeline holds
    a replica of everything, so the survivors switch in memory.  Rank 3 alone beside the 3:1 pair cannot be
    expressed with ratios: the new plan is even, on the 3 survivors."""
    event = _run("llama", DP2_UNEVEN, 4, 2, tmp_path, checkpoint=False)
    assert event.source == "memory" and event.bytes["intra"] + event.bytes["inter"] > 0, event
    stages = _stages(event.strategy)                   # survivors renumbered: 0, 1, 3 -> 0, 1, 2
    assert sorted(d for d, _ in stages) == [[0, 1], [2]] and all(r is None for _, r in stages), event.strategy


@pytest.mark.timeout(120)
def test_gpt2_a_shrunk_tp3_stage_gets_the_nearest_feasible_ratios(tmp_path: Path) -> None:
    """GPT-2 (tied embedding) on one TP3 2:1:1 stage; rank 2 dies taking its quarter of every split tensor: the
    survivors reload from the checkpoint under TP2 with the survivors' 2:1 moved to 3:1 (4 heads)."""
    event = _run("gpt", TP3_UNEVEN, 3, 2, tmp_path, checkpoint=True)
    assert event.source == "checkpoint" and event.checkpoint_step == 2, event
    assert _stages(event.strategy) == [([0, 1], [3, 1])], event.strategy


def test_a_straggler_replan_keeps_the_ratios_of_an_uneven_stage() -> None:
    """``replan_straggler`` on a running strategy with a 3:1 stage: the re-balanced strategy keeps the stage's
    ratios (it dropped them: every candidate was built even)."""
    from hspmd_sdk.planner.elastic import replan_straggler

    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(3)
    running = Strategy.load({"pipelines": [{"stages": [
        {"devices": [0, 1], "layers": [0, 1], "ratios": [3, 1]}, {"devices": [2], "layers": [2, 3]}],
        "micro_batch_size": 2, "num_micro_batches": 4}]}, model=model, cluster=cluster)
    got = replan_straggler(model, cluster, running, {2: 2.0}, seq_len=16)
    uneven = [(st.devices, st.ratios) for p in got.pipelines for st in p.stages if st.ratios]
    assert uneven == [([0, 1], [3, 1])], got
    Strategy.load(got.model_dump(), model=model, cluster=cluster)
