"""Issue 27 (an honest first hour): what the CLI, ``Strategy.summary`` and the editor say is true and actionable.

* the global-batch advice names the global batch when micro-batching cannot help, and the editor's first plan
  pins a batch that pipelines can share;
* ``hspmd validate`` says what it could not check, and reports memory together with the other problems;
  ``hspmd show`` marks a stage that exceeds its device;
* one unit convention: memory in GiB (binary), bandwidth in GB/s, parameter counts in K/M/B; local CPU workers
  are not described as NVLinked;
* ``hspmd run`` names the cause of a mismatch first, and piped it prints no carriage-return progress.

Expected numbers are computed here from the model's and the devices' definitions (Table 7: an H800 has 81559 MiB
as nvidia-smi reports it), never read back from the implementation.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hspmd_sdk.cli import main

EXAMPLES = Path(__file__).resolve().parent.parent / "hspmd_sdk" / "examples"

#: Table 7 / nvidia-smi: device memory in MiB.
H800_MIB, H20_MIB, CPU_MIB = 81559, 97871, 8192
#: Llama presets' shapes (Llama-2 style, untied LM head): hidden, ffn, vocab; kv heads equal heads in both.
LLAMA_32B = dict(hidden=6656, ffn=17920, vocab=50304, layers=60, seq=4096)
TINY = dict(hidden=64, ffn=128, vocab=256, layers=4, seq=64)


def gib(mib: int) -> str:
    """Device memory as every display must write it."""
    return f"{mib / 1024:.1f} GiB"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


#: What a GPU holds besides the plan's tensors (CUDA context and allocator slack), which every display adds.
GPU_RUNTIME = 2 * 2**30


def llama_stage_bytes(m: dict[str, int], layers: int, *, first: bool, last: bool, tp: int, mbs: int,
                      in_flight: int, zero1_dp: int = 1, runtime: float = GPU_RUNTIME) -> float:
    """Bytes a rank of a Llama stage needs, from the model's shapes (MHA, SwiGLU, RMSNorm, untied head):
    16 bytes a parameter (bf16 weight and gradient, fp32 master, m, v; ZeRO-1 divides the 12 fp32 bytes),
    bf16 activations of ``6h + 2h + 3 ffn`` values a token and layer for ``in_flight`` micro-batches, on a last
    stage the head's bf16 input (``h`` values a token, in flight) and the fp32 logits and their gradient
    (``2 vocab`` values a token over TP, one micro-batch at a time), and the device's ``runtime``."""
    h, f, v = m["hidden"], m["ffn"], m["vocab"]
    per_layer = 4 * h * h + 3 * h * f + 2 * h
    params = layers * per_layer + (v * h if first else 0) + (v * h + h if last else 0)
    states = params / tp * (4 + 12 / zero1_dp)
    tokens = mbs * m["seq"]
    acts = layers * tokens * (6 * h + 2 * h + 3 * f) * 2 / tp * in_flight
    head = tokens * h * 2 * in_flight + 2 * tokens * v * 4 / tp if last else 0
    return states + acts + head + runtime


