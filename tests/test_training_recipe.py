"""The training recipe (SPEC §13): learning-rate schedules, clipping by global norm, weight decay on the expected
parameter groups and validation, under every plan class, against the single-device reference.

One 4-rank job trains the tiny GPT-2 (tied embeddings: the weight's two uses may sit on different ranks) under
each plan for 4 steps with the clipping active (``max_norm`` far below the norm), a warmup + cosine schedule,
weight decay and a validation every 2 steps.  The reference is ``reference_training``: the plain module, Adam,
``torch.nn.utils.clip_grad_norm_``.  Checked per plan: every step's loss (1e-5 relative), the global norm before
clipping (1e-6 relative: the norm counts every element of the model once, however the plan splits, duplicates
or shards it), the learning rates, the validation losses (1e-5), and the final parameters and Adam moments
(assembled from the ranks' shards; replicas agree exactly).  A norm that counts a duplicated element twice is
shown to fail the same comparison.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hspmd_sdk import Annotation, Cluster, GPTConfig, LlamaConfig, launch, specialize  # noqa: E402
from hspmd_sdk.core.ownership import owned_boxes, owned_boxes_by_rank  # noqa: E402
from hspmd_sdk.core.strategy import Strategy  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.errors import PlanValidationError  # noqa: E402
from hspmd_sdk.planner.mixed import MixedEntry, MixedPlan  # noqa: E402
from hspmd_sdk.runtime.control.mixed import reference_mixed  # noqa: E402
from hspmd_sdk.runtime.control.train import start_runs, reference_training, training_run  # noqa: E402

from _equivalence import final_state_matches  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "hspmd_sdk" / "examples"
STEPS, SEED, SEQ, LR = 4, 1, 16, 1e-2
RECIPE = dict(max_norm=0.05, schedule={"kind": "cosine", "warmup_steps": 1, "min_lr_factor": 0.1},
              weight_decay=0.1, eval_every=2, eval_batches=2)


def _pipe(stages: list[tuple], mbs: int, n: int) -> dict:
    """``stages``: ``(devices, layers[, extra stage fields])`` each."""
    return {"stages": [{"devices": s[0], "layers": s[1], **(s[2] if len(s) > 2 else {})} for s in stages],
            "micro_batch_size": mbs, "num_micro_batches": n}


#: every plan class: name -> strategy (global batch 8 on 4 local ranks; ranks a run does not use sit it out)
PLANS = {
    "dp2": {"pipelines": [_pipe([([0], [0, 3])], 2, 2), _pipe([([1], [0, 3])], 2, 2)]},
    "tp2": {"pipelines": [_pipe([([0, 1], [0, 3])], 4, 2)]},
    "pp2_1f1b": {"pipelines": [_pipe([([0], [0, 1]), ([1], [2, 3])], 2, 4)]},
    "hetero_tp": json.loads((EXAMPLES / "example_hetero_tiny.json").read_text()),
    "tp2_ratios_3to1": {"pipelines": [_pipe([([0, 1], [0, 3], {"ratios": [3, 1]})], 4, 2)]},
    "cp2_beside_cp1": {"pipelines": [_pipe([([0, 1], [0, 1], {"cp": 2}), ([2], [2, 3])], 2, 2),
                                     _pipe([([3], [0, 3])], 2, 2)]},
    "dp3_zero1_uneven": {"pipelines": [_pipe([([0], [0, 3])], 4, 1), _pipe([([1], [0, 3])], 2, 1),
                                       _pipe([([2], [0, 3])], 2, 1)], "zero1": True},
    "dp2xtp2_zero1": {"pipelines": [_pipe([([0, 1], [0, 3])], 2, 2), _pipe([([2, 3], [0, 3])], 2, 2)],
                      "zero1": True},
}


def _program(model: Any, strategy: dict, cluster: Cluster) -> Any:
    return specialize(model, plan_from_strategy(model, Strategy.load(strategy), cluster), cluster)


@pytest.fixture(scope="module")
def gpt() -> GPTConfig:
    return GPTConfig.preset("tiny")


def train_plans(gpt: GPTConfig, plans: dict[str, dict], out: Path) -> dict:
    """One 4-rank job training ``plans`` (name -> strategy) one after the other with the recipe, capturing into
    ``out``: ``{"out", "runs": name -> rank 0's run, "results": every rank's}`` (shared with test_zero2.py)."""
    cluster = Cluster.local(4)
    runs = [training_run(_program(gpt, s, cluster), steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, capture_dir=out,
                         cluster=cluster, **RECIPE) for s in plans.values()]
    result = start_runs(runs, cluster, timeout_s=120).wait()
    return {"out": out, "runs": {n: result.results[0]["runs"][i] for i, n in enumerate(plans)},
            "results": result.results}


@pytest.fixture(scope="module")
def trained(gpt: GPTConfig, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return train_plans(gpt, PLANS, tmp_path_factory.mktemp("recipe"))


@pytest.fixture(scope="module")
def reference(gpt: GPTConfig) -> Any:
    return reference_training(gpt, steps=STEPS, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR, **RECIPE)


def _state_matches(out: Path, reference: Any, index: int) -> None:
    """``final_state_matches`` over the parameters with a gradient: a parameter whose true gradient is zero (GPT-2's
    key biases: softmax ignores a constant added to every score) gets rounding noise that Adam turns into
    lr-sized steps of either sign, so it is held to that bound instead (measured: up to ~0.5 of its norm)."""
    import copy

    floor = 1e-7 * max(float(g.abs().max()) for g in reference.grads.values())
    noise = {k for k, g in reference.grads.items() if float(g.abs().max()) < floor}
    kept = copy.copy(reference)
    for kind in ("params", "exp_avg", "exp_avg_sq"):
        setattr(kept, kind, {k: v for k, v in getattr(reference, kind).items() if k not in noise})
    final_state_matches(out, kept, index=index)
    if noise:
        from hspmd_sdk.runtime.reference import assemble, load_captured

        shapes = {k: tuple(reference.params[k].shape) for k in noise}
        full, _ = assemble(load_captured(out, index), "params", shapes)
        for k in noise:
            assert float((full[k] - reference.params[k]).abs().max()) <= 2 * LR * STEPS, k


def _rel(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want), (got, want)
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def test_the_reference_clips_and_schedules(reference: Any) -> None:
    """The recipe is active: every step's norm is far above max_norm (so every update was clipped), the learning
    rate follows warmup then cosine, and the validation ran on steps 1 and 3."""
    assert min(reference.grad_norms) > 4 * RECIPE["max_norm"]
    lrs = [LR * f for f in (0.5, 1.0, 0.1 + 0.9 * (1 + math.cos(math.pi / 3)) / 2,
                            0.1 + 0.9 * (1 + math.cos(2 * math.pi / 3)) / 2)]
    assert reference.lrs == pytest.approx(lrs, rel=1e-12)
    assert sorted(reference.val_losses) == [1, 3]


@pytest.mark.parametrize("name", list(PLANS))
def test_clipped_training_equals_the_single_device_reference(name: str, trained: dict, reference: Any) -> None:
    run = trained["runs"][name]
    assert _rel(run["losses"], reference.losses) <= 1e-5
    assert _rel(run["grad_norms"], reference.grad_norms) <= 1e-6, (run["grad_norms"], reference.grad_norms)
    assert run["lrs"] == pytest.approx(reference.lrs, rel=1e-12)
    vals = {int(k): v for k, v in run["val_losses"].items()}
    assert sorted(vals) == sorted(reference.val_losses)
    assert _rel([vals[k] for k in sorted(vals)], [reference.val_losses[k] for k in sorted(vals)]) <= 1e-5
    _state_matches(trained["out"], reference, list(PLANS).index(name))


def test_a_norm_that_counts_duplicates_twice_fails_the_comparison(gpt: GPTConfig, reference: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above can fail: the same DP2 run whose workers sum every rank's whole shards (each
    replicated element counted twice, ``double_count_entry``) gets a norm sqrt(2) too large."""
    from hspmd_sdk.runtime import launch as start

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    cluster = Cluster.local(2)
    run = training_run(_program(gpt, PLANS["dp2"], cluster), steps=2, seed=SEED, seq_len=SEQ, lr=LR,
                       cluster=cluster, **RECIPE)
    got = start(None, cluster, steps=2, entry="double_count_entry:entry", payload={"runs": [run]},
                timeout_s=120).wait().results[0]["runs"][0]
    assert got["grad_norms"][0] == pytest.approx(math.sqrt(2) * reference.grad_norms[0], rel=1e-5)
    with pytest.raises(AssertionError):
        assert _rel(got["grad_norms"], reference.grad_norms[:2]) <= 1e-6


