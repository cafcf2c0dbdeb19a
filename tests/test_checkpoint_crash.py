"""Crashes while a checkpoint is written, and checkpoints that do not match their files or the program.

A 2-rank TP2 job saves after every step (``keep=1``); at step 2's checkpoint one worker is SIGKILLed at one of the
named points of the write (:data:`~hspmd_sdk.runtime.checkpoints.checkpoint_io.WRITE_POINTS`, through ``launch``'s
``fault_injection``: the process kills itself with SIGKILL exactly there), rank 1 for its shard, rank 0 for the
manifest and the commit.  Each time: the job fails naming a rank, the latest complete checkpoint is step 1 (step 2
once the commit is done: ``before-prune``) and verifies, and training resumes from it — in one job on one rank
(another plan and world size), with the same losses as the single-device model, its new checkpoints pruning
what the crash left.

A corrupted, truncated or missing shard, a header that disagrees with the manifest, a manifest that does not tile
a tensor, another model, other data settings: each is refused before any worker starts, naming the file and the
tensor (or the setting).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hspmd_sdk import LlamaConfig  # noqa: E402
from hspmd_sdk.core.cluster import Cluster  # noqa: E402
from hspmd_sdk.core.specialize import specialize  # noqa: E402
from hspmd_sdk.core.strategy import Strategy  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.errors import PlanValidationError, RuntimeFailure  # noqa: E402
from hspmd_sdk.runtime import CheckpointError, load_checkpoint  # noqa: E402
from hspmd_sdk.runtime.checkpoints.checkpoint_io import WRITE_POINTS  # noqa: E402
from hspmd_sdk.runtime.control.train import start_runs, launch, reference_training, training_run  # noqa: E402

SEED, SEQ, LR, STEPS, CRASH_STEP = 5, 16, 1e-3, 3, 2
MODEL = LlamaConfig.preset("tiny")
TP2 = {"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, 3]}], "micro_batch_size": 4,
                      "num_micro_batches": 2}]}
ONE = {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 3]}], "micro_batch_size": 2,
                      "num_micro_batches": 4}]}
#: the rank killed at each point: rank 1 while it writes its shard, rank 0 (the committer) afterwards
KILLED = {"shard-partial": 1, "shard-renamed": 1, "manifest-partial": 0, "before-commit": 0, "before-prune": 0}


def _program(data: dict, world: int, model=MODEL):
    cluster = Cluster.local(world)
    return specialize(model, plan_from_strategy(model, Strategy.load(data), cluster), cluster), cluster


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Point -> (its checkpoint root, the failure); plus a pristine copy of a complete checkpoint."""
    base = tmp_path_factory.mktemp("crash")
    program, cluster = _program(TP2, 2)
    out = {}
    for point in WRITE_POINTS:
        root = base / point
        job = launch(program, cluster, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, checkpoint_dir=root,
                              checkpoint_every=1, keep=1, timeout_s=60,
                              fault_injection=[{"rank": KILLED[point], "step": CRASH_STEP, "at": point}])
        with pytest.raises(RuntimeFailure) as failure:
            job.wait(timeout=120)
        out[point] = (root, failure.value)
    pristine = base / "pristine"
    shutil.copytree(base / "shard-partial" / f"step-{CRASH_STEP - 1:08d}", pristine)
    leftovers = base / "leftovers"  # what a crash leaves and nothing else: no complete checkpoint
    leftovers.mkdir()
    for p in (base / "shard-partial").glob(".tmp-*"):
        shutil.copytree(p, leftovers / p.name)
    return {"points": out, "pristine": pristine, "leftovers": leftovers}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("point", WRITE_POINTS)
