"""One memory estimate for a plan on a device (issue 48, item 6).

The tiny model's example plan on 4 local ranks used to show three figures: ~1.2 MiB a rank in ``hspmd show`` and
``Strategy.summary`` (tensors only), 2.0 GiB in the plan editor (a 2 GiB CUDA context reserve added to CPU worker
processes) and ~0.28 GiB measured by the dashboard (the workers' peak RSS).  Now one function
(:func:`hspmd_sdk.core.memory.device_memory`) estimates each rank's memory on its device -- a CPU worker process
has no CUDA context but the process baseline (interpreter, torch, gloo), a GPU the CUDA context reserve -- and
every display shows it; the dashboard shows it beside what the job measured.

Checked against independent references: the text each display prints (``hspmd show``, the editor's summary), the
mixed-length simulation (its own per-shape memory path) and, above all, the peak resident memory that real local
worker processes report.  The stated tolerance: estimated / measured within :data:`TOLERANCE` for every rank.
"""
from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

import hspmd_sdk
from hspmd_sdk import Cluster, LlamaConfig, Strategy, specialize
from hspmd_sdk.cli import main
from hspmd_sdk.core.strategy_plan import plan_from_strategy
from hspmd_sdk.planner import simulate
from hspmd_sdk.viz import PlanEditor

EXAMPLES = Path(hspmd_sdk.__file__).resolve().parent / "examples"
STATIC = Path(hspmd_sdk.__file__).resolve().parent / "viz" / "static"
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
MODEL = LlamaConfig.preset("tiny")
PLAN_FILE = EXAMPLES / "example_hetero_tiny.json"  # hspmd demo's plan: TP2 -> TP1 with 3 micro-batches, 1 rank
SEQ = 64  # the tiny model's max_seq_len: what Strategy.summary and hspmd show estimate at
#: estimated / measured peak RSS of every rank of a real local job lies in this range (measured for the tiny
#: model on 4 ranks: 0.98-0.99; for a 17M-parameter model whose states dominate: 0.71-0.77 on this 2-core machine
#: at every commit since the estimate landed (e8757c0 on), 0.697 once in CI on the rank with the most state: the
#: fp32 CPU worker's tensors are ~1.75x the mixed-precision accounting there, see hspmd_sdk.core.memory)
TOLERANCE = (0.6, 1.3)
GIB = 2.0**30


def _stage_figures(text: str, pattern: str) -> list[str]:
    return re.findall(pattern, text)


def _show(capsys, *args: str) -> str:
    assert main(["show", *args]) == 0
    return capsys.readouterr().out


# ---- the displays agree ---------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["tiny on 4 local ranks", "llama-7b on H800"])
def test_hspmd_show_the_summary_and_the_editor_give_one_figure_per_stage(case, capsys, tmp_path) -> None:
    """For the same plan, device and sequence length, ``hspmd show``, ``Strategy.summary`` and the plan editor's
    summary print the same memory for every stage (before: 1.2 MiB in the first two, 2.0 GiB in the editor), and
    the editor's figures are the estimate's own numbers."""
    if case.startswith("tiny"):
        model_name, model, cluster, cluster_arg = "tiny", MODEL, Cluster.local(4), "cpu:4"
        data, seq = Strategy.load(PLAN_FILE).model_dump(mode="json"), SEQ
    else:  # tensors in the tens of GiB: a 2 GiB difference shows at the 0.1 GiB the displays print
        from hspmd_sdk.models.registry import load_model_spec

        model_name, model, cluster_arg = "llama-7b", load_model_spec("llama-7b"), "H800:4"
        cluster = Cluster.mixed({"H800": 4}, per_node=4)
        seq = model.max_seq_len
        data = {"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, 15]},
                                          {"devices": [2, 3], "layers": [16, 31]}],
                               "micro_batch_size": 1, "num_micro_batches": 4}], "zero1": False}
    strategy = Strategy.load(data)
    summary = strategy.summary(model, cluster)
    per_stage = _stage_figures(summary, r"~([\d.]+ [GM]iB)/rank")
    assert len(per_stage) == sum(p.num_stages for p in strategy.pipelines), summary

    path = tmp_path / "strategy.json"
    path.write_text(strategy.model_dump_json())
    shown = _show(capsys, str(path), "--model", model_name, "--cluster", cluster_arg)
    assert _stage_figures(shown, r"~([\d.]+ [GM]iB)/rank") == per_stage, shown

    ed = PlanEditor(cluster, model_name, data, seq_len=seq, background=False)
    try:
        assert ed.is_valid, ed.summary()
        edited = _stage_figures(ed.summary(), r": memory ([\d.]+ [GM]iB) of ")
        assert edited == per_stage, (ed.summary(), summary)
        want = strategy.device_memory(model, cluster, seq_len=seq)
        for r, m in want.items():  # the editor shows the simulator's peak, which is the one estimate
            assert ed.sim.peak_memory[r] == pytest.approx(m.total, rel=1e-12)
    finally:
        ed.close()