def test_llama_clipped_with_weight_decay_equals_the_reference(tmp_path: Path) -> None:
    """The other family: TP2 and PP2 with clipping and AdamW's decoupled decay only on matrices (Llama's norms have
    none)."""
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(2)
    names = ["tp2", "pp2_1f1b"]
    recipe = {**RECIPE, "optimizer": "adamw"}
    runs = [training_run(_program(model, PLANS[n], cluster), steps=3, seed=SEED, seq_len=SEQ, lr=LR,
                         capture_dir=tmp_path, cluster=cluster, **recipe) for n in names]
    result = start_runs(runs, cluster, timeout_s=120).wait()
    ref = reference_training(model, steps=3, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR, **recipe)
    adam = reference_training(model, steps=3, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR, **RECIPE)
    assert any(float((ref.params[k] - adam.params[k]).abs().max()) > 1e-6 for k in ref.params)  # not Adam's
    for i, _ in enumerate(names):
        run = result.results[0]["runs"][i]
        # step 0's norm to 1e-6; later ones 1e-4: decoupled decay gives elements whose gradient is (almost) zero
        # lr-sized updates of rounding-noise sign (Adam's L2 decay, in RECIPE, gives them a deterministic one)
        assert _rel(run["losses"], ref.losses) <= 1e-5 and _rel(run["grad_norms"][:1], ref.grad_norms[:1]) <= 1e-6
        assert _rel(run["grad_norms"], ref.grad_norms) <= 1e-4
        _state_matches(tmp_path, ref, i)