def write(tmp_path: Path, name: str, data: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def two_pipelines(samples: tuple[int, int] = (1, 1)) -> dict:
    return {"pipelines": [{"stages": [{"devices": [i], "layers": [0, 3]}], "micro_batch_size": 1,
                           "num_micro_batches": n} for i, n in enumerate(samples)]}


# ---- 1. the global batch -------------------------------------------------------------------------------------
def test_advice_names_the_global_batch_when_micro_batches_cannot_fix_it(capsys, tmp_path) -> None:
    """Two pipelines cannot share one sample whatever their micro-batches: the message must not advise changing
    them, and must name the global batch, the minimum and where it is set."""
    code, out, err = run(capsys, "validate", write(tmp_path, "dp2.json", two_pipelines()), "--model", "tiny",
                         "--cluster", "local_4", "--global-batch", "1")
    assert code == 1 and out == ""
    assert "num_micro_batches or micro_batch_size" not in err
    assert "raise the global batch to at least 2" in err
    assert "global batch box" in err and "--global-batch" in err and "global_batch=" in err


def test_advice_when_micro_batches_can_add_up_proposes_a_split_and_names_the_global_batch(capsys, tmp_path) -> None:
    code, _, err = run(capsys, "validate", write(tmp_path, "dp2.json", two_pipelines((3, 1))), "--model", "tiny",
                       "--cluster", "local_4", "--global-batch", "6")
    assert code == 1 and "change num_micro_batches or micro_batch_size so the pipelines add up to 6" in err
    assert "e.g. 3 x bs1 in each pipeline" in err and "or change the global batch" in err
    split = two_pipelines((3, 3))  # the split proposed is valid
    code, out, _ = run(capsys, "validate", write(tmp_path, "ok.json", split), "--model", "tiny", "--cluster",
                       "local_4", "--global-batch", "6")
    assert code == 0 and out.startswith("OK:")


def test_the_editors_first_plan_pins_a_batch_a_second_pipeline_can_share() -> None:
    """The README's flow: no strategy, no global batch.  The first valid plan used to pin 1 sample, and a second
    pipeline could then never be valid; now the draft carries a sample per device of the cluster."""
    from hspmd_sdk.core.cluster import Cluster
    from hspmd_sdk.viz import PlanEditor

    cluster = Cluster.local(4)
    ed = PlanEditor(cluster, "tiny", seq_len=16, background=False)
    ed.set_devices(0, 0, [0, 1])
    assert ed.is_valid and ed.global_batch == 4 and ed.batch_source == "the first valid plan"
    ed.add_pipeline()
    ed.set_devices(1, 0, [2, 3])
    [err] = ed.errors
    assert "global batch is 4" in err.message and "e.g. 2 x bs1 in each pipeline" in err.message
    ed.set_micro_batches(0, num_micro_batches=2)
    ed.set_micro_batches(1, num_micro_batches=2)
    assert ed.is_valid and ed.strategy.dp_degree == 2
    ed.close()


# ---- 2. validate and show ------------------------------------------------------------------------------------
#: llama-32b on the paper's 16 H800 + 16 H20: stage 0 (TP1 on H800 rank 0) holds 30 layers and the embedding,
#: stage 1 (TP3 on H20) layers 30..58: TP3 does not divide 64 heads, layer 59 is not covered.
BROKEN = {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 29]}, {"devices": [16, 17, 18], "layers": [30, 58]}],
                         "micro_batch_size": 1, "num_micro_batches": 8}]}


def test_validate_without_context_says_what_it_did_not_check(capsys, tmp_path) -> None:
    """Exit 0: no problem was *found* (exit 1 means "problems found", each listed; a strategy file is a legitimate
    thing to check on its own, e.g. before a cluster exists).  But the output must not claim "OK" for what it did
    not check: it says "schema OK" and names the checks that need --model / --cluster."""
    code, out, err = run(capsys, "validate", write(tmp_path, "broken.json", BROKEN))
    assert code == 0 and err == ""
    head, rest = out.splitlines()[0], "\n".join(out.splitlines()[1:])
    assert head.startswith("schema OK: strategy") and not out.startswith("OK")
    assert rest.startswith("not checked:")
    for words in ("TP degrees", "layer coverage", "placement", "memory per rank", "--model", "--cluster"):
        assert words in rest, words
    code, out, _ = run(capsys, "validate", write(tmp_path, "dp2.json", two_pipelines()), "--model", "tiny")
    assert code == 0 and out.startswith("schema OK") and "fits tiny" in out  # what was checked, and only
    assert "placement" in out and "memory per rank" in out and "TP degrees" not in out  # what was not


