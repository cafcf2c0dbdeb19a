"""Checkpoints that never race and never load silently wrong (issue 24, items 3 and 4).

A checkpoint root belongs to one job at a time (:mod:`hspmd_sdk.runtime.checkpoints.checkpoint_lock`): while a 2-rank job
saves into a root every step, a second job given the same root is refused before any worker starts, naming the
first's job id, host and process id; the first completes with every checkpoint intact and verified; once it ended
its lock is gone and a job resuming from the same root (and writing into it) starts and trains exactly as the
uninterrupted single-device model.  A lock whose owner process is gone is refused too (the message says how to
take it over) and taken over by ``break_checkpoint_lock``; a live owner's only with ``force=True``.  Pruning
touches only the job's own checkpoints: a fresh job with ``keep=1`` in a root holding another job's newer
checkpoint leaves it alone.

The manifest is sealed (a SHA-256 per field) and cross-checked (its directory's name, the data position and
Adam's step count against ``step``): an edited ``step`` (3 -> 2), ``optimizer_step`` (3 -> 1), Adam learning rate,
a consistent forgery of all the step fields with the directory renamed, a removed seal: each is refused by
``load_checkpoint`` (also without ``verify``) and by ``launch(..., resume_from=)`` before any worker starts,
naming the manifest file and the field.  A format version 1 manifest (no seal) opens with the cross-checks only.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hspmd_sdk import LlamaConfig  # noqa: E402
from hspmd_sdk.core.cluster import Cluster  # noqa: E402
from hspmd_sdk.core.specialize import specialize  # noqa: E402
from hspmd_sdk.core.strategy import Strategy  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.runtime import CheckpointError, load_checkpoint  # noqa: E402
from hspmd_sdk.runtime.checkpoints.checkpoint import (MANIFEST, CheckpointLocked, break_checkpoint_lock,  # noqa: E402
                                          list_checkpoints, step_dir_name)
from hspmd_sdk.runtime.checkpoints.checkpoint_lock import (LOCK_FILE, acquire_checkpoint_lock, owner_alive,  # noqa: E402
                                               read_checkpoint_lock, LockOwner)
from hspmd_sdk.runtime.control.train import launch, reference_training  # noqa: E402

SEED, SEQ, LR, STEPS = 5, 16, 1e-3, 3
MODEL = LlamaConfig.preset("tiny")
TP2 = {"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, 3]}], "micro_batch_size": 4,
                      "num_micro_batches": 2}]}
ONE = {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 3]}], "micro_batch_size": 2,
                      "num_micro_batches": 4}]}
KW = {"seed": SEED, "seq_len": SEQ, "lr": LR, "timeout_s": 60}


def _program(data: dict, world: int):
    cluster = Cluster.local(world)
    return specialize(MODEL, plan_from_strategy(MODEL, Strategy.load(data), cluster), cluster), cluster


def _no_workers(monkeypatch: pytest.MonkeyPatch) -> list:
    """``launch_spec`` (what starts the workers) replaced by a stub that records its spec and refuses."""
    import hspmd_sdk.runtime.control.start as launcher  # where every worker start goes (launch_spec)

    calls: list = []

    def refuse(spec, *args, **kwargs):
        calls.append(spec)
        raise RuntimeError("a worker would have started")

    monkeypatch.setattr(launcher, "launch_spec", refuse)
    return calls


@pytest.fixture()
def no_workers(monkeypatch: pytest.MonkeyPatch) -> list:
    return _no_workers(monkeypatch)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture(scope="module")
def reference():
    return reference_training(MODEL, steps=STEPS + 1, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root with one 1-rank job's checkpoints of steps 1..3 (sealed, untouched)."""
    root = tmp_path_factory.mktemp("saved") / "root"
    program, cluster = _program(ONE, 1)
    launch(program, cluster, steps=STEPS, checkpoint_dir=root, checkpoint_every=1, keep=STEPS,
                    **KW).wait(timeout=90)
    return root