def _corpus(root: Path, docs: list[np.ndarray], val_docs: list[np.ndarray]) -> Path:
    """A prepared corpus (SPEC §14) of these documents, byte tokens (vocabulary 256), written field by field."""
    import hashlib

    root.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    meta = {"format_version": 1, "vocab_size": 256, "dtype": "uint16", "splits": {},
            "tokenizer": {"source": "bytes", "vocab_size": 256, "eot_token": "<eot>", "eot_id": 0}}
    for split, ds in (("train", docs), ("val", val_docs)):
        tokens = np.concatenate(ds).astype("<u2")
        starts = np.concatenate([[0], np.cumsum([d.size for d in ds])[:-1]]).astype("<i8")
        (root / f"{split}.bin").write_bytes(tokens.tobytes())
        (root / f"{split}.idx").write_bytes(starts.tobytes())
        h.update(tokens.tobytes())
        meta["splits"][split] = {"tokens": int(tokens.size), "documents": len(ds), "max_token_id": int(tokens.max())}
    meta["digest"] = h.hexdigest()[:32]
    (root / "meta.json").write_text(json.dumps(meta))
    return root


def test_mixed_length_candidates_clip_by_the_same_global_norm(tmp_path: Path) -> None:
    """Candidates chosen per step by length (DP4 with ZeRO-1, TP2 + PP2) on a prepared corpus: the norm of each
    step's gradient and the clipped updates equal the single-device run on the same sequences, and so does the
    validation loss of the corpus's validation split, evaluated under whichever candidate runs."""
    model = LlamaConfig.preset("tiny")
    rng = np.random.default_rng(0)
    lengths = np.clip(np.exp(rng.normal(np.log(7), 0.8, 80)), 2, 60).astype(int)
    corpus = _corpus(tmp_path / "corpus", [rng.integers(1, 256, n) for n in lengths[:60]],
                     [rng.integers(1, 256, n) for n in lengths[60:]])

    def strategy(pipes: list, name: str, zero1: bool = False) -> Strategy:
        return Strategy.load({"pipelines": [{"stages": [{"devices": d, "layers": l} for d, l in p],
                                             "micro_batch_size": 1, "num_micro_batches": 1} for p in pipes],
                              "name": name, "zero1": zero1})

    entries = [MixedEntry(max_seq_len=32, windows=[32, 32],
                          strategy=strategy([[([0, 1], [0, 3])], [([2], [0, 1]), ([3], [2, 3])]], "tp2+pp2")),
               MixedEntry(max_seq_len=64, windows=[64] * 4,
                          strategy=strategy([[([r], [0, 3])] for r in range(4)], "dp4", zero1=True))]
    programs = MixedPlan(context_len=64, tokens_per_batch=128, entries=entries).programs(model, Cluster.local(4))
    kw = dict(steps=4, seed=SEED, data=str(corpus), tokens_per_step=128, context=64, lr=LR,
              max_norm=RECIPE["max_norm"], schedule=RECIPE["schedule"], weight_decay=0.1, eval_every=2,
              eval_batches=2)
    result = launch(programs, Cluster.local(4), capture_dir=tmp_path, timeout_s=120, **kw).wait()
    ref = reference_mixed(model, eval_context=32, **kw)  # the shortest window: TP2 + PP2's 32 tokens
    assert sorted(result.val_losses) == sorted(ref.val_losses) == [1, 3]
    assert _rel([result.val_losses[k] for k in (1, 3)], [ref.val_losses[k] for k in (1, 3)]) <= 1e-5
    in_memory = [rng.integers(1, 256, n) for n in lengths]  # documents without a validation split: refused
    with pytest.raises(PlanValidationError, match="eval_every.*needs a validation split"):
        launch(programs, Cluster.local(4), **{**kw, "data": in_memory})
    assert min(ref.grad_norms) > 4 * RECIPE["max_norm"]
    assert _rel(result.losses, ref.losses) <= 1e-5
    assert _rel(result.grad_norms, ref.grad_norms) <= 1e-6, (result.grad_norms, ref.grad_norms)
    assert result.lrs == pytest.approx(ref.lrs, rel=1e-12)
    _state_matches(tmp_path, ref, 0)


