"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of
runtime/control/run_config.py.

Each pins what a user reads when an option is refused (the option's path and the whole reason, as the module
docstring and the fields' descriptions state it) or that a good value passes unchanged; no worker starts.
"""
from __future__ import annotations

import numpy as np
import pytest

from hspmd_sdk import GPTConfig, LlamaConfig
from hspmd_sdk.core import ops
from hspmd_sdk.core.graph import GraphBuilder
from hspmd_sdk.errors import PlanValidationError
from hspmd_sdk.runtime.control.growback import GrowBack
from hspmd_sdk.runtime.control.run_config import RunConfig, check_run_options, position_limit

GPT = GPTConfig.preset("tiny")  # learned positions: max_seq_len 64
LLAMA = LlamaConfig.preset("tiny")


def _problems(**options) -> list[tuple[str, str]]:
    with pytest.raises(PlanValidationError) as e:
        check_run_options(**options)
    return e.value.problems


def test_betas_as_a_list_become_a_tuple() -> None:
    """Adam's betas given as a list are kept as the tuple the field holds."""
    assert check_run_options(steps=1, betas=[0.5, 0.25]).betas == (0.5, 0.25)


def test_a_sequence_past_the_position_table_names_the_model_and_its_limit() -> None:
    assert _problems(model=GPT, steps=1, seq_len=65) == [
        ("seq_len", "must be at most 64 for GPTConfig 'tiny' (its learned position embedding has max_seq_len=64 "
                    "positions), not 65")]
    assert check_run_options(model=GPT, steps=1, seq_len=64).seq_len == 64


def test_data_is_checked_against_a_model_only() -> None:
    """With a model, an unknown data name is refused with the dataset's own reason (its leading 'data ' cut: the
    option's name is shown beside it); without one, and for a list of Programs, nothing is checked here."""
    (path, reason), = _problems(model=LLAMA, steps=1, data="nonsense")
    assert path == "data"
    assert reason.startswith("must be 'synthetic', 'stdlib' or a prepared corpus directory, not 'nonsense' (")
    assert check_run_options(steps=1, data="nonsense").data == "nonsense"
    assert check_run_options(model=LLAMA, mixed=True, steps=1, data="nonsense").data == "nonsense"
    assert RunConfig.model_validate({"steps": 1, "data": "nonsense"}).data == "nonsense"  # no context at all


def test_a_schedule_is_checked_and_kept_as_given() -> None:
    assert _problems(steps=1, schedule="bogus") == [
        ("schedule", "kind: Input should be 'constant', 'linear', 'cosine' or 'wsd'")]
    assert check_run_options(steps=1, schedule="cosine").schedule == "cosine"
    assert check_run_options(steps=1).schedule is None


def test_holds_are_steps_of_the_run() -> None:
    """0 <= hold < steps; the last step may hold; with steps itself refused, the holds are not checked."""
    assert _problems(steps=3, hold_at=[1, 3]) == [("hold_at", "must be steps of this run (0..2), not 3")]
    assert check_run_options(steps=3, hold_at=[0, 2]).hold_at == [0, 2]
    assert _problems(steps=0, hold_at=[5]) == [("steps", "must be a whole number of steps >= 1, not 0")]


def test_grow_back_needs_elastic_unless_it_is_off() -> None:
    assert check_run_options(steps=1, grow_back=False).grow_back is False
    assert check_run_options(steps=1, grow_back=None).grow_back is None
    need = [("grow_back", "grows the job back after failures it survived: it needs elastic=True")]
    assert _problems(steps=1, grow_back=True) == need
    assert _problems(steps=1, grow_back=GrowBack()) == need
    assert check_run_options(steps=1, grow_back=True, elastic=True).grow_back is True
    gb = GrowBack()
    assert check_run_options(steps=1, grow_back=gb, elastic=True).grow_back is gb
    assert _problems(steps=1, grow_back=5, elastic=True) == [
        ("grow_back", "must be True, False, None or a GrowBack, not 5")]


class _Graphed:
    """A model that is only its graph (hashable by identity, as configs are by value)."""

    def __init__(self, graph) -> None:
        self._graph = graph

    def build_graph(self):
        return self._graph


def test_position_limit_reads_only_embeddings_of_the_positions() -> None:
    """Positions used otherwise first (an add whose other input has 7 rows) neither set the limit nor stop the
    search: the embedding of the positions that follows reads a table of 64 rows."""
    g = GraphBuilder("positions-used-twice")
    tokens = g.placeholder("tokens", (7, "S"), "int64")
    pos = ops.positions(tokens, name="positions")
    ops.add(pos, tokens, name="shifted")
    ops.embedding(pos, g.parameter("wpe", (64, 8)), name="wpe_lookup")
    assert position_limit(_Graphed(g.build())) == 64


def test_mixed_options_are_refused_for_one_program_by_default() -> None:
    assert _problems(steps=1, tokens_per_step=5) == [
        ("tokens_per_step", "is an option of mixed-length training (a list of candidate Programs), not of one "
                            "Program; leave it out (got 5)")]


def test_the_error_names_the_training_run_and_every_problem() -> None:
    """A wrong-form option and a bad value are both reported, in that order, under 'invalid training run'."""
    with pytest.raises(PlanValidationError) as e:
        check_run_options(steps=0, context=5)
    assert e.value.problems == [
        ("context", "is an option of mixed-length training (a list of candidate Programs), not of one Program; "
                    "leave it out (got 5)"),
        ("steps", "must be a whole number of steps >= 1, not 0")]
    assert str(e.value).startswith("invalid training run:\n  context: ")
    with pytest.raises(PlanValidationError) as e:
        check_run_options(what="mixed run", steps=0)
    assert str(e.value) == "invalid mixed run: steps: must be a whole number of steps >= 1, not 0"


def test_unknown_options_get_the_nearest_name_or_the_list() -> None:
    assert _problems(steps=1, step=2) == [("step", "is not an option of launch; did you mean 'steps'?")]
    (path, reason), = _problems(steps=1, zzzzqqq=2)
    assert path == "zzzzqqq"
    assert reason == f"is not an option of launch; the options are {sorted(RunConfig.model_fields)}"
    assert reason.startswith("is not an option of launch; the options are ['backend', 'betas', ")


def test_bad_values_show_the_value_at_its_path() -> None:
    """An item of a list is named by its index (nested indices each in brackets) and shown alone; a missing
    option shows what was given; a validator's reason is shown without pydantic's 'Value error, ' prefix; a
    value is shown as given."""
    assert _problems(steps=1, recompute=[0, -1]) == [
        ("recompute[1]", "must be a list of ranks (whole numbers >= 0), or None (the program's), not -1")]
    assert _problems(steps=1, fault_injection=[{"rank": 0}, {1: 2}]) == [
        ("fault_injection[1][1]", "must be a list of {'rank', 'step', 'at'} dicts, not 1")]
    assert _problems(seed=1) == [("steps", "must be a whole number of steps >= 1, not {'seed': 1}")]
    assert _problems(steps=1, lr=-1) == [("lr", "must be a finite number > 0, not -1")]
    assert _problems(steps=2.5) == [("steps", "must be a whole number of steps >= 1, not 2.5")]
    # the value as the user gave it, not as Int's before-validator converted it (np.int64 -> int)
    assert _problems(steps=np.int64(0)) == [("steps", "must be a whole number of steps >= 1, not np.int64(0)")]
