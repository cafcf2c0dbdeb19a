"""The ``hspmd`` command line: exit codes, messages on stderr, summaries, help."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hspmd_sdk.cli import COMMANDS, main

EXAMPLES = Path(__file__).resolve().parent.parent / "hspmd_sdk" / "examples"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_validate_ok_with_explicit_context(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "validate", str(EXAMPLES / "table9_70b_16h800_24h20.json"), "--model", "llama-70b",
                         "--cluster", str(EXAMPLES / "paper_16h800_24h20.json"), "--global-batch", "64")
    assert code == 0 and out.startswith("OK: strategy") and "llama-70b" in out and err == ""


def test_validate_example_by_name_uses_its_index_context(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "validate", "table11_c2")
    assert code == 0 and "llama-32b" in out and "31 ranks" in out and "global batch 64" in out


def test_validate_cluster_and_plan_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = run(capsys, "validate", str(EXAMPLES / "h20_31.json"))
    assert code == 0 and out.startswith("OK: cluster")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"annotations": {"w": "[0,1] S0x2 | [2] R"}}))
    code, out, _ = run(capsys, "validate", str(plan))  # without a cluster its ranks are not checked: no "OK"
    assert code == 0 and out.startswith("schema OK: annotation plan") and "1 tensors" in out
    assert "not checked: ranks against a cluster (pass --cluster)" in out
    code, out, err = run(capsys, "validate", str(plan), "--cluster", "local_4")
    assert code == 0 and "fits Cluster(4 ranks" in out
    plan.write_text(json.dumps({"annotations": {"w": "[0,1] S0x2 | [2,7] D2"}}))
    code, out, err = run(capsys, "validate", str(plan), "--cluster", "local_4")
    assert code == 1 and "annotations.w.dg_union[1]: rank 7 is not in the cluster (4 ranks: 0..3)" in err


def test_validate_bad_strategy_prints_each_problem(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = json.loads((EXAMPLES / "table11_c1.json").read_text())
    bad["pipelines"][0]["stages"][3]["layers"] = [45, 58]
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(bad))
    code, out, err = run(capsys, "validate", str(f), "--model", "llama-32b", "--cluster",
                         str(EXAMPLES / "h20_31.json"))
    assert code == 1 and out == ""
    assert "  pipelines[0]: layers cover 0..58 but the model has 60 layers (0..59)" in err.splitlines()
    assert "  pipelines[1].stages[3].devices: rank 31 is not in the cluster (31 ranks: 0..30)" in err.splitlines()
    assert "Traceback" not in err


@pytest.mark.parametrize("content, fragment", [
    (None, "no such file"), ("{not json", "not valid JSON: line 1"), ("[1, 2]", "not a strategy, plan or cluster"),
    ('{"pipelines": 3}', "pipelines: Input should be a valid list"),
])
def test_validate_bad_inputs_exit_1_without_traceback(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                       content: str | None, fragment: str) -> None:
    f = tmp_path / "x.json"
    if content is not None:
        f.write_text(content)
    code, out, err = run(capsys, "validate", str(f))
    assert code == 1 and fragment in err and "Traceback" not in err


def test_show_strategy_lists_stages(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "show", str(EXAMPLES / "table11_c2.json"), "--model", "llama-32b",
                       "--cluster", str(EXAMPLES / "h20_31.json"))
    assert code == 0
    assert "pipeline 1: 31 micro-batches x bs1" in out and "stage 4: ranks 30" in out and "layers 56-59" in out
    assert "1xH20" in out and "GiB/rank" in out and "estimate" in out


def test_show_cluster_and_examples(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "show", "paper_16h800_32h20")
    assert code == 0 and "H800" in out and "ranks 16-23" in out
    code, out, _ = run(capsys, "examples")
    assert code == 0 and "table9_32b_16h800_16h20.json" in out


def test_demo_trains_and_matches_the_single_device_model(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "demo", "--steps", "2")
    assert code == 0 and "stage 0: ranks 0,1" in out
    worst = float(out.rstrip().rsplit(" ", 1)[-1])
    assert "largest relative loss difference" in out and worst < 1e-5


def _same_losses(rows: list[list[str]], column: int, reference: list[float]) -> bool:
    """The CLI's HSPMD column (printed to 6 decimals) against single-device losses computed in the test, not
    against the CLI's own "rel. diff" column."""
    return all(abs(float(r[column]) - reference[int(r[0])]) <= 1e-5 * abs(reference[int(r[0])]) + 1e-6 for r in rows)