# ---- ownership: each element counted once (pure) ------------------------------------------------------------
@pytest.mark.parametrize("text, shape", [
    ("[0,1] S0x2 | [2,3,4] S0x3", (12, 4)),            # replicas split two ways and three ways: overlapping boxes
    ("[0,1] D2 | [2] R", (6, 4)),                      # duplicated inside a group and across groups
    ("[0,1] S1x2 | [2,3] S1x2 ; hdim=0", (8, 6)),      # top tier split, bottom tier split
    ("[0,1] S0x2 | [2] R ; hdim=0 ratios=3:1", (8, 2)),  # uneven top tier
    ("[3,1] S0x2 | [0,2] D2", (4, 4)),                 # a rank order that is not ascending
])
def test_owned_boxes_tile_the_tensor_exactly_once(text: str, shape: tuple[int, ...]) -> None:
    """Counted with numpy: every element lies in exactly one rank's owned boxes, and each owned box lies in its
    owner's held box (so the owner holds its value)."""
    from hspmd_sdk.core.annotation import local_view

    ann = Annotation(text)
    count = np.zeros(shape, dtype=int)
    for rank, boxes in owned_boxes_by_rank(ann, shape).items():
        held = local_view(ann, shape, rank).box
        for box in boxes:
            assert all(a <= c and d <= b for (a, b), (c, d) in zip(held, box)), (rank, box, held)
            count[tuple(slice(a, b) for a, b in box)] += 1
        for local in owned_boxes(ann, shape, rank):  # the same boxes, relative to the rank's tensor
            assert all(0 <= a < b <= (hb - ha) for (a, b), (ha, hb) in zip(local, held))
    assert (count == 1).all(), count


def test_a_partial_layout_has_no_owner() -> None:
    with pytest.raises(ValueError, match="Partial"):
        owned_boxes_by_rank(Annotation("[0,1] P2"), (4, 4))


