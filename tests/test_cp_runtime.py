"""Context parallelism (SPEC §11) in a running job, against the single-device reference (fp32, 1e-5).

* **Switching** (``job.switch``): a TP2 plan with ZeRO-1 -> a CP2 x TP2 plan over four ranks (parameters and Adam
  moments reach ranks that held nothing; CP duplicates them over its groups) -> a CP2 pipeline beside a one-rank
  pipeline with ZeRO-1 (out of the CP x TP grid, back to sharded moments): the losses of every step equal the
  single-device model's.
* **Elastic recovery**: a CP2 pipeline beside a one-rank pipeline, one CP rank SIGKILLed in the middle of a step:
  the survivors replan, switch by fused BSR, redo the step, and the losses equal the failure-free reference.
* **Packed rows** (mixed-length data, the dispatcher packing several documents into one row): a pipeline of two
  CP2 stages (Llama: its rows laid out in the balanced order, each rank holding global chunks ``i`` and ``3-i``)
  and a pipeline whose first stage is CP2 and last stage one rank (GPT-2: the contiguous split) train exactly the
  single-device model on the same sequences (losses, parameters after the steps), with documents that cross a
  boundary between two ranks' chunks (checked from the dispatcher's records and the layout) and rows whose
  length the CP degree does not divide (the executor pads them with a document of ignored targets).

Every job is bounded; the slow variants (GPT-2) run with ``-m slow``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _procs import assert_no_workers_left  # noqa: E402
from hspmd_sdk import Cluster, GPTConfig, LlamaConfig, Strategy, launch, specialize  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.planner.cost import CostModel, LinkOverride  # noqa: E402
from hspmd_sdk.planner.mixed import MixedEntry, MixedPlan  # noqa: E402
from hspmd_sdk.runtime.data import Documents, LengthBatches  # noqa: E402
from hspmd_sdk.runtime.workers.executor import sequence_balance  # noqa: E402
from hspmd_sdk.runtime.control.mixed import reference_mixed  # noqa: E402
from hspmd_sdk.runtime.control.train import assemble, load_captured, reference_training  # noqa: E402

SEQ, SEED, LR, STEPS = 16, 3, 1e-3, 5
TOL = 1e-5
FAMILIES = {"llama": LlamaConfig, "gpt": GPTConfig}


def _pipe(stages: list[tuple], mbs: int, n: int) -> dict:
    """``stages``: ``(devices, layers[, cp])`` each."""
    return {"stages": [{"devices": s[0], "layers": s[1], **({"cp": s[2]} if len(s) > 2 else {})} for s in stages],
            "micro_batch_size": mbs, "num_micro_batches": n}


#: global batch 8
TP2_ZERO1 = {"pipelines": [_pipe([([0, 1], [0, 3])], 4, 2)], "zero1": True}
CP2XTP2 = {"pipelines": [_pipe([([0, 1, 2, 3], [0, 3], 2)], 4, 2)]}
CP2_BESIDE_DP_ZERO1 = {"pipelines": [_pipe([([2, 3], [0, 3], 2)], 4, 1), _pipe([([1], [0, 3])], 4, 1)],
                       "zero1": True}
#: a CP2 pipeline beside a one-rank pipeline: every parameter has a replica outside the CP group
CP2_BESIDE_ONE = {"pipelines": [_pipe([([0, 1], [0, 3], 2)], 4, 1), _pipe([([2], [0, 3])], 4, 1)]}


def _program(model: Any, data: dict, cluster: Cluster) -> Any:
    return specialize(model, plan_from_strategy(model, Strategy.load(data), cluster), cluster,
                      bindings={"B": 8, "S": SEQ})


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def reference() -> Any:
    return reference_training(LlamaConfig.preset("tiny"), steps=STEPS, seed=SEED, global_batch=8, seq_len=SEQ,
                              lr=LR)


# ---- switching into and out of CP plans --------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_switching_into_and_out_of_cp_plans(reference: Any) -> None:
    """TP2 (ZeRO-1) -> CP2 x TP2 -> CP2 beside DP (ZeRO-1), each requested by ``job.switch`` while every worker is
    held at the start of a step (1, then 3): both applied at the next boundary (before steps 2 and 4), parameters
    and Adam moments moved by BSR (some megabytes: ranks 2 and 3 start empty), losses equal to the single-device
    model's."""
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(4)
    job = launch(_program(model, TP2_ZERO1, cluster), cluster, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR,
                          timeout_s=110, hold_at=[1, 3])
    pids = job.pids()
    job.wait_held(1)
    into = job.switch(_program(model, CP2XTP2, cluster))
    job.release(1)
    job.wait_held(3)
    assert into.done  # every rank switched before step 2, so before it got to step 3
    out = job.switch(_program(model, CP2_BESIDE_DP_ZERO1, cluster))
    job.release(3)
    result = job.wait(timeout=100)
    assert into.done and out.done and not into.superseded and not out.superseded, (str(into), str(out))
    assert (into.step, out.step) == (2, 4), (into.step, out.step)
    assert all(sum(e.bytes.values()) > 0 for e in (into, out)), (str(into), str(out))
    assert len(result.losses) == STEPS and _rel(result.losses, reference.losses) <= TOL, \
        (result.losses, reference.losses)
    assert_no_workers_left(list(pids.values()), within=10)