@pytest.mark.timeout(60)
def test_the_dashboard_estimate_is_the_summary_s_for_the_plan_a_job_runs() -> None:
    """The dashboard's estimate of a rank is the summary's figure for the plan the job runs (its Program's strategy,
    model, sequence length and cluster): the whole estimate for CPU workers, whose measured RSS holds the
    process; the tensors for GPU workers, whose measured figure is torch's allocated bytes."""
    from hspmd_sdk.runtime.metrics import MetricsHistory, StepMetrics
    from hspmd_sdk.viz._job import snapshot

    cluster = Cluster.local(4)
    strategy = Strategy.load(PLAN_FILE)
    program = specialize(MODEL, plan_from_strategy(MODEL, strategy, cluster), cluster)
    est = strategy.device_memory(MODEL, cluster, seq_len=SEQ)
    for backend, part in (("gloo", "total"), ("nccl", "tensors")):
        metrics = MetricsHistory()
        for r in range(4):
            metrics.add(StepMetrics(rank=r, step=0, step_time=0.1, memory_mb=300.0 + r))
        job = SimpleNamespace(job_id="fake", status="running", metrics=metrics, program=program, cluster=cluster,
                              controller=SimpleNamespace(global_batch=8, seq_len=SEQ, mixed=False, cost=None),
                              spec=SimpleNamespace(steps=3, ranks=[0, 1, 2, 3], backend=backend), events=[],
                              failures=[], pids=lambda: {})
        view = snapshot(job).to_view()
        for row in view["ranks"]:
            r = row["rank"]
            assert row["memory_mb"] == 300.0 + r
            assert row["memory_estimate_mb"] == pytest.approx(getattr(est[r], part) / 2**20, abs=0.05), (backend, r)
        note = view["memory_note"]
        assert ("RSS" in note and "CUDA" not in note) if backend == "gloo" else ("CUDA context" in note)


# ---- device-aware ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_cpu_worker_has_a_process_baseline_and_no_cuda_context_a_gpu_has_its_cuda_context() -> None:
    """The same plan on CPU worker processes and on GPUs: the same tensors; the runtime part is the process
    baseline (well under the 2 GiB CUDA reserve) on CPUs, the CUDA context reserve on GPUs -- in the estimate, the
    simulator (what the editor shows), the planners' capacity and the summary's words."""
    strategy = Strategy.load(PLAN_FILE)
    cpu, gpu = Cluster.local(4), Cluster.local(4, kind="H100")
    for r in range(4):  # the simulator, which the editor draws, first: it exists with the same API before and after
        assert simulate(MODEL, strategy, cpu, seq_len=SEQ).memory[r]["reserve"] < 0.5 * GIB
        assert simulate(MODEL, strategy, gpu, seq_len=SEQ).memory[r]["reserve"] == 2 * GIB

    from hspmd_sdk.core.memory import CPU_PROCESS_BASELINE_MB, CUDA_CONTEXT_RESERVE_MB
    from hspmd_sdk.planner import CostModel

    on_cpu, on_gpu = strategy.device_memory(MODEL, cpu), strategy.device_memory(MODEL, gpu)
    forced = strategy.device_memory(MODEL, gpu, device="cpu")  # a job launched with device="cpu" on GPU kinds
    for r in range(4):
        assert on_cpu[r].tensors == on_gpu[r].tensors == forced[r].tensors > 0
        assert on_cpu[r].runtime == forced[r].runtime == CPU_PROCESS_BASELINE_MB * 2**20
        assert on_gpu[r].runtime == CUDA_CONTEXT_RESERVE_MB * 2**20 == 2 * GIB
        assert on_cpu[r].on_cpu and not on_gpu[r].on_cpu
        assert on_cpu[r].comparable(measured_on_gpu=False) == on_cpu[r].total
        assert on_gpu[r].comparable(measured_on_gpu=True) == on_gpu[r].tensors
    assert strategy.device_memory(MODEL)[0].runtime == 0  # no cluster: no device, tensors only
    cost = CostModel()
    assert cost.runtime_bytes("cpu") == on_cpu[0].runtime and cost.runtime_bytes("H100") == on_gpu[0].runtime
    text_cpu, text_gpu = strategy.summary(MODEL, cpu), strategy.summary(MODEL, gpu)
    assert "process baseline" in text_cpu and "CUDA" not in text_cpu
    assert "CUDA context" in text_gpu and "process baseline" not in text_gpu