def test_bad_recipe_options_start_no_worker(gpt: GPTConfig) -> None:
    cluster = Cluster.local(2)
    program = _program(gpt, PLANS["dp2"], cluster)
    for bad, field in ((dict(max_norm=0.0), "max_norm"), (dict(max_norm=float("nan")), "max_norm"),
                       (dict(schedule={"kind": "cosine", "warmup": 2}), "schedule"),
                       (dict(schedule="exponential"), "schedule"), (dict(eval_every=0), "eval_every"),
                       (dict(decay="biases"), "decay"), (dict(optimizer="sgd"), "optimizer")):
        with pytest.raises(PlanValidationError, match=field):
            launch(program, cluster, steps=2, **bad)


def test_a_config_file_runs_the_same_training_as_its_keywords(gpt: GPTConfig, tmp_path: Path) -> None:
    """``launch(program, cluster, config=FILE)`` with a TOML config (SPEC §13) trains what the same settings as
    keywords train, ``reference_training(model, train_config=cfg)`` is its single-device run, and a keyword that
    contradicts the file is refused before any worker starts."""
    from hspmd_sdk import TrainConfig

    cluster = Cluster.local(4)
    program = _program(gpt, PLANS["hetero_tp"], cluster)
    cfg = TrainConfig.from_launch_kwargs(steps=3, seed=SEED, seq_len=SEQ, lr=LR, data="synthetic", **RECIPE)
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    assert TrainConfig.from_file(path) == cfg
    result = launch(program, cluster, config=path, timeout_s=120).wait()
    ref = reference_training(gpt, global_batch=8, train_config=cfg)
    assert _rel(result.losses, ref.losses) <= 1e-5 and _rel(result.grad_norms, ref.grad_norms) <= 1e-6
    assert result.lrs == pytest.approx(ref.lrs, rel=1e-12)
    assert sorted(result.val_losses) == sorted(ref.val_losses) == [1]
    with pytest.raises(PlanValidationError, match="max_norm"):
        launch(program, cluster, config=cfg, max_norm=1.0)


def test_each_rank_reads_only_its_pipelines_rows_of_the_global_order(trained: dict, gpt: GPTConfig) -> None:
    """Every rank that reads data read, at every step, exactly the rows of the global batch its pipeline trains
    (``Program.batch_rows``), and the pipelines' rows cover the batch once: nobody reads the whole batch."""
    cluster = Cluster.local(4)
    for name in ("hetero_tp", "dp3_zero1_uneven", "cp2_beside_cp1"):
        program = _program(gpt, PLANS[name], cluster)
        runs = trained["results"]
        seen: dict[int, set[tuple[int, int]]] = {}
        for rank, res in runs.items():
            got = res["runs"][list(PLANS).index(name)].get("data_rows") or {}
            if rank not in program.ranks or not got:
                continue
            want = list(program.batch_rows(rank, program.bindings))
            assert sorted(int(s) for s in got) == list(range(STEPS)), (name, rank)
            assert all(v == want for v in got.values()), (name, rank, got, want)
            seen.setdefault(program.executable_graph(rank).pipeline, set()).add(tuple(want))
        spans = sorted(r for rows in seen.values() for r in rows)
        assert all(len(rows) == 1 for rows in seen.values()), seen  # a pipeline's ranks read the same rows
        assert spans[0][0] == 0 and spans[-1][1] == 8 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_schedule_and_clipping_continue_across_a_failure_and_a_resume(trained: dict, gpt: GPTConfig,
                                                                       tmp_path: Path) -> None:
    """The schedule is a function of the step and the clipping of the step's gradient: a worker SIGKILLed in
    step 2 (elastic: the survivors replan and redo the step) and a resume from the checkpoint of step 2 under
    another plan on fewer ranks both give the uninterrupted run's losses, norms and learning rates."""
    whole = trained["runs"]["hetero_tp"]
    cluster = Cluster.local(4)
    kw = dict(steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, timeout_s=120, **RECIPE)
    failed = launch(_program(gpt, PLANS["hetero_tp"], cluster), cluster, elastic=True,
                    fault_injection=[{"rank": 3, "step": 2, "at": "forward"}], **kw).wait()
    assert [e.reason for e in failed.events] == ["failure"]
    assert _rel(failed.losses, whole["losses"]) <= 1e-5 and _rel(failed.grad_norms, whole["grad_norms"]) <= 1e-6
    assert failed.lrs == pytest.approx(whole["lrs"], rel=1e-12)

    ck = tmp_path / "ck"
    launch(_program(gpt, PLANS["hetero_tp"], cluster), cluster, checkpoint_dir=ck, checkpoint_every=2,
           **{**kw, "steps": 2}).wait()
    two = Cluster.local(2)
    resumed = launch(_program(gpt, PLANS["tp2"], two), two, resume_from=ck, **kw).wait()
    assert len(resumed.losses) == STEPS - 2
    assert _rel(resumed.losses, whole["losses"][2:]) <= 1e-5
    assert _rel(resumed.grad_norms, whole["grad_norms"][2:]) <= 1e-6
    assert resumed.lrs == pytest.approx(whole["lrs"][2:], rel=1e-12)
    assert sorted(resumed.val_losses) == [3]