def test_validate_reports_memory_together_with_the_other_problems(capsys, tmp_path) -> None:
    code, out, err = run(capsys, "validate", write(tmp_path, "broken.json", BROKEN), "--model", "llama-32b",
                         "--cluster", "paper_16h800_16h20")
    assert code == 1 and out == ""
    lines = err.splitlines()
    assert "  pipelines[0]: layers cover 0..58 but the model has 60 layers (0..59)" in lines
    assert any(line.startswith("  pipelines[0].stages[1].devices: TP degree 3") for line in lines)
    [mem] = [line for line in lines if line.startswith("  pipelines[0].stages[0]: needs ~")]
    want = llama_stage_bytes(LLAMA_32B, 30, first=True, last=False, tp=1, mbs=1, in_flight=2)  # 1F1B, 2 stages
    assert f"needs ~{want / 2**30:.1f} GiB/rank" in mem and f"H800 devices have {gib(H800_MIB)}" in mem
    assert want > H800_MIB * 2**20  # the premise: it does not fit


def test_show_marks_a_stage_that_exceeds_its_device(capsys, tmp_path) -> None:
    code, out, _ = run(capsys, "show", write(tmp_path, "broken.json", BROKEN), "--model", "llama-32b",
                       "--cluster", "paper_16h800_16h20")
    assert code == 0
    [s0] = [line for line in out.splitlines() if "stage 0:" in line]
    [s1] = [line for line in out.splitlines() if "stage 1:" in line]
    want0 = llama_stage_bytes(LLAMA_32B, 30, first=True, last=False, tp=1, mbs=1, in_flight=2)
    want1 = llama_stage_bytes(LLAMA_32B, 29, first=False, last=True, tp=3, mbs=1, in_flight=1)
    # the estimate (tensors and the GPU's runtime), the tensors beside it
    assert s0.endswith(f"~{want0 / 2**30:.1f} GiB/rank (tensors {(want0 - GPU_RUNTIME) / 2**30:.1f} GiB) — "
                       f"exceeds H800's {gib(H800_MIB)}")
    assert want1 < H20_MIB * 2**20  # fits: no mark
    assert s1.endswith(f"~{want1 / 2**30:.1f} GiB/rank (tensors {(want1 - GPU_RUNTIME) / 2**30:.1f} GiB)")
    assert "1 stage exceeds its devices' memory" in out


# ---- 6. units ------------------------------------------------------------------------------------------------
def test_one_memory_convention_in_cli_summary_and_editor(capsys) -> None:
    """The H800 is 79.6 GiB in the cluster summary, the strategy summary, the editor's node line and tiles."""
    from hspmd_sdk.core.cluster import Cluster
    from hspmd_sdk.viz import PlanEditor
    from hspmd_sdk.viz._canvas_view import canvas_view, cluster_view

    code, out, _ = run(capsys, "show", "paper_16h800_16h20")
    assert code == 0 and f"H800: {gib(H800_MIB)}," in out and f"H20: {gib(H20_MIB)}," in out
    assert not re.search(r"\d+ MB\b", out)
    code, out, _ = run(capsys, "show", "table9_32b_16h800_16h20")
    assert code == 0 and "GiB/rank" in out and not re.search(r"\d GB\b", out)  # no decimal GB for memory
    # a stage in show: table9's H800 stage 2 (ranks 0-3, TP4, layers 14..36 of 60; ZeRO-1 over 2 pipelines,
    # 1F1B: 4 - 2 = 2 micro-batches in flight)
    want = llama_stage_bytes(LLAMA_32B, 23, first=False, last=False, tp=4, mbs=1, in_flight=2, zero1_dp=2)
    assert f"ranks 0-3" in out and f"~{want / 2**30:.1f} GiB/rank" in out
    ed = PlanEditor(Cluster.load(EXAMPLES / "paper_16h800_16h20.json"), "llama-32b",
                    EXAMPLES / "table9_32b_16h800_16h20.json", seq_len=4096, background=False)
    nodes = cluster_view(ed)["nodes"]
    assert nodes[0]["sub"] == f"{gib(H800_MIB)} each · NVLink 400 GB/s"
    tile = canvas_view(ed)["tiles"][0]
    assert f"memory {gib(H800_MIB)}" in tile["title"] and tile["mem_text"].endswith(f"/{gib(H800_MIB)}")
    assert f"of {gib(H800_MIB)}" in tile["title"]
    ed.close()


