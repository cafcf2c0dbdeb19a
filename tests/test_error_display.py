"""How the SDK's errors read where users meet them (issue 48 item 3).

* In IPython/Jupyter an SDK error (``HSPMDError`` and its subclasses) shows as its message and one line saying how to
  see the traceback, through IPython's own ``_render_traceback_`` hook; ``%tb`` then shows the full traceback; nbval
  still fails a notebook cell that raises one.  Checked in a real IPython shell and a real nbval run.
* ``Stage``/``Pipeline``/``Strategy`` built directly word their errors as ``Strategy.load`` does: field path and
  reason, no pydantic boilerplate (``For further information visit https://errors.pydantic.dev``).
* ``launch`` given a Strategy where it needs a Program says a Strategy needs a model.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hspmd_sdk.core.strategy import Pipeline, Stage, Strategy
from hspmd_sdk.errors import HSPMDError, PlanValidationError

IPython = pytest.importorskip("IPython")


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    sh.run_line_magic("colors", "nocolor")  # plain text to read
    yield sh
    InteractiveShell.clear_instance()


def test_an_sdk_error_shows_its_message_in_ipython_and_percent_tb_the_traceback(shell, capsys) -> None:
    shell.run_cell("from hspmd_sdk.errors import PlanValidationError\n"
                   "def deep():\n"
                   "    raise PlanValidationError([('pipelines[0].stages[1].devices', 'rank 9 is not in the cluster')],"
                   " what='strategy')\n"
                   "deep()\n")
    shown = capsys.readouterr()
    text = shown.out + shown.err
    assert "PlanValidationError: invalid strategy: pipelines[0].stages[1].devices: rank 9 is not in the cluster" in text
    assert "%tb" in text and "full traceback" in text
    assert "def deep" not in text and "Traceback" not in text and "raise PlanValidationError" not in text
    shell.run_cell("%tb")
    full = capsys.readouterr()
    full_text = full.out + full.err
    assert "deep()" in full_text and "raise PlanValidationError" in full_text, full_text
    assert "rank 9 is not in the cluster" in full_text


def test_a_plain_python_error_keeps_its_traceback_in_ipython(shell, capsys) -> None:
    shell.run_cell("def deep():\n    raise ValueError('plain')\ndeep()\n")
    shown = capsys.readouterr()
    text = shown.out + shown.err
    assert "raise ValueError" in text and "%tb" not in text


@pytest.mark.timeout(120)
def test_nbval_still_fails_a_cell_that_raises_an_sdk_error(tmp_path: Path) -> None:
    pytest.importorskip("nbval")
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "id": "a", "metadata": {}, "outputs": [],
                     "source": "from hspmd_sdk.errors import SpecializationError\n"
                               "raise SpecializationError('tensor W: no annotation for rank 3')"}],
          "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
          "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "raises.ipynb"
    path.write_text(json.dumps(nb))
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--nbval-lax",
                        "--nbval-current-env", str(path)], capture_output=True, text=True, timeout=110,
                       cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "1 failed" in out, out[-3000:]
    assert "SpecializationError: tensor W: no annotation for rank 3" in out, out[-3000:]


@pytest.mark.parametrize("build, path, reason", [
    (lambda: Stage(devices=[0, 1], layers=[3, 1]), "layers", "[3, 1] is empty"),
    (lambda: Stage(devices=[0, 0], layers=[0, 1]), "devices", "rank 0 is listed twice"),
    (lambda: Stage(devices=[0], layers=[0, 1], cp=0), "cp", "greater than or equal to 1"),
    (lambda: Pipeline(stages=[{"devices": [0], "layers": [0, 1]}], micro_batch_size="2", num_micro_batches=1),
     "micro_batch_size", "integer"),
    (lambda: Strategy(pipelines=[{"stages": [{"devices": [0], "layers": [0, 1]}], "micro_batch_size": 1,
                                  "num_micro_batches": 1, "extra": 1}]), "pipelines[0].extra", "not permitted"),
])
def test_stage_pipeline_and_strategy_built_directly_word_their_errors_with_the_field_path(build, path,
                                                                                         reason) -> None:
    with pytest.raises(PlanValidationError) as info:
        build()
    text = str(info.value)
    assert "pydantic" not in text and "https://" not in text and "[type=" not in text, text
    assert any(p == path and reason in r for p, r in info.value.problems), info.value.problems
    assert isinstance(info.value, ValueError)  # as pydantic's error was: `except ValueError` still catches it


def test_a_valid_stage_is_unchanged() -> None:
    assert Stage(devices=[0, 1], layers=[0, 3]) == Stage.model_validate({"devices": [0, 1], "layers": [0, 3]})


def test_a_strategy_given_to_launch_says_it_needs_a_model() -> None:
    from hspmd_sdk.runtime.control.launch_errors import not_a_program

    strategy = Strategy.load({"pipelines": [{"stages": [{"devices": [0], "layers": [0, 3]}],
                                             "micro_batch_size": 1, "num_micro_batches": 1}]})
    err = not_a_program(strategy)
    assert isinstance(err, PlanValidationError) and isinstance(err, HSPMDError)
    text = str(err)
    assert "bare graph" not in text
    assert "a Strategy needs a model" in text and "specialize(model, plan_from_strategy(" in text, text
    assert "model=" not in text  # launch takes no model= today: not offered unless the caller says it does
    assert "launch(strategy, cluster, model=model" in str(not_a_program(strategy, model_option=True))
    bare = str(not_a_program(object()))
    assert "object" in bare and "Program" in bare