@pytest.mark.timeout(60)
def test_the_mixed_length_simulation_counts_the_same_memory_for_fixed_shapes() -> None:
    """The mixed-length simulation prices memory per micro-batch shape through its own cost path
    (:class:`~hspmd_sdk.planner.mixed_cost.PipelineCost`); given every micro-batch at the plan's fixed shape it
    counts what the one estimate counts, on CPU workers and on GPUs (ZeRO-1, recompute, uneven pipelines)."""
    from hspmd_sdk.models.registry import load_model_spec
    from hspmd_sdk.planner.mixed_sim import simulate_shapes

    strategy = Strategy.load(PLAN_FILE)
    for cluster in (Cluster.local(4), Cluster.local(4, kind="H100")):
        shapes = [[(p.micro_batch_size, SEQ)] * p.num_micro_batches for p in strategy.pipelines]
        got = simulate_shapes(MODEL, strategy, cluster, shapes)
        want = strategy.device_memory(MODEL, cluster, seq_len=SEQ)
        assert {r: pytest.approx(m.total, rel=1e-9) for r, m in want.items()} == got.peak_memory
    big = load_model_spec("llama-7b")
    cluster = Cluster.mixed({"H800": 4, "H20": 4}, per_node=4)
    s = Strategy.load({"zero1": True, "pipelines": [
        {"stages": [{"devices": [0, 1], "layers": [0, 15]}, {"devices": [4], "layers": [16, 31], "recompute": True}],
         "micro_batch_size": 1, "num_micro_batches": 4},
        {"stages": [{"devices": [2, 3], "layers": [0, 20]}, {"devices": [5, 6], "layers": [21, 31]}],
         "micro_batch_size": 1, "num_micro_batches": 4}]})
    got = simulate_shapes(big, s, cluster, [[(1, 512)] * 4, [(1, 512)] * 4])
    want = s.device_memory(big, cluster, seq_len=512)
    assert {r: pytest.approx(m.total, rel=1e-9) for r, m in want.items()} == got.peak_memory


# ---- against what real workers measure ----------------------------------------------------------------------------
def _train(model: LlamaConfig, steps: int) -> tuple:
    """The example plan trained on 4 local worker processes (gloo); returns (job, its dashboard state)."""
    from hspmd_sdk.runtime import launch
    from hspmd_sdk.viz import JobDashboard

    cluster = Cluster.local(4)
    strategy = Strategy.load(PLAN_FILE)
    program = specialize(model, plan_from_strategy(model, strategy, cluster), cluster)
    job = launch(program, cluster, steps=steps, seed=0, seq_len=SEQ, timeout_s=60)
    try:
        job.wait(timeout=120)
    finally:
        job.cancel()
    dash = JobDashboard(job, watch=False)
    state = dash.refresh().to_view()
    dash.close()
    return job, strategy, state


@pytest.fixture(scope="module")
def tiny_job():
    return _train(MODEL, steps=3)


@pytest.mark.timeout(120)
def test_the_estimate_of_the_tiny_plan_is_within_tolerance_of_the_workers_peak_rss(tiny_job) -> None:
    """hspmd demo's plan on 4 local ranks: each worker's measured peak RSS against the estimate every display
    shows, within :data:`TOLERANCE` (it was 2 GiB against ~0.28 GiB: 7x); and the dashboard shows both."""
    job, strategy, state = tiny_job
    assert state["status"] == "succeeded", state
    editor = simulate(MODEL, strategy, Cluster.local(4), seq_len=SEQ).peak_memory  # what the plan editor shows
    for r in range(4):
        measured = job.metrics.rank(r)[-1].memory_mb  # the worker's own report: peak RSS, MiB
        ratio = editor[r] / 2**20 / measured
        assert TOLERANCE[0] <= ratio <= TOLERANCE[1], (r, editor[r] / 2**20, measured)
    est = strategy.device_memory(MODEL, Cluster.local(4), seq_len=SEQ)
    for r in range(4):
        measured = job.metrics.rank(r)[-1].memory_mb
        assert est[r].total == pytest.approx(editor[r], rel=1e-12)
        row = next(x for x in state["ranks"] if x["rank"] == r)
        assert row["memory_mb"] == measured
        assert row["memory_estimate_mb"] == pytest.approx(est[r].total / 2**20, abs=0.05)
    assert "peak resident memory" in state["memory_note"] and "process baseline" in state["memory_note"]