def _tiny_reference(steps: int, data: str) -> list[float]:
    from hspmd_sdk import LlamaConfig
    from hspmd_sdk.runtime.control.train import reference_training

    return reference_training(LlamaConfig.preset("tiny"), steps=steps, seed=0, global_batch=4, data=data,
                              lr=3e-3).losses


def test_run_trains_a_strategy_file(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    strategy = {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 1]}, {"devices": [1], "layers": [2, 3]}],
                               "micro_batch_size": 2, "num_micro_batches": 2}], "schedule": "1f1b"}
    path = tmp_path / "pp2.json"
    path.write_text(json.dumps(strategy))
    code, out, _ = run(capsys, "run", str(path), "--local", "2", "--steps", "2", "--data", "synthetic")
    assert code == 0
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["0", "1"] and _same_losses(rows, 1, _tiny_reference(2, "synthetic")), out


def test_run_saves_checkpoints_and_resumes_under_another_strategy(tmp_path, capsys) -> None:
    pp2 = {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 1]}, {"devices": [1], "layers": [2, 3]}],
                          "micro_batch_size": 2, "num_micro_batches": 2}]}
    dp2 = {"pipelines": [{"stages": [{"devices": [r], "layers": [0, 3]}], "micro_batch_size": 2,
                          "num_micro_batches": 1} for r in (0, 1)]}
    for name, data in (("pp2", pp2), ("dp2", dp2)):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    ck = tmp_path / "ck"
    code, out, _ = run(capsys, "run", str(tmp_path / "pp2.json"), "--local", "2", "--steps", "2",
                       "--checkpoint-dir", str(ck), "--checkpoint-every", "1")
    assert code == 0 and sorted(p.name for p in ck.iterdir()) == ["step-00000001", "step-00000002"]
    code, out, _ = run(capsys, "run", str(tmp_path / "dp2.json"), "--local", "2", "--steps", "4",
                       "--resume-from", str(ck))
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert code == 0 and [r[0] for r in rows] == ["2", "3"] and _same_losses(rows, 1, _tiny_reference(4, "stdlib")), out