# ---- one job at a time ----------------------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_a_second_job_on_the_same_root_is_refused_and_the_first_keeps_every_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference) -> None:
    from hspmd_sdk import launch

    root = tmp_path / "ckpt"
    program, cluster = _program(TP2, 2)
    first = launch(program, cluster, steps=STEPS, checkpoint_dir=root, checkpoint_every=1, keep=STEPS, **KW)
    try:
        owner = read_checkpoint_lock(root)
        assert owner is not None and (owner.job_id, owner.host, owner.pid) == (first.job_id, socket.gethostname(),
                                                                              os.getpid())
        calls = _no_workers(monkeypatch)
        one, one_cluster = _program(ONE, 1)
        for fn in (launch, launch):
            with pytest.raises(CheckpointLocked, match=rf"checkpoint_dir {root}: in use by job {first.job_id} "
                                                       rf"\(host {socket.gethostname()}, pid {os.getpid()}, since "):
                fn(one, one_cluster, steps=STEPS, checkpoint_dir=root, **KW)
        assert calls == []  # refused before any worker started
        assert read_checkpoint_lock(root) == owner  # the refused job did not touch the lock
        monkeypatch.undo()
        result = first.wait(timeout=90)
    finally:
        first.cancel()
    assert [s for s, _ in list_checkpoints(root)] == [1, 2, 3]  # every checkpoint of the first job, intact
    for step, path in list_checkpoints(root):
        ck = load_checkpoint(path)  # verified: files, checksums, seal
        assert ck.step == step and ck.manifest.job_id == first.job_id
    assert sorted(p.name for p in root.iterdir()) == [step_dir_name(s) for s in (1, 2, 3)]  # lock released
    assert max(abs(a - b) / b for a, b in zip(result.losses, reference.losses)) <= 1e-5

    # the first job ended: a job resuming from the root (and saving into it) starts; it trains on exactly as the
    # uninterrupted single-device model, and its keep=1 prunes the training it continues (the first job's)
    again = launch(one, one_cluster, steps=STEPS + 1, resume_from=root, checkpoint_dir=root,
                            checkpoint_every=1, keep=1, **KW)
    assert read_checkpoint_lock(root).job_id == again.job_id
    losses = again.wait(timeout=90).losses
    assert len(losses) == 1 and abs(losses[0] - reference.losses[STEPS]) / reference.losses[STEPS] <= 1e-5
    assert sorted(p.name for p in root.iterdir()) == [step_dir_name(STEPS + 1)]
    assert load_checkpoint(root).manifest.job_id == again.job_id


def test_a_dead_owners_lock_is_refused_then_taken_over_explicitly(tmp_path: Path, no_workers: list) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    pid = _dead_pid()
    (root / LOCK_FILE).write_text(json.dumps({"job_id": "093000-dead01", "host": socket.gethostname(), "pid": pid,
                                              "started": "2026-01-01T09:30:00Z"}))
    program, cluster = _program(ONE, 1)
    with pytest.raises(CheckpointLocked, match=rf"in use by job 093000-dead01 \(host {socket.gethostname()}, pid "
                                               rf"{pid}, .*whose process is gone .*break_checkpoint_lock\("
                                               rf"'{root}'\)") as refused:
        launch(program, cluster, steps=STEPS, checkpoint_dir=root, **KW)
    assert refused.value.alive is False and refused.value.owner.job_id == "093000-dead01"
    # the message names the function by its public name, and that name is importable as written (issue 48 item 4)
    said = str(refused.value).split("take it over with ", 1)[1].split("(", 1)[0]
    assert said == "hspmd_sdk.runtime.break_checkpoint_lock", said
    import importlib

    module, _, name = said.rpartition(".")
    assert getattr(importlib.import_module(module), name) is break_checkpoint_lock
    assert no_workers == []
    assert break_checkpoint_lock(root).job_id == "093000-dead01"
    assert not (root / LOCK_FILE).exists()
    # taken over: the launch gets as far as starting the workers (the stub refuses), and its lock is released
    with pytest.raises(RuntimeError, match="a worker would have started"):
        launch(program, cluster, steps=STEPS, checkpoint_dir=root, **KW)
    assert len(no_workers) == 1 and not (root / LOCK_FILE).exists()
    assert break_checkpoint_lock(root) is None  # nothing to take over