def test_a_strategy_trains_with_its_model_and_without_one_says_so(gpt: GPTConfig, reference: Any) -> None:
    """``launch(strategy, cluster, model=model)`` specializes the strategy for the model; without ``model=`` the
    error says that a Strategy needs one, before any worker starts."""
    cluster = Cluster.local(2)
    strategy = Strategy.load(PLANS["dp2"])
    with pytest.raises(PlanValidationError, match="a Strategy needs a model.*model=model"):
        launch(strategy, cluster, steps=2)
    got = launch(strategy, cluster, model=gpt, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, timeout_s=120,
                 **RECIPE).wait()
    assert _rel(got.losses, reference.losses) <= 1e-5 and _rel(got.grad_norms, reference.grad_norms) <= 1e-6


def test_a_corpus_run_resumes_under_another_plan_with_the_next_samples(gpt: GPTConfig, tmp_path: Path) -> None:
    """A prepared corpus (SPEC §14): 2 steps on 4 ranks (the heterogeneous plan) with a checkpoint, resumed on 2
    ranks under TP2, trains steps 2..3 on the samples an uninterrupted DP2 run trains there (equal losses and
    norms: the data position is the step, the order a function of (seed, step) alone), and validates on the
    corpus's validation split."""
    rng = np.random.default_rng(1)
    corpus = _corpus(tmp_path / "corpus", [rng.integers(1, 256, int(n)) for n in rng.integers(20, 200, 40)],
                     [rng.integers(1, 256, int(n)) for n in rng.integers(20, 200, 8)])
    kw = dict(steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, data=str(corpus), timeout_s=120, **RECIPE)
    two, four = Cluster.local(2), Cluster.local(4)
    whole = launch(_program(gpt, PLANS["dp2"], two), two, **kw).wait()
    ref = reference_training(gpt, global_batch=8, **{k: v for k, v in kw.items() if k != "timeout_s"})
    assert _rel(whole.losses, ref.losses) <= 1e-5 and _rel(whole.grad_norms, ref.grad_norms) <= 1e-6
    assert _rel([whole.val_losses[k] for k in (1, 3)], [ref.val_losses[k] for k in (1, 3)]) <= 1e-5
    ck = tmp_path / "ck"
    # a 2-step run: its steps 0 and 1 have the 4-step run's learning rates (warmup 1, then the decay's first step
    # at the peak either way), so its checkpoint is the 4-step run's state after step 1
    launch(_program(gpt, PLANS["hetero_tp"], four), four, checkpoint_dir=ck, **{**kw, "steps": 2}).wait()
    resumed = launch(_program(gpt, PLANS["tp2"], two), two, resume_from=ck, **kw).wait()
    assert _rel(resumed.losses, whole.losses[2:]) <= 1e-5 and _rel(resumed.grad_norms, whole.grad_norms[2:]) <= 1e-6