def test_a_crash_while_writing_leaves_the_previous_checkpoint(point: str, crashed: dict) -> None:
    root, failure = crashed["points"][point]
    assert failure.rank == KILLED[point] and "SIGKILL" in str(failure)
    committed = point == "before-prune"
    ck = load_checkpoint(root)  # the latest complete one, verified
    assert ck.step == (CRASH_STEP if committed else CRASH_STEP - 1)
    steps = sorted(p.name for p in root.glob("step-*"))
    assert steps == ([f"step-{CRASH_STEP - 1:08d}", f"step-{CRASH_STEP:08d}"] if committed  # not pruned yet
                     else [f"step-{CRASH_STEP - 1:08d}"])
    partial = list(root.glob(f".tmp-step-{CRASH_STEP:08d}-*"))
    assert len(partial) == (0 if committed else 1)
    if point == "shard-partial":  # rank 1 died with half of its shard in the temporary file
        tmp = partial[0] / "rank00001.safetensors.tmp"
        assert tmp.is_file() and not (partial[0] / "rank00001.safetensors").exists()
        full = (root / f"step-{CRASH_STEP - 1:08d}" / "rank00001.safetensors").stat().st_size
        assert tmp.stat().st_size < full
    if point in ("shard-renamed", "manifest-partial", "before-commit"):
        assert (partial[0] / "rank00001.safetensors").is_file()
    if point == "manifest-partial":
        assert (partial[0] / "manifest.json.tmp").is_file() and not (partial[0] / "manifest.json").exists()
    if point == "before-commit":
        assert (partial[0] / "manifest.json").is_file()


@pytest.fixture(scope="module")
def resumed(crashed: dict) -> dict:
    program, cluster = _program(ONE, 1)
    # from each root's latest checkpoint; after "before-prune" explicitly from the older step-1 directory, so that
    # the resumed run's checkpoint of step 2 replaces the one already there
    runs = [training_run(program, steps=STEPS, seed=SEED, seq_len=SEQ, lr=LR, cluster=cluster,
                         resume_from=root / f"step-{CRASH_STEP - 1:08d}" if point == "before-prune" else root,
                         checkpoint_dir=root, checkpoint_every=1, keep=1)
            for point, (root, _) in crashed["points"].items()]
    return {"result": start_runs(runs, cluster, timeout_s=60).wait(),
            "starts": [r["resume"]["step"] for r in runs]}


def test_training_resumes_after_every_crash_under_another_plan(crashed: dict, resumed: dict) -> None:
    ref = reference_training(MODEL, steps=STEPS, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR)
    for i, (point, (root, _)) in enumerate(crashed["points"].items()):
        start = resumed["starts"][i]
        assert start == CRASH_STEP - 1, point
        losses = resumed["result"].results[0]["runs"][i]["losses"]
        assert len(losses) == STEPS - start
        assert max(abs(a - b) / b for a, b in zip(losses, ref.losses[start:])) <= 1e-5, point
        # the resumed run's own checkpoint replaced everything: the crash's leftovers are pruned
        assert sorted(p.name for p in root.iterdir()) == [f"step-{STEPS:08d}"], point
        assert load_checkpoint(root).step == STEPS


# ---- refused before any worker starts ------------------------------------------------------------------------
@pytest.fixture()
def no_workers(monkeypatch: pytest.MonkeyPatch) -> list:
    """``launch_spec`` (what starts the workers) replaced by a stub that records its spec and refuses."""
    import hspmd_sdk.runtime.control.start as launcher  # where every worker start goes (launch_spec)

    calls: list = []

    def refuse(spec, *args, **kwargs):
        calls.append(spec)
        raise RuntimeError("a worker would have started")

    monkeypatch.setattr(launcher, "launch_spec", refuse)
    return calls


def _copy(crashed: dict, tmp_path: Path) -> Path:
    return Path(shutil.copytree(crashed["pristine"], tmp_path / "ck"))


def _refused(directory: Path, match: str, no_workers: list, error: type = CheckpointError, **options) -> None:
    from hspmd_sdk import launch
    from hspmd_sdk.runtime import launch as general_launch

    program, cluster = _program(ONE, 1, options.pop("model", MODEL))
    kwargs = {"steps": STEPS, "seed": SEED, "seq_len": SEQ, **options}
    for fn in (launch, general_launch):  # the general launcher forwards resume_from= to training
        with pytest.raises(error, match=match):
            fn(program, cluster, resume_from=directory, **kwargs)
    assert no_workers == []


def _piece(directory: Path, name: str) -> dict:
    manifest = json.loads((directory / "manifest.json").read_text())
    return manifest["tensors"][name]["pieces"][0]