@pytest.mark.timeout(120)
def test_the_estimate_follows_the_tensors_of_a_model_whose_states_dominate() -> None:
    """A 17M-parameter model on the same plan: the ranks' tensors (70-270 MiB) are as large as the process, so an
    estimate of the baseline alone would be 0.4-0.8 of the measured figure, and one of the tensors alone 0.2-0.4:
    every rank's estimate/measured lies within :data:`TOLERANCE`, and the ranks order as their tensors do."""
    model = LlamaConfig(name="mid", vocab_size=4096, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=8,
                        ffn_hidden_size=1408, max_seq_len=SEQ)
    job, strategy, state = _train(model, steps=2)
    assert state["status"] == "succeeded", state
    sim = simulate(model, strategy, Cluster.local(4), seq_len=SEQ)  # the editor's figures: the one estimate
    measured = {r: job.metrics.rank(r)[-1].memory_mb for r in range(4)}
    for r in range(4):
        ratio = sim.peak_memory[r] / 2**20 / measured[r]
        assert TOLERANCE[0] <= ratio <= TOLERANCE[1], (r, sim.memory[r], measured[r])
    tensors = {r: sim.peak_memory[r] - sim.memory[r]["reserve"] for r in range(4)}
    assert tensors[3] > tensors[2] > tensors[0] > 60 * 2**20
    assert measured[3] > measured[2] > max(measured[0], measured[1])


# ---- in a browser ----------------------------------------------------------------------------------------------
CHROMIUM = "/usr/bin/chromium"
PAGE = """<!doctype html><html><head><meta charset="utf-8"><link rel="stylesheet" href="job_dashboard.css"></head>
<body><div id="root"></div><script type="module">
import widget from "./job_dashboard.js";
const state = await (await fetch("state.json")).json();
const model = { get: (k) => (k === "state" ? state : {}), on() {}, off() {}, send() {} };
widget.render({ model, el: document.getElementById("root") });
window.rendered = true;
</script></body></html>"""


@pytest.mark.timeout(120)
def test_the_dashboard_page_shows_the_estimate_beside_the_measured_memory(tiny_job, tmp_path) -> None:
    """The dashboard's bundle, rendered by headless Chromium from the real job's state: every rank's row reads
    ``<measured> GiB measured / <estimate> GiB est.`` with the job's and the estimate's figures, and the tooltip
    says what each holds and the ratio.  A screenshot goes to ``artifacts/``."""
    if not Path(CHROMIUM).exists() and not os.environ.get("CI"):
        pytest.skip("no /usr/bin/chromium (and not in CI)")
    sync_api = pytest.importorskip("playwright.sync_api")
    import json

    job, strategy, state = tiny_job
    for name in ("job_dashboard.js", "job_dashboard.css"):
        shutil.copy(STATIC / name, tmp_path / name)
    (tmp_path / "state.json").write_text(json.dumps(state))
    (tmp_path / "index.html").write_text(PAGE)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox",
                                                                         "--disable-gpu"], timeout=60_000)
            try:
                page = browser.new_page(viewport={"width": 1100, "height": 700})
                page.goto(f"http://127.0.0.1:{server.server_address[1]}/index.html")
                page.wait_for_function("window.rendered === true", timeout=30_000)
                est = strategy.device_memory(MODEL, Cluster.local(4), seq_len=SEQ)
                for r in range(4):
                    cell = page.locator(f".hd-rank[data-rank='{r}'] .hd-mem")
                    measured = job.metrics.rank(r)[-1].memory_mb
                    want = f"{measured / 1024:.2f} GiB measured / {est[r].total / GIB:.2f} GiB est."
                    assert cell.inner_text() == want
                    title = cell.get_attribute("title")
                    assert "peak resident memory" in title
                    # the page divides the state's estimate, which is kept to 0.1 MiB (memory_estimates)
                    assert f"estimate/measured {round(est[r].total / 2**20, 1) / measured:.2f}" in title
                ARTIFACTS.mkdir(exist_ok=True)
                page.locator("#root").screenshot(path=str(ARTIFACTS / "dashboard_memory_estimate.png"))
            finally:
                browser.close()
    finally:
        server.shutdown()