# ---- elastic recovery of a CP plan --------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_sigkilled_cp_rank_is_recovered_elastically(reference: Any) -> None:
    """Rank 1 (the second rank of the CP2 group) is SIGKILLed inside step 2, as its backward starts (an injected
    fault: a real SIGKILL at that point of that step, so its CP peer is then inside the ring or the gradient
    synchronisation): one failure event naming rank 1, the survivors finish on a replanned strategy without
    rank 1, losses equal to the failure-free ones."""
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(3)
    job = launch(_program(model, CP2_BESIDE_ONE, cluster), cluster, steps=STEPS, seed=SEED, seq_len=SEQ,
                 lr=LR, elastic=True, timeout_s=110, heartbeat_s=0.5,
                 fault_injection=[{"rank": 1, "step": 2, "at": "backward"}])
    pids = job.pids()
    result = job.wait(timeout=100)
    failures = [e for e in result.events if e.reason == "failure"]
    assert len(failures) == 1 and failures[0].done and failures[0].failed_ranks == [1], \
        [str(e) for e in result.events]
    assert len(result.losses) == STEPS and _rel(result.losses, reference.losses) <= TOL, \
        (result.losses, reference.losses)
    assert job.pids() == {r: p for r, p in pids.items() if r != 1}
    assert_no_workers_left(list(pids.values()), within=10)


# ---- packed rows through a CP stage ---------------------------------------------------------------------------------
CONTEXT, BUDGET, MIXED_STEPS, STATE_TOL = 64, 128, 3, 1e-4
#: the first stage CP2 (its attention over a packed row, documents crossing its chunk boundary), the second one rank
CP2_PP2 = Strategy.load({"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, 1], "cp": 2},
                                                   {"devices": [2], "layers": [2, 3]}],
                                        "micro_batch_size": 1, "num_micro_batches": 1}], "name": "cp2-pp2"})
#: two CP2 stages: every attention of the pipeline is CP2, so its rows are laid out in the balanced order
CP2_CP2 = Strategy.load({"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, 1], "cp": 2},
                                                   {"devices": [2, 3], "layers": [2, 3], "cp": 2}],
                                        "micro_batch_size": 1, "num_micro_batches": 1}], "name": "cp2-cp2"})
#: point-to-point made expensive for the dispatcher, so that it packs several documents into a row rather than
#: feeding the pipeline one document a micro-batch
PACKING_COST = CostModel(link_overrides={"intra": LinkOverride(latency=1.0, bandwidth=1e9)})


def _documents(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(n)) for n in rng.integers(5, 40, 60)]


DOCS = _documents()