def test_a_live_or_remote_owner_is_taken_over_only_by_force(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    held = acquire_checkpoint_lock(root, job_id="101010-live01")
    with pytest.raises(CheckpointLocked, match=rf"in use by job 101010-live01 .*pid {os.getpid()}.*wait for it to "
                                               "end or cancel it"):
        break_checkpoint_lock(root)
    assert break_checkpoint_lock(root, force=True).job_id == "101010-live01"
    held.release()  # no longer its lock: nothing happens
    assert not (root / LOCK_FILE).exists()
    (root / LOCK_FILE).write_text(json.dumps({"job_id": "111111-far001", "host": "another-host.invalid",
                                              "pid": os.getpid()}))
    with pytest.raises(CheckpointLocked, match=r"cannot be checked from .*force=True\)"):
        break_checkpoint_lock(root)
    assert break_checkpoint_lock(root, force=True).host == "another-host.invalid"
    assert not (root / LOCK_FILE).exists()
    # a pid reused by a later process is not the owner
    reused = LockOwner(job_id="x", host=socket.gethostname(), pid=os.getpid(), process_start="1")
    assert owner_alive(reused) is (False if Path("/proc/self/stat").exists() else True)


@pytest.mark.timeout(120)
def test_pruning_touches_only_the_jobs_own_checkpoints(saved: Path, tmp_path: Path) -> None:
    root = Path(shutil.copytree(saved, tmp_path / "root"))
    other = load_checkpoint(root / step_dir_name(STEPS)).manifest.job_id
    program, cluster = _program(ONE, 1)
    job = launch(program, cluster, steps=2, checkpoint_dir=root, checkpoint_every=1, keep=1, **KW)
    job.wait(timeout=90)
    found = {s: load_checkpoint(p).manifest.job_id for s, p in list_checkpoints(root)}
    # its own step 1 pruned (keep=1), its step 2 kept; the other job's newer step 3 untouched
    assert found == {2: job.job_id, STEPS: other}


# ---- the sealed manifest --------------------------------------------------------------------------------------
def _edited(saved: Path, tmp_path: Path, edit, name: str = step_dir_name(STEPS)) -> Path:
    """A copy of the step-3 checkpoint with its manifest edited by ``edit(dict)``, in a directory ``name``."""
    ck = Path(shutil.copytree(saved / step_dir_name(STEPS), tmp_path / "root" / name))
    data = json.loads((ck / MANIFEST).read_text())
    edit(data)
    (ck / MANIFEST).write_text(json.dumps(data, indent=1))
    return ck


def _refused(ck: Path, match: str, no_workers: list) -> None:
    from hspmd_sdk import launch

    for fn in (lambda: load_checkpoint(ck), lambda: load_checkpoint(ck, verify=False),
               lambda: load_checkpoint(ck.parent)):
        with pytest.raises(CheckpointError, match=match):
            fn()
    program, cluster = _program(ONE, 1)
    for fn in (launch, launch):
        with pytest.raises(CheckpointError, match=match):
            fn(program, cluster, steps=STEPS + 1, resume_from=ck, **KW)
    assert no_workers == []


def _set(path: str, value):
    def edit(data: dict) -> None:
        *head, last = path.split(".")
        d = data
        for k in head:
            d = d[k]
        d[last] = value
    return edit


def test_an_edited_step_is_refused(saved: Path, tmp_path: Path, no_workers: list) -> None:
    ck = _edited(saved, tmp_path, _set("step", STEPS - 1))
    _refused(ck, rf"{ck / MANIFEST}: field 'step' is 2 but the checkpoint's directory is step-00000003", no_workers)


def test_an_edited_optimizer_step_is_refused(saved: Path, tmp_path: Path, no_workers: list) -> None:
    ck = _edited(saved, tmp_path, _set("optimizer_step", 1))
    _refused(ck, rf"{ck / MANIFEST}: field 'optimizer_step' is 1 but 'step' is 3 \(Adam", no_workers)


def test_an_edited_data_position_is_refused(saved: Path, tmp_path: Path, no_workers: list) -> None:
    ck = _edited(saved, tmp_path, _set("data.next_step", 1))
    _refused(ck, rf"{ck / MANIFEST}: field 'data.next_step' is 1 but 'step' is 3", no_workers)


def test_an_edited_learning_rate_breaks_the_seal(saved: Path, tmp_path: Path, no_workers: list) -> None:
    ck = _edited(saved, tmp_path, _set("adam.lr", 0.5))
    _refused(ck, rf"{ck / MANIFEST}: field 'adam' differs from what was written \(SHA-256", no_workers)


def test_a_consistent_forgery_breaks_the_seal(saved: Path, tmp_path: Path, no_workers: list) -> None:
    def forge(data: dict) -> None:
        data["step"] = data["optimizer_step"] = data["data"]["next_step"] = STEPS - 1
    ck = _edited(saved, tmp_path, forge, name=step_dir_name(STEPS - 1))  # every cross-check agrees
    _refused(ck, rf"{ck / MANIFEST}: fields 'step', 'optimizer_step', 'data' differ from what was written",
             no_workers)


def test_a_removed_seal_is_refused(saved: Path, tmp_path: Path, no_workers: list) -> None:
    ck = _edited(saved, tmp_path, lambda d: d.pop("sha256"))
    _refused(ck, rf"{ck / MANIFEST}: field 'sha256' \(the manifest's seal\) is missing", no_workers)


def test_a_version_1_manifest_opens_with_the_cross_checks_only(saved: Path, tmp_path: Path, no_workers: list
                                                               ) -> None:
    def older(data: dict) -> None:
        data.pop("sha256")
        data["version"] = 1
    ck = _edited(saved, tmp_path, older)
    opened = load_checkpoint(ck)  # verified: files and checksums
    assert opened.step == STEPS and not opened.sealed
    assert "format version 1, written before manifest checksums" in opened.summary(verified=True)
    assert load_checkpoint(saved).sealed and "format version" not in load_checkpoint(saved).summary()
    shutil.rmtree(ck)
    ck = _edited(saved, tmp_path, lambda d: (older(d), d.update(optimizer_step=1)))
    _refused(ck, rf"{ck / MANIFEST}: field 'optimizer_step' is 1", no_workers)