def test_run_mixed_length_data_from_the_planned_candidates(tmp_path, capsys) -> None:
    """``hspmd plan --scenario mixed --programs DIR`` then ``hspmd run --programs DIR``: per-step candidates on
    the standard library's documents, the losses the single-device model's on the same sequences; with
    checkpoints, and resumed from one."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(4 + (i * 37) % 61) for i in range(300)))
    code, out, _ = run(capsys, "plan", "--cluster", "cpu:4", "--model", "tiny", "--scenario", "mixed", "--lengths",
                       str(lengths), "--context-len", "64", "--tokens-per-batch", "256", "--programs",
                       str(tmp_path / "cands"), "--packing")  # priced as the packed rows the run trains
    assert code == 0 and (tmp_path / "cands" / "candidate_0.json").exists()
    ck = tmp_path / "ck"
    code, out, err = run(capsys, "run", "--programs", str(tmp_path / "cands"), "--local", "4", "--steps", "3",
                         "--tokens-per-step", "256", "--context", "64", "--checkpoint-dir", str(ck),
                         "--checkpoint-every", "1")
    assert code == 0, err
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    from hspmd_sdk import LlamaConfig
    from hspmd_sdk.runtime.control.mixed import reference_mixed

    ref = reference_mixed(LlamaConfig.preset("tiny"), steps=4, seed=0, data="stdlib-docs", tokens_per_step=256,
                          context=64, lr=3e-3).losses  # the single-device model on the same sequences
    assert [r[0] for r in rows] == ["0", "1", "2"] and _same_losses(rows, 2, ref), out
    assert "hidden behind training" in out and (ck / "step-00000002").is_dir()
    code, out, err = run(capsys, "run", "--programs", str(tmp_path / "cands"), "--local", "4", "--steps", "4",
                         "--tokens-per-step", "256", "--context", "64", "--resume-from", str(ck / "step-00000002"),
                         "--padding")  # resumed with padded micro-batches: the same sequences, the same losses
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert code == 0 and [r[0] for r in rows] == ["2", "3"] and _same_losses(rows, 2, ref), out


@pytest.mark.parametrize("argv", [["--help"]] + [[name, "--help"] for name in COMMANDS])
def test_help_everywhere(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0 and "usage: hspmd" in capsys.readouterr().out


def test_console_entry_point() -> None:
    """The installed ``hspmd`` script (or ``python -m hspmd_sdk.cli``) runs in a fresh process."""
    proc = subprocess.run([sys.executable, "-m", "hspmd_sdk.cli", "validate", "example_hetero_tiny"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("OK: strategy"), proc.stderr
    proc = subprocess.run([sys.executable, "-m", "hspmd_sdk.cli", "validate", "missing.json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "no such file" in proc.stderr and "Traceback" not in proc.stderr


def test_resolve_prints_kinds_and_volumes(capsys):
    from hspmd_sdk.cli import main

    assert main(["resolve", "[0,1,2,3] P4", "[0,1,2,3] S0x4", "--shape", "64,32", "--cluster", "local_4"]) == 0
    out = capsys.readouterr().out
    assert "kinds: ReduceScatter" in out
    # ring reduce-scatter: each rank sends (g-1)/g of its 64x32 fp32 input
    assert "R0: 6144 | 0" in out


def test_resolve_bad_annotation_is_a_clean_error(capsys):
    from hspmd_sdk.cli import main

    assert main(["resolve", "[0,1] X", "[0] R", "--shape", "8"]) == 1
    err = capsys.readouterr().err
    assert "cannot read DS token 'X'" in err and "Traceback" not in err


# ---- hspmd launch --slurm --------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, where, why", [
    (["--slurm", "--hostfile", "h.txt"], "--hostfile/--slurm", "give one of them"),
    ([], "--hostfile/--slurm", "--hostfile hosts.txt (SSH hosts) or --slurm"),
    (["--slurm", "-i", "key"], "--identity", "applies to SSH hosts, not to --slurm"),
    (["--hostfile", "h.txt", "--partition", "gpu"], "--partition", "applies to --slurm"),
])
def test_launch_says_where_to_run_before_anything_starts(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                         where: str, why: str) -> None:
    """``--slurm`` and ``--hostfile`` are the two ways to say where: exactly one, each with its own options; the
    mistake is refused (exit 1, the flag named) before a file is read or a scheduler asked."""
    code, out, err = run(capsys, "launch", "example_hetero_tiny", *argv)
    assert code == 1 and out == "" and f"  {where}: " in err and why in err and "Traceback" not in err, err


#: one data-parallel replica per Slurm node (an H800 node and an H20 node, one GPU each)
SLURM_DP2 = {"pipelines": [{"stages": [{"devices": [r], "layers": [0, 3]}], "micro_batch_size": 4,
                            "num_micro_batches": 1} for r in (0, 1)]}


@pytest.fixture(scope="module")
def slurm_lab():  # type: ignore[no-untyped-def]
    from _needs import skip_or_fail
    from hspmd_sdk.testing.slurm import LocalSlurm, SlurmNode, slurm_unavailable

    skip_or_fail(slurm_unavailable(), "the Slurm tests (a local Slurm: root, slurm-wlm, munge)")
    with LocalSlurm([SlurmNode("n1", "H800", gpus=1, cpus=2, memory_mb=4000),
                     SlurmNode("n2", "H20", gpus=1, cpus=2, memory_mb=4000)], partition="lab") as lab:
        yield lab


@pytest.mark.timeout(150)
def test_launch_slurm_trains_on_the_nodes_slurm_has(slurm_lab, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``hspmd launch STRATEGY --slurm --partition P`` over a real Slurm (LocalSlurm): the cluster is read from the
    scheduler, each rank runs as a job step on its node, the printed losses are the single-device model's; ``--check``
    gets the allocations and gives them back; an unknown partition is a one-line error.  Nothing is left in Slurm."""
    pytest.importorskip("torch")
    from hspmd_sdk import LlamaConfig
    from hspmd_sdk.runtime.control.train import reference_training

    for k, v in slurm_lab.env.items():
        monkeypatch.setenv(k, v)
    (tmp_path / "s.json").write_text(json.dumps(SLURM_DP2))
    code, out, err = run(capsys, "launch", str(tmp_path / "s.json"), "--slurm", "--partition", "lab", "--check")
    assert code == 0 and "n1 (1 H800), n2 (1 H20)" in out and "preflight OK: n1: allocation" in out, err
    code, out, err = run(capsys, "launch", str(tmp_path / "s.json"), "--slurm", "--partition", "lab", "--backend",
                         "gloo", "--steps", "3", "--seed", "5", "--seq-len", "16", "--quiet", "--heartbeat", "0.5",
                         "--timeout", "90")
    assert code == 0, err
    losses = [float(x) for x in out.split("losses: ")[1].split("\n")[0].split()]
    reference = reference_training(LlamaConfig.preset("tiny"), steps=3, seed=5, global_batch=8, seq_len=16)
    assert losses == pytest.approx(reference.losses, rel=1e-5, abs=0)
    assert "2 ranks on 2 hosts" in out
    code, out, err = run(capsys, "launch", str(tmp_path / "s.json"), "--slurm", "--partition", "nosuch")
    assert code == 1 and "error:" in err and "nosuch" in err and "Traceback" not in err, err
    squeue = subprocess.run(["squeue", "-h"], capture_output=True, text=True, timeout=30)
    assert squeue.returncode == 0 and squeue.stdout == ""


