"""``import hspmd_sdk.core`` is pure Python and fast: no torch, torch.distributed, widgets or plotting."""
from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys, time
t0, c0 = time.perf_counter(), time.process_time()
import hspmd_sdk.core
import hspmd_sdk.core.model_config, hspmd_sdk.core.strategy, hspmd_sdk.core.plan
seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
heavy = [m for m in ("torch", "torch.distributed", "ipywidgets", "plotly") if m in sys.modules]
print(json.dumps({"seconds": seconds, "cpu": cpu, "heavy": heavy}))
"""


def probe(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_core_import_is_light_and_fast() -> None:
    # Best of three fresh interpreters, wall clock (perf_counter) and CPU time (process_time).  On a machine
    # loaded by other work the wall clock measures the machine, not the import, so CPU time is the fallback.
    runs = [probe(PROBE) for _ in range(3)]
    wall, cpu = min(r["seconds"] for r in runs), min(r["cpu"] for r in runs)
    print(f"import hspmd_sdk.core (+ model_config, strategy, plan): best {wall * 1000:.0f} ms wall "
          f"({[round(r['seconds'] * 1000) for r in runs]}), {cpu * 1000:.0f} ms CPU")
    assert runs[0]["heavy"] == [], f"hspmd_sdk.core imported {runs[0]['heavy']}"
    assert wall < 0.5 or cpu < 0.5, f"import took {wall:.3f} s wall, {cpu:.3f} s CPU (best of 3)"


def test_cli_import_is_light() -> None:
    code = PROBE.replace("import hspmd_sdk.core\n", "import hspmd_sdk.cli\n")
    assert probe(code)["heavy"] == []
