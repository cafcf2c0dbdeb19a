"""Communication overlapped with compute, proven by the order of events inside the workers.

The executor's ``trace`` hook (a test-only argument, :class:`~hspmd_sdk.runtime.workers.executor.StepExecutor`) records,
in order, every schedule action, every receive posted ahead, every ZeRO-1 gather waited for, every use whose
gradient became final and every gradient bucket posted.  Order, not time, is asserted — robust on a loaded CI
box.  Checked on real worker processes (gloo), tiny models, fp32, with small bucket caps (128 KiB, first bucket
32 KiB: several buckets for the ~0.8 MB of gradients):

* gradient buckets start during the step's last backward, last layers first: the first bucket is posted before
  the embedding's gradient is final and before that backward ends, and no bucket starts before every use of its
  parameters is final (GPT-2's tied ``wte`` has two uses on one rank: the embedding and the LM head);
* ZeRO-1: the parameters' gathers are coalesced in buckets, the first layers' first, and the forward starts
  before the last layers' gathered parameters are waited for;
* 1F1B: the next micro-batch's activations and the first gradients are received into buffers posted ahead;
* and none of it changes a result: the losses equal the single-device reference (fp32, 1e-5), as do every
  strategy's in ``test_runtime_train.py`` (which runs with the default buckets) — also with the stage-boundary
  messages on a group per rank pair and direction (``pipeline_groups``, what the executor uses under NCCL).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hspmd_sdk import GPTConfig, LlamaConfig  # noqa: E402
from hspmd_sdk.core.cluster import Cluster  # noqa: E402
from hspmd_sdk.core.specialize import specialize  # noqa: E402
from hspmd_sdk.core.strategy import Strategy  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.runtime import launch  # noqa: E402
from _equivalence import captured_close_to_reference  # noqa: E402
from hspmd_sdk.runtime.control.train import reference_training, training_run  # noqa: E402
from test_runtime_train import _pipe  # noqa: E402

TESTS = Path(__file__).resolve().parent
STEPS, SEED, SEQ, LR = 2, 1, 16, 1e-3
DP2 = {"pipelines": [_pipe([([0], [0, 3])], 2, 2), _pipe([([1], [0, 3])], 2, 2)]}
RUNS = {
    "llama_dp2": (LlamaConfig, DP2),
    "llama_dp2_zero1": (LlamaConfig, {**DP2, "zero1": True}),
    "llama_pp2_1f1b": (LlamaConfig, {"pipelines": [_pipe([([0], [0, 1]), ([1], [2, 3])], 2, 4)]}),
    "gpt_dp2": (GPTConfig, DP2),
    # the NCCL layout of stage-boundary messages (a group per rank pair and direction), run on gloo
    "gpt_pp2_1f1b_pair_groups": (GPTConfig, {"pipelines": [_pipe([([0], [0, 1]), ([1], [2, 3])], 2, 4)]}),
}
PAIR_GROUPS = ["gpt_pp2_1f1b_pair_groups"]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> dict:
    cluster = Cluster.local(2)
    programs = {n: specialize(m.preset("tiny"), plan_from_strategy(m.preset("tiny"), Strategy.load(s), cluster),
                              cluster) for n, (m, s) in RUNS.items()}
    runs = {n: training_run(p, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, cluster=cluster)
            for n, p in programs.items()}
    capture = tmp_path_factory.mktemp("overlap")
    payload = {"runs": runs, "bucket_bytes": 128 * 1024, "first_bucket_bytes": 32 * 1024, "pair_groups": PAIR_GROUPS,
               "capture_dir": str(capture)}
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), old])  # the workers import overlap_entry from here
    try:
        result = launch(None, cluster, steps=1, entry="overlap_entry:entry", payload=payload, timeout_s=180).wait()
    finally:
        os.environ["PYTHONPATH"] = old
    return {"programs": programs, "results": result.results, "capture": capture}


def _index(events: list[dict], **match: object) -> list[int]:
    return [i for i, e in enumerate(events) if all(e.get(k) == v for k, v in match.items())]


@pytest.mark.parametrize("name", list(RUNS))
def test_overlap_changes_no_result(name: str, traced: dict) -> None:
    model = RUNS[name][0].preset("tiny")
    ref = reference_training(model, steps=STEPS, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR)
    # the losses cannot see a bucket added twice or a gradient scaled (Adam's step is scale-free): step 0's
    # gradients and the final parameters can
    captured_close_to_reference(traced["capture"], traced["results"][0][name]["losses"], model, ref, seed=SEED,
                                steps=STEPS, lr=LR, index=list(RUNS).index(name))


@pytest.mark.parametrize("name", ["llama_dp2", "gpt_dp2", "llama_dp2_zero1"])
def test_gradient_buckets_start_during_the_last_backward(name: str, traced: dict) -> None:
    program = traced["programs"][name]
    uses = {}
    for gs in program.grad_syncs:
        uses.setdefault(gs.param, []).extend(gs.uses)
    embedding = program.parameters[0]  # the first parameter of the graph: its gradient is final last
    for rank in (0, 1):
        ev = traced["results"][rank][name]["events"]
        buckets = _index(ev, event="bucket_start")
        assert len(buckets) >= 3, (rank, len(buckets))
        last_b = _index(ev, event="action", kind="B")[-1]
        end = _index(ev, event="backward_end")[-1]
        assert last_b < buckets[0] < end                       # posted inside the last backward, not after it
        assert sum(b < end for b in buckets) >= 2               # more than one bucket overlapped with it
        first_params = ev[buckets[0]]["params"]
        assert embedding not in first_params                    # reverse layer order: the last layers first
        emb_final = [i for i in _index(ev, event="grad_final")
                     if any(u in ev[i]["uses"] for u in uses[embedding])]
        assert emb_final and buckets[0] < max(emb_final)
        final_at = {}
        for i in _index(ev, event="grad_final"):
            for u in ev[i]["uses"]:
                final_at.setdefault(u, i)
        for b in buckets:
            if b > end:
                continue                                          # posted when backward returned: all final
            for p in ev[b]["params"]:
                held = [u for u in uses[p] if rank in program.annotations[u].ranks]
                assert held and all(final_at.get(u, len(ev)) < b for u in held), (rank, p, held)
    if name == "gpt_dp2":  # the tied weight: a bucket waits for both of its uses on this rank
        assert uses["wte.weight"] == ["wte.weight.gather", "wte.weight.head"]


def test_zero1_gathers_overlap_the_first_forward(traced: dict) -> None:
    program = traced["programs"]["llama_dp2_zero1"]
    assert program.comm_plans["layers.3.attn.wq.gather"].kinds == ["SplitAllGather"]
    for rank in (0, 1):
        ev = traced["results"][rank]["llama_dp2_zero1"]["events"]
        first_f = _index(ev, event="action", kind="F", mb=0)[0]
        pre_end = first_f  # PRE only posts the gathers: the first forward starts right after it
        ready = {ev[i]["name"]: i for i in _index(ev, event="param_ready")}
        assert ready["layers.0.attn.wq.gather"] > pre_end and ready["layers.3.attn.wq.gather"] > first_f
        assert ready["layers.0.attn.wq.gather"] < ready["layers.3.attn.wq.gather"]  # waited for in use order
        # coalesced: one broadcast per bucket and owner, not per parameter and owner; the first layers first
        posted = [ev[i] for i in _index(ev, event="gather_start")]
        gathered = [n for n in program.comm_plans if n.endswith(".gather")]
        assert all(i < first_f for i in _index(ev, event="gather_start"))
        assert len(gathered) >= 30 and 2 < len(posted) <= 12, (len(gathered), len(posted))
        assert {p for b in posted for p in b["params"]} == set(ready) == set(gathered)
        owner0 = [b["params"] for b in posted if b["root"] == 0]
        at = {p: k for k, ps in enumerate(owner0) for p in ps}
        assert at["embed.weight.gather"] == 0 and at["layers.0.attn.wq.gather"] < at["layers.3.attn.wq.gather"]


def test_stage_boundary_groups_per_pair_and_direction(traced: dict) -> None:
    from hspmd_sdk.runtime.workers.executor import pipeline_pairs

    program = traced["programs"]["gpt_pp2_1f1b_pair_groups"]
    assert program.comm_plans["wte.weight.head"].kinds == ["SendRecv"]  # PRE's tied-weight move: the job's group
    assert pipeline_pairs(program) == [(0, 0, 1), (1, 0, 1)]           # activations 0 -> 1, gradients 1 -> 0


def test_pipeline_receives_are_posted_ahead(traced: dict) -> None:
    first, last = (traced["results"][r]["llama_pp2_1f1b"]["events"] for r in (0, 1))
    # the last stage posts micro-batch 1's activations before it computes micro-batch 0 ...
    assert _index(last, event="recv_posted", kind="RECV_F", mb=1)[0] < _index(last, event="action", kind="F", mb=0)[0]
    # ... and the first stage the first gradients before its first forward
    assert _index(first, event="recv_posted", kind="RECV_B", mb=0)[0] < _index(first, event="action", kind="F",
                                                                              mb=0)[0]
    # every receive of the step was posted ahead of its action (one ahead per direction)
    for ev, kind in ((first, "RECV_B"), (last, "RECV_F")):
        for i in _index(ev, event="action", kind=kind):
            mb = ev[i]["mb"]
            assert any(j < i for j in _index(ev, event="recv_posted", kind=kind, mb=mb)), (kind, mb)