def test_parameter_counts_have_a_sensible_unit() -> None:
    from hspmd_sdk.cli import describe_model
    from hspmd_sdk.core.cluster import format_count
    from hspmd_sdk.models.registry import load_model_spec

    h, f, v = TINY["hidden"], TINY["ffn"], TINY["vocab"]
    tiny = TINY["layers"] * (4 * h * h + 3 * h * f + 2 * h) + v * h + (v * h + h)  # 197184
    assert describe_model(load_model_spec("tiny")).endswith(f"{tiny / 1e3:.0f}K parameters")
    assert "0.00B" not in describe_model(load_model_spec("tiny"))
    assert [format_count(n) for n in (512, 1_234, 1_234_567, 6_738_415_616, 32_772_606_464)] == \
        ["512", "1.23K", "1.23M", "6.74B", "32.8B"]


def test_local_cpu_workers_are_not_described_as_nvlinked(capsys) -> None:
    from hspmd_sdk.core.cluster import Cluster
    from hspmd_sdk.viz import PlanEditor
    from hspmd_sdk.viz._canvas_view import cluster_view
    from hspmd_sdk.viz.cluster_fig import cluster_figure

    code, out, _ = run(capsys, "show", "local_4")
    assert code == 0 and "NVLink" not in out and "local worker process" in out and gib(CPU_MIB) in out
    ed = PlanEditor(Cluster.local(4), "tiny", seq_len=16, background=False)
    [node] = cluster_view(ed)["nodes"]
    assert "NVLink" not in node["sub"] and "local processes" in node["sub"] and gib(CPU_MIB) in node["sub"]
    ed.close()
    texts = " ".join(a.text for a in cluster_figure(Cluster.local(4)).layout.annotations)
    assert "NVLink" not in texts and gib(CPU_MIB) in texts


# ---- 7. hspmd run: the cause first; no carriage returns when piped -------------------------------------------
def test_run_on_too_few_local_ranks_names_the_cause_first() -> None:
    example = EXAMPLES / "table9_32b_16h800_16h20.json"
    data = json.loads(example.read_text())
    need = 1 + max(r for p in data["pipelines"] for s in p["stages"] for r in s["devices"])
    layers = 1 + max(s["layers"][1] for s in data["pipelines"][0]["stages"])
    stages = sum(len(p["stages"]) for p in data["pipelines"])
    proc = subprocess.run([sys.executable, "-m", "hspmd_sdk.cli", "run", str(example), "--local", "4"],
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 1 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert lines[0].startswith(f"error: cannot run this strategy here: the strategy uses ranks 0..{need - 1} "
                               f"({need} worker processes) but --local 4 gives 4; it splits {layers} layers but "
                               f"--model tiny has {TINY['layers']}")
    assert f"run it with --local {need} --model llama-32b" in lines[0] and "example_hetero_tiny" in lines[0]
    assert lines[1] == "details (invalid strategy):"
    assert len(lines) <= 2 + len(data["pipelines"]) + stages  # a line a stage, not a line a rank


def test_run_piped_prints_no_carriage_return_progress(tmp_path: Path) -> None:
    strategy = write(tmp_path, "pp2.json", {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 1]},
                                                                      {"devices": [1], "layers": [2, 3]}],
                                                           "micro_batch_size": 2, "num_micro_batches": 2}]})
    proc = subprocess.run([sys.executable, "-m", "hspmd_sdk.cli", "run", strategy, "--local", "2", "--steps", "2",
                           "--data", "synthetic", "--no-reference"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr + proc.stdout
    assert "progress as plain lines: stderr is not a terminal" in proc.stderr
    # the workers' start-up is shown as it happens (phases, then steps), each update a line of its own
    assert "starting 2 workers: processes 0/2" in proc.stderr and "2/2" in proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["0", "1"]


def test_the_live_bar_is_kept_on_a_terminal(monkeypatch) -> None:
    from hspmd_sdk.cli import run as cli_run

    class Tty:
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Tty())
    assert cli_run._live_progress()
    monkeypatch.undo()
    assert not cli_run._live_progress() or sys.stderr.isatty()
