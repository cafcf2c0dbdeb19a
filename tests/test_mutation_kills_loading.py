"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of core/loading.py.

A two-field pydantic model stands in for the SDK's documents; every input form (instance, dict, JSON text, bytes,
path) and every error text is written out by hand.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from hspmd_sdk.core.loading import load_model, read_json_text
from hspmd_sdk.errors import PlanValidationError


class Doc(BaseModel):
    name: str
    size: int


class Other(BaseModel):
    name: str
    size: int


# ---- read_json_text ---------------------------------------------------------------------------------------------
def test_json_text_is_returned_as_is_even_with_leading_whitespace() -> None:
    """A string whose first non-blank character is ``{`` is the JSON itself, returned unchanged."""
    assert read_json_text('{"a": 1}', what="doc") == '{"a": 1}'
    assert read_json_text('\n  {"a": 1}', what="doc") == '\n  {"a": 1}'


def test_a_path_string_or_path_is_read(tmp_path: Path) -> None:
    """Any other string, or a Path, names a file whose text is returned."""
    f = tmp_path / "d.json"
    f.write_text('{"x": 2}')
    assert read_json_text(str(f), what="doc") == '{"x": 2}'
    assert read_json_text(f, what="doc") == '{"x": 2}'


def test_a_path_object_is_never_taken_for_json(tmp_path: Path) -> None:
    """A Path whose name starts with ``{`` is still a file path."""
    f = tmp_path / "{odd}.json"
    f.write_text("[1]")
    assert read_json_text(Path(str(f)), what="doc") == "[1]"


def test_a_missing_file_says_no_such_file_and_what_was_expected(tmp_path: Path) -> None:
    """The problem's path is the path given, its reason ``no such file (expected a <what> JSON file or JSON
    text)``; ``what`` names the document in the message."""
    p = str(tmp_path / "nope.json")
    with pytest.raises(PlanValidationError) as e:
        read_json_text(p, what="strategy")
    assert e.value.problems == [(p, "no such file (expected a strategy JSON file or JSON text)")]
    assert e.value.what == "strategy"
    assert str(e.value) == f"invalid strategy: {p}: no such file (expected a strategy JSON file or JSON text)"


def test_an_unreadable_path_says_cannot_read_with_the_reason(tmp_path: Path) -> None:
    """A directory (IsADirectoryError) or a NUL byte (ValueError) cannot be read: ``cannot read: <the error>``."""
    with pytest.raises(PlanValidationError) as e:
        read_json_text(tmp_path, what="cluster")
    (path, reason), = e.value.problems
    assert path == str(tmp_path)
    assert reason.startswith("cannot read: [Errno 21] Is a directory")
    assert reason.endswith(" (expected a cluster JSON file or JSON text)")
    with pytest.raises(PlanValidationError) as e:
        read_json_text("a\0b", what="cluster")
    assert e.value.problems == [("a\0b", "cannot read: embedded null byte (expected a cluster JSON file or JSON "
                                         "text)")]


def test_an_empty_or_long_path_is_named_readably() -> None:
    """An empty path is shown as ``<empty path>``; a long one cut at 200 characters."""
    with pytest.raises(PlanValidationError) as e:
        read_json_text("", what="doc")
    assert e.value.problems[0][0] == "<empty path>"
    long = "d/" * 150  # 300 characters, a missing directory
    with pytest.raises(PlanValidationError) as e:
        read_json_text(long, what="doc")
    assert e.value.problems == [("d/" * 100, "no such file (expected a doc JSON file or JSON text)")]


# ---- load_model -------------------------------------------------------------------------------------------------
def test_an_instance_is_returned_itself() -> None:
    """An instance of the class is passed through (the same object, not a copy)."""
    d = Doc(name="a", size=1)
    assert load_model(Doc, d, what="doc") is d


def test_every_input_form_gives_the_same_document(tmp_path: Path) -> None:
    """A dict, JSON text, bytes, a bytearray, a path string and a Path all validate to Doc(name='a', size=1)."""
    f = tmp_path / "d.json"
    f.write_text('{"name": "a", "size": 1}')
    want = Doc(name="a", size=1)
    for data in ({"name": "a", "size": 1}, '{"name": "a", "size": 1}', b'{"name": "a", "size": 1}',
                 bytearray(b'{"name": "a", "size": 1}'), str(f), f):
        assert load_model(Doc, data, what="doc") == want, data


def test_json_is_validated_strictly_as_json() -> None:
    """JSON text is validated in JSON mode: a string "1" for an int is accepted in both modes, but a float 1.5 is
    not; bytes go through JSON as well (a dict would be python-mode)."""
    with pytest.raises(PlanValidationError):
        load_model(Doc, b'{"name": "a", "size": 1.5}', what="doc")
    with pytest.raises(PlanValidationError):
        load_model(Doc, '{"name": "a", "size": 1.5}', what="doc")


def test_an_instance_of_another_model_is_validated_not_passed_through() -> None:
    """An object of another class goes through validation and fails as a dict would: not a Doc."""
    with pytest.raises(PlanValidationError) as e:
        load_model(Doc, Other(name="a", size=1), what="doc")
    assert e.value.what == "doc"


def test_validation_errors_become_path_precise_problems() -> None:
    """A wrong field and a missing one: ``(field path, pydantic's reason)`` each, under ``invalid <what>``."""
    with pytest.raises(PlanValidationError) as e:
        load_model(Doc, {"name": "a", "size": "many"}, what="my doc")
    assert e.value.problems == [("size", "Input should be a valid integer, unable to parse string as an integer")]
    assert str(e.value) == ("invalid my doc: size: Input should be a valid integer, unable to parse string as an "
                            "integer")
    assert e.value.__cause__ is None and e.value.__suppress_context__
    with pytest.raises(PlanValidationError) as e:
        load_model(Doc, '{"name": "a"}', what="doc")
    assert e.value.problems == [("size", "Field required")]
    with pytest.raises(PlanValidationError) as e:
        load_model(Doc, b"{", what="doc")
    assert e.value.what == "doc" and "EOF" in e.value.problems[0][1]


def test_a_missing_file_reaches_load_model_callers(tmp_path: Path) -> None:
    """load_model of a missing path raises read_json_text's error, with the caller's ``what``."""
    with pytest.raises(PlanValidationError) as e:
        load_model(Doc, tmp_path / "none.json", what="cluster")
    assert e.value.problems == [(str(tmp_path / "none.json"),
                                 "no such file (expected a cluster JSON file or JSON text)")]