def _rows(job: Any) -> list[tuple[int, tuple[int, ...]]]:
    """Every packed row the dispatcher made: ``(step, document lengths)``, each document ``len - 1`` tokens."""
    batches = LengthBatches(Documents(DOCS), context=CONTEXT, tokens_per_step=BUDGET, seed=SEED)
    out = []
    for step, rec in enumerate(job.length_planner.records):
        seqs = batches.step_sequences(step)
        for pipe in rec["micro_batches"]:
            out += [(step, tuple(len(seqs[i]) - 1 for i in mb)) for mb in pipe]
    return out


def _crosses(docs: tuple[int, ...], cp: int, balanced: bool) -> bool:
    """Whether a document's tokens sit on more than one rank of the CP group, for a row padded to a multiple of
    ``cp`` and cut into ``cp`` equal chunks (contiguous) or ``2 cp`` chunks, rank ``i`` holding chunks ``i`` and
    ``2cp-1-i`` (balanced): computed here from the lengths alone."""
    total = sum(docs) + (-sum(docs) % cp)
    if balanced:
        owner = np.concatenate([np.full(len(c), j if j < cp else 2 * cp - 1 - j)
                                for j, c in enumerate(np.array_split(np.arange(total), 2 * cp))])
    else:
        owner = np.repeat(np.arange(cp), total // cp)
    ends = np.cumsum((0,) + docs)
    return any(len(set(owner[a:e].tolist())) > 1 for a, e in zip(ends[:-1], ends[1:]))


def _packed_cp_run(family: str, tmp: Path, strategy: Strategy, ranks: int, balanced: bool) -> None:
    model, cluster = FAMILIES[family].preset("tiny"), Cluster.local(ranks)
    programs = MixedPlan(context_len=CONTEXT, tokens_per_batch=BUDGET,
                         entries=[MixedEntry(max_seq_len=CONTEXT, windows=[BUDGET], strategy=strategy)]
                         ).programs(model, cluster)
    assert {sequence_balance(p, 0) for p in programs} == {2 if balanced else 1}
    job = launch(programs, cluster, steps=MIXED_STEPS, seed=SEED, data=DOCS, tokens_per_step=BUDGET,
                 context=CONTEXT, capture_dir=tmp, cost=PACKING_COST, timeout_s=150)
    result = job.wait()
    ref = reference_mixed(model, steps=MIXED_STEPS, seed=SEED, data=DOCS, tokens_per_step=BUDGET, context=CONTEXT)
    rows = _rows(job)
    assert all(rec["packed"] for rec in job.length_planner.records)
    assert any(len(d) > 1 and _crosses(d, 2, balanced) for _, d in rows), rows  # a document across two ranks
    assert any(sum(d) % 2 for _, d in rows), rows  # a row the executor pads to whole chunks
    assert len(result.losses) == MIXED_STEPS and _rel(result.losses, ref.losses) < TOL, (result.losses, ref.losses)
    shapes = {k: tuple(v.shape) for k, v in ref.params.items()}
    captured = load_captured(tmp)
    grads, _ = assemble([{**c, "boxes": c["grad_boxes"]} for c in captured], "grads", shapes)
    scale = max(float(g.abs().max()) for g in ref.grads.values())
    assert max(float((grads[k] - ref.grads[k]).abs().max()) for k in shapes) < TOL * scale
    full, spread = assemble(captured, "params", shapes)
    assert spread == 0.0  # the CP replicas of every parameter agree exactly
    err = max(float((full[k] - ref.params[k]).abs().max()) for k in ref.params)
    assert err < STATE_TOL, err


@pytest.mark.timeout(200)
def test_packed_rows_through_a_cp_stage_equal_the_reference(tmp_path: Path) -> None:
    _packed_cp_run("llama", tmp_path, CP2_CP2, 4, balanced=True)


@pytest.mark.timeout(300)
def test_packed_rows_through_a_cp_stage_equal_the_reference_gpt2(tmp_path: Path) -> None:
    _packed_cp_run("gpt", tmp_path, CP2_PP2, 3, balanced=False)