def test_a_corrupted_shard_is_refused_naming_file_and_tensor(crashed: dict, tmp_path: Path, no_workers: list) -> None:
    ck = _copy(crashed, tmp_path)
    piece = _piece(ck, "layers.2.mlp.w1.exp_avg")
    data = bytearray((ck / piece["file"]).read_bytes())
    data[piece["offset"] + piece["nbytes"] // 2] ^= 0x40  # one bit of one element
    (ck / piece["file"]).write_bytes(bytes(data))
    _refused(ck, rf"{piece['file']}: tensor 'layers\.2\.mlp\.w1\.exp_avg' .*corrupted", no_workers)
    with pytest.raises(CheckpointError, match="corrupted"):
        load_checkpoint(ck)
    assert load_checkpoint(ck, verify=False).step == CRASH_STEP - 1  # opening without checking still works


def test_a_truncated_or_missing_shard_is_refused(crashed: dict, tmp_path: Path, no_workers: list) -> None:
    ck = _copy(crashed, tmp_path)
    path = ck / "rank00000.safetensors"
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size // 2])
    _refused(ck, rf"rank00000\.safetensors: truncated .* {size // 2} bytes, the manifest says {size}; tensor '", no_workers)
    path.unlink()
    _refused(ck, r"rank00000\.safetensors: missing shard file of rank 0 \(tensors ", no_workers)


def test_a_header_or_manifest_that_disagrees_is_refused(crashed: dict, tmp_path: Path, no_workers: list) -> None:
    ck = _copy(crashed, tmp_path)
    piece = _piece(ck, "layers.0.attn.wq")
    path = ck / piece["file"]
    raw = path.read_bytes()
    (a, b), (c, d) = piece["box"]
    old, new = f'"shape":[{b - a},{d - c}]'.encode(), f'"shape":[{d - c},{b - a}]'.encode()
    assert old != new and raw.count(old) >= 1
    key = f'"{piece["key"]}":{{"dtype":"F32",'.encode()
    at = raw.index(key) + len(key)
    assert raw[at:at + len(old)] == old
    path.write_bytes(raw[:at] + new + raw[at + len(old):])   # same length: only the header disagrees
    _refused(ck, rf"{piece['file']}: tensor 'layers\.0\.attn\.wq' \(key .*: the file holds dtype F32 shape "
                 rf"\[{d - c}, {b - a}\]", no_workers)
    ck2 = Path(shutil.copytree(crashed["pristine"], tmp_path / "ck2"))
    manifest = json.loads((ck2 / "manifest.json").read_text())
    manifest["tensors"]["final_norm.weight"]["shape"] = [32]
    (ck2 / "manifest.json").write_text(json.dumps(manifest))
    _refused(ck2, r"tensor 'final_norm\.weight': piece \[0:64\] is not inside its shape \(32,\)", no_workers)


def test_another_model_or_data_stream_is_refused(crashed: dict, no_workers: list) -> None:
    ck = crashed["pristine"]
    wider = LlamaConfig(**{**MODEL.model_dump(), "hidden_size": 128})
    _refused(ck, r"manifest\.json: the checkpoint's model is not the program's \(hidden_size: 64 \(checkpoint\) != "
                 r"128", no_workers, error=PlanValidationError, model=wider)
    _refused(ck, r"seq_len: is 8 but the checkpoint .* was trained with 16", no_workers, error=PlanValidationError,
             seq_len=8)
    _refused(ck, r"seed: is 6", no_workers, error=PlanValidationError, seed=SEED + 1)
    _refused(ck, r"steps: is the total step count \(1\) but the checkpoint .* has already completed 1", no_workers,
             error=PlanValidationError, steps=1)


def test_a_root_with_only_an_unfinished_write_is_refused(crashed: dict, no_workers: list, capsys) -> None:
    from hspmd_sdk.cli import main

    _refused(crashed["leftovers"], r"holds no complete checkpoint \(only the unfinished write\(s\) \['\.tmp-step-",
             no_workers)
    assert main(["checkpoint", "show", str(crashed["leftovers"])]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "no complete checkpoint" in err[0]
