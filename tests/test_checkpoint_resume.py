"""Save under one plan, resume under another (SPEC §5), on real worker processes (gloo, fp32).

Random pairs of strategies (:mod:`checkpoint_strategies`: any ranks, 1-3 pipelines, TP 1/2/4 per stage, ZeRO-1
on/off; Llama and GPT-2 alternating): plan A trains ``STEPS`` steps on a 4-rank cluster, saving after step
``K`` and after the last; plan B resumes from A's step-``K`` checkpoint on a **3-rank** cluster (another world
size) and runs steps ``K..STEPS-1``.  Two jobs in all (every A in one, every B in the other), so process start-up
is paid twice.

Checked against two independent references: the single-device model trained with ``torch.optim.Adam``
(:func:`~hspmd_sdk.runtime.control.train.reference_training`, which also returns Adam's moments) and A's own
uninterrupted run (its final shards captured by ``capture_dir``, assembled as in ``test_runtime_train``):

* B's losses equal both within 1e-5 (relative); B's final parameters and both Adam moments equal A's within 1e-6
  (norm) / 1e-5 (element-wise) — the resumed state is the saved state, only the plans' fp32 summation orders
  differ — and the reference's with the tolerances of ``test_runtime_train`` (see :func:`_close`);
* a pair with the same strategy on both sides is bit-for-bit: losses, parameters and moments identical;
* every rank of B read exactly the bytes of the boxes its new plan gives it (computed here from B's annotations),
  counted by the reader and by the kernel (``/proc/thread-self/io``), and less than the files hold when it holds
  only part of the model;
* a checkpoint holds every element once (its pieces are the model's bytes three times: parameters and two moments)
  and its ``state_dict()`` / ``optimizer_state_dict()`` equal A's assembled shards bit for bit;
* saving in the background writes the same bytes as saving in the training loop; ``keep`` prunes;
* ``to_hf`` of a checkpoint loads in ``transformers`` and computes the SDK reference's logits; the CLI shows and
  exports it.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from checkpoint_strategies import features, random_strategy  # noqa: E402
from hspmd_sdk import GPTConfig, LlamaConfig  # noqa: E402
from hspmd_sdk.core.annotation import local_view  # noqa: E402
from hspmd_sdk.core.cluster import Cluster  # noqa: E402
from hspmd_sdk.core.slices import box_numel  # noqa: E402
from hspmd_sdk.core.specialize import specialize  # noqa: E402
from hspmd_sdk.core.strategy import Strategy  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.models import param_shapes  # noqa: E402
from hspmd_sdk.runtime import load_checkpoint  # noqa: E402
from hspmd_sdk.runtime.control.train import (assemble, start_runs, load_captured, reference_training,  # noqa: E402
                                     training_run)

SEED, SEQ, LR, STEPS, K = 3, 16, 1e-3, 4, 2
SAVE_WORLD, RESUME_WORLD = 4, 3
PAIRS = 6
FAMILIES = (LlamaConfig, GPTConfig)
TOL, PARAM_TOL = 1e-5, 2e-5


def _pairs() -> list[dict]:
    rng = random.Random(13)
    out = []
    for i in range(PAIRS):
        model = FAMILIES[i % 2].preset("tiny")
        # pairs 2, 3 move onto more ranks, the others onto fewer
        grow = i % 4 >= 2
        a, pa = random_strategy(rng, model, SAVE_WORLD, ranks=(1, 2) if grow else (3, SAVE_WORLD))
        b, pb = random_strategy(rng, model, RESUME_WORLD, ranks=(3, 3) if grow else (1, 2))
        out.append({"model": model, "a": a, "pa": pa, "b": b, "pb": pb})
    # the same strategy on both sides (ranks 0-2 exist in both clusters): bit-for-bit
    model = LlamaConfig.preset("tiny")
    same = {"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, 1]}, {"devices": [2], "layers": [2, 3]}],
                           "micro_batch_size": 2, "num_micro_batches": 4}]}
    progs = [specialize(model, plan_from_strategy(model, Strategy.load(same), c), c)
             for c in (Cluster.local(SAVE_WORLD), Cluster.local(RESUME_WORLD))]
    out.append({"model": model, "a": same, "pa": progs[0], "b": same, "pb": progs[1], "same": True})
    return out


PAIR_IDS = [f"pair{i}" for i in range(PAIRS)] + ["same_plan"]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pairs = _pairs()
    root = tmp_path_factory.mktemp("ckpt")
    save, resume = Cluster.local(SAVE_WORLD), Cluster.local(RESUME_WORLD)
    common = {"steps": STEPS, "seed": SEED, "seq_len": SEQ, "lr": LR}
    runs = [training_run(p["pa"], **common, cluster=save, capture_dir=root / "cap_a",
                         checkpoint_dir=root / f"pair{i}", checkpoint_every=K) for i, p in enumerate(pairs)]
    # pair 0's plan again, saving in the training loop; and a run that saves every step, keeping 2
    runs.append(training_run(pairs[0]["pa"], **common, cluster=save, checkpoint_dir=root / "sync",
                             checkpoint_every=K, checkpoint_async=False))
    runs.append(training_run(pairs[1]["pa"], **common, cluster=save, checkpoint_dir=root / "keep2",
                             checkpoint_every=1, keep=2))
    saved = start_runs(runs, save, timeout_s=180).wait()
    runs_b = [training_run(p["pb"], **common, cluster=resume, capture_dir=root / "cap_b",
                           resume_from=root / f"pair{i}" / f"step-{K:08d}") for i, p in enumerate(pairs)]
    resumed = start_runs(runs_b, resume, timeout_s=180).wait()
    return {"pairs": pairs, "root": root, "saved": saved, "resumed": resumed}


@pytest.fixture(scope="module")
def references() -> dict:
    out = {}
    for cls in FAMILIES:
        model = cls.preset("tiny")
        out[model.family] = reference_training(model, steps=STEPS, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR)
    return out


def _assembled(root: Path, which: str, index: int, model) -> dict:
    captured = load_captured(root, index)
    shapes = param_shapes(model)
    out = {}
    for kind in ("params", "exp_avg", "exp_avg_sq"):
        full, spread = assemble(captured, kind, shapes)
        assert spread == 0.0, (which, kind)  # replicas agree exactly
        assert not any(torch.isnan(t).any() for t in full.values()), (which, kind, "an element held by no rank")
        out[kind] = full
    out["optimizer_step"] = {v for cap in captured for v in cap["optimizer_step"].values()}
    return out


def _max_rel(a, b, floor: float = 1e-30) -> float:
    return float((a - b).abs().max()) / max(float(b.abs().max()), floor)


def _norm_rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _close(got: dict, want: dict, initial: dict, kind: str, *, same_model_run: bool) -> None:
    """``got`` vs ``want`` (name -> tensor) for parameters or one Adam moment.

    Against the uninterrupted SDK run (``same_model_run``) only the plans' fp32 summation orders differ (measured
    <= 2e-7 relative): 1e-6 in norm, 1e-5 element-wise.  Against the single-device reference the bounds of
    ``test_runtime_train`` (norm 2e-5), with the element-wise bound at 5e-4 after 4 Adam steps instead of 3e-4
    after 3: Adam divides each update by the gradient's own magnitude, so near-cancelling gradient elements turn
    rounding into lr-sized differences, step after step (the uninterrupted run is as far: measured 3.3e-4 for both).
    Moments are running means of gradients and their squares: compared element-wise against at least 1e-4 of the
    model's largest (a gradient that vanishes in exact arithmetic, GPT-2's key bias, is noise on both sides)."""
    floor = 1e-4 * max(float(t.abs().max()) for t in want.values())
    elementwise, norm, moment = (1e-5, 1e-6, 1e-5) if same_model_run else (5e-4, PARAM_TOL, 1e-4)
    for name, w in want.items():
        g = got[name]
        if kind != "params":
            assert _max_rel(g, w, floor) <= moment, (kind, name, _max_rel(g, w, floor))
        elif float(w.abs().max()) == 0 or not bool(initial[name].any()):
            # a parameter that starts at zero (GPT-2's biases) is nothing but Adam's lr-sized updates, and GPT-2's key
            # bias gets none in exact arithmetic: Adam turns its rounding noise into moves of ~1e-3 lr on any plan
            assert float((g - w).abs().max()) <= 1e-2 * LR, name
        else:
            assert _norm_rel(g, w) <= norm, (name, _norm_rel(g, w))
            assert _max_rel(g, w) <= elementwise, (name, _max_rel(g, w))


def test_the_random_pairs_change_world_size_tp_pipelines_and_zero1(jobs: dict) -> None:
    pairs = [p for p in jobs["pairs"] if not p.get("same")]
    fa, fb = [features(p["a"]) for p in pairs], [features(p["b"]) for p in pairs]
    assert {p["model"].family for p in pairs} == {"llama", "gpt"}
    assert any(a["zero1"] != b["zero1"] for a, b in zip(fa, fb))
    assert any(a["pipelines"] != b["pipelines"] for a, b in zip(fa, fb))
    assert any(a["tp"] != b["tp"] for a, b in zip(fa, fb))
    assert any(len(a["ranks"]) < len(b["ranks"]) for a, b in zip(fa, fb))   # onto more ranks
    assert any(len(a["ranks"]) > len(b["ranks"]) for a, b in zip(fa, fb))   # onto fewer


@pytest.mark.parametrize("index", range(len(PAIR_IDS)), ids=PAIR_IDS)
def test_resumed_training_equals_the_uninterrupted_run(index: int, jobs: dict, references: dict) -> None:
    pair = jobs["pairs"][index]
    model = pair["model"]
    ref = references[model.family]
    a_losses = jobs["saved"].results[0]["runs"][index]["losses"]
    b_losses = jobs["resumed"].results[0]["runs"][index]["losses"]
    assert len(a_losses) == STEPS and len(b_losses) == STEPS - K
    for got, want in ((b_losses, ref.losses[K:]), (b_losses, a_losses[K:]), (a_losses, ref.losses)):
        assert max(abs(g - w) / abs(w) for g, w in zip(got, want)) <= TOL, (got, want)
    a = _assembled(jobs["root"] / "cap_a", "A", index, model)
    b = _assembled(jobs["root"] / "cap_b", "B", index, model)
    assert a["optimizer_step"] == b["optimizer_step"] == {float(STEPS)}
    initial = dict(model.build_reference(SEED).state_dict())
    for kind, want in (("params", ref.params), ("exp_avg", ref.exp_avg), ("exp_avg_sq", ref.exp_avg_sq)):
        _close(b[kind], want, initial, kind, same_model_run=False)   # against the single-device reference
        _close(b[kind], a[kind], initial, kind, same_model_run=True)  # against the uninterrupted run under plan A


def test_resume_under_the_same_plan_is_bit_for_bit(jobs: dict) -> None:
    index = PAIR_IDS.index("same_plan")
    a_losses = jobs["saved"].results[0]["runs"][index]["losses"]
    b_losses = jobs["resumed"].results[0]["runs"][index]["losses"]
    assert b_losses == a_losses[K:]
    model = jobs["pairs"][index]["model"]
    a = _assembled(jobs["root"] / "cap_a", "A", index, model)
    b = _assembled(jobs["root"] / "cap_b", "B", index, model)
    for kind in ("params", "exp_avg", "exp_avg_sq"):
        for name, t in a[kind].items():
            assert torch.equal(b[kind][name], t), (kind, name)


@pytest.mark.parametrize("index", range(len(PAIR_IDS)), ids=PAIR_IDS)
def test_each_rank_reads_only_the_bytes_of_its_boxes(index: int, jobs: dict) -> None:
    pb = jobs["pairs"][index]["pb"]
    ck_dir = jobs["root"] / f"pair{index}" / f"step-{K:08d}"
    data_bytes = sum(e.pieces[i].nbytes for e in load_checkpoint(ck_dir, verify=False).tensors.values()
                     for i in range(len(e.pieces)))
    files_bytes = sum(p.stat().st_size for p in ck_dir.glob("*.safetensors"))
    layouts = pb.state_layouts()
    for rank, res in jobs["resumed"].results.items():
        stats = res["runs"][index].get("resumed")
        if rank not in pb.ranks:
            assert stats is None
            continue
        assert stats["rng_restored"] == (rank in jobs["pairs"][index]["pa"].ranks)  # its RNG, if it had one
        held = set(pb.executable_graph(rank).parameters)
        boxes = [local_view(l.annotation, l.shape, rank).box for l in layouts.values() if l.param in held]
        want = 4 * sum(box_numel(b) for b in boxes)
        assert stats["bytes_read"] == stats["needed_bytes"] == want, (rank, stats, want)
        if stats["os_read_bytes"] is not None:  # the kernel's count of the reading thread's bytes
            assert stats["os_read_bytes"] == want, (rank, stats)
        assert want <= data_bytes < files_bytes
        if want < data_bytes:
            assert stats["os_read_bytes"] in (None, want)  # a part of the model: never a whole file


@pytest.mark.parametrize("index", range(PAIRS), ids=PAIR_IDS[:PAIRS])
def test_a_checkpoint_holds_each_element_once_and_equals_the_shards(index: int, jobs: dict) -> None:
    pair = jobs["pairs"][index]
    model = pair["model"]
    ck = load_checkpoint(jobs["root"] / f"pair{index}")  # the root: its latest checkpoint, verified
    assert ck.step == STEPS and ck.model == model
    total = 4 * sum(box_numel(tuple((0, d) for d in s)) for s in param_shapes(model).values())
    assert sum(p.nbytes for e in ck.tensors.values() for p in e.pieces) == 3 * total
    writers = {f.rank for f in ck.manifest.files.values()}
    assert writers == set(pair["pa"].ranks)  # a rank that holds no state writes nothing
    a = _assembled(jobs["root"] / "cap_a", "A", index, model)
    for name, t in ck.state_dict().items():
        assert torch.equal(t, a["params"][name]), name
    for name, st in ck.optimizer_state_dict().items():
        assert st["step"] == STEPS
        assert torch.equal(st["exp_avg"], a["exp_avg"][name]) and torch.equal(st["exp_avg_sq"], a["exp_avg_sq"][name])
    assert ck.data.next_step == STEPS and ck.data.seed == SEED and ck.data.global_batch == 8


def test_saving_in_the_background_writes_what_saving_in_the_loop_writes(jobs: dict) -> None:
    root = jobs["root"]
    for step in (K, STEPS):
        background = load_checkpoint(root / "pair0" / f"step-{step:08d}")
        in_loop = load_checkpoint(root / "sync" / f"step-{step:08d}")
        for name, t in in_loop.state_dict().items():
            assert torch.equal(background.state_dict()[name], t), (step, name)
        for name, st in in_loop.optimizer_state_dict().items():
            assert torch.equal(background.optimizer_state_dict()[name]["exp_avg_sq"], st["exp_avg_sq"]), name
    n = len(jobs["pairs"])
    for rank, res in jobs["saved"].results.items():
        bg, loop = res["runs"][0]["checkpoint"], res["runs"][n]["checkpoint"]
        assert bg["async"] and not loop["async"]
        assert [s["step"] for s in bg["saved"]] == [s["step"] for s in loop["saved"]] == [K, STEPS]


def test_keep_prunes_old_checkpoints(jobs: dict) -> None:
    root = jobs["root"] / "keep2"
    assert sorted(p.name for p in root.iterdir()) == [f"step-{STEPS - 1:08d}", f"step-{STEPS:08d}"]
    saved = jobs["saved"].results[0]["runs"][len(jobs["pairs"]) + 1]["checkpoint"]["saved"]
    assert [s["step"] for s in saved] == list(range(1, STEPS + 1))


@pytest.mark.parametrize("index", [0, 1], ids=["llama", "gpt"])
def test_to_hf_of_a_checkpoint_computes_the_sdk_logits_in_transformers(index: int, jobs: dict,
                                                                       tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ck = load_checkpoint(jobs["root"] / f"pair{index}")
    out = ck.to_hf(tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ref = ck.model.build_reference(0)
    ref.load_state_dict(ck.state_dict())
    tokens = torch.randint(0, ck.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(tokens)
        got = hf(tokens).logits
    assert _max_rel(got, want) <= 1e-5


def test_cli_shows_and_exports_a_checkpoint(jobs: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from hspmd_sdk.cli import main
    from hspmd_sdk.models import from_hf

    root = jobs["root"] / "pair0"
    assert main(["checkpoint", "show", str(root)]) == 0
    text = capsys.readouterr().out
    ck = load_checkpoint(root)
    assert f"step: {STEPS}" in text and "integrity: ok" in text and f"steps [{K}]" in text
    assert "pipeline 0: TP" in text
    # each rank's size as the file system has it (not the manifest's record), for exactly plan A's ranks (all hold
    # state); the files' data (past each one's 8-byte length and JSON header, read here) are the model's fp32
    # parameters and both Adam moments (3 x 4 bytes an element of the parameter shapes) and each rank's torch RNG state
    files = sorted(ck.path.glob("rank*.safetensors"))
    assert {int(f.stem[4:]) for f in files} == set(jobs["pairs"][0]["pa"].ranks)
    data = 0
    for f in files:
        assert f"rank {int(f.stem[4:])}: {f.stat().st_size:,} bytes" in text, f.name
        with f.open("rb") as fh:
            data += f.stat().st_size - 8 - int.from_bytes(fh.read(8), "little")
    assert data == (3 * 4 * sum(box_numel(tuple((0, d) for d in s)) for s in param_shapes(ck.model).values())
                    + len(files) * torch.get_rng_state().numel())
    assert main(["checkpoint", "export", str(root), "--hf", str(tmp_path / "out")]) == 0
    model, state = from_hf(tmp_path / "out")
    assert model.model_dump(exclude={"name"}) == ck.model.model_dump(exclude={"name"})
    for name, t in ck.state_dict().items():
        assert torch.equal(state[name], t), name