def test_validate_show_and_resolve_take_cluster_counts_as_plan_and_simulate_do(capsys) -> None:
    """Issue 48 item 4: ``--cluster H800:16,H20:16`` (the form ``plan`` and ``simulate`` take) everywhere: the
    counts make the cluster ``Cluster.mixed`` makes, and a bad count is one error line naming --cluster."""
    from hspmd_sdk.core.cluster import Cluster

    strategy = str(EXAMPLES / "table9_32b_16h800_16h20.json")
    code, out, err = run(capsys, "validate", strategy, "--model", "llama-32b", "--cluster", "H800:16,H20:16",
                         "--global-batch", "64")
    assert code == 0 and out.startswith("OK: strategy") and err == "", err
    assert str(Cluster.mixed({"H800": 16, "H20": 16})) in out
    code, out, err = run(capsys, "show", strategy, "--model", "llama-32b", "--cluster", "H800:16,H20:16")
    assert code == 0 and "[4xH800]" in out and "[4xH20]" in out and "GiB/rank" in out, (out, err)
    code, out, err = run(capsys, "resolve", "[0,1] S0x2", "[0,1] D2", "--shape", "64,64", "--cluster", "H800:2")
    assert code == 0 and "estimated time on Cluster(2 ranks" in out, (out, err)
    code, out, err = run(capsys, "resolve", "[0,1] S0x3", "[0,1] D2", "--shape", "64,64")  # worded, no pydantic
    assert code == 1 and "SRC: dg_union[0] has 2 devices" in err and "pydantic" not in err, err
    code, out, err = run(capsys, "validate", strategy, "--cluster", "H800:lots")
    assert code == 1 and err.startswith("error:") and "--cluster" in err and "KIND:COUNT" in err, err
