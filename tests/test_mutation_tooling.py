"""The mutation-testing scripts' own logic (scripts/mutation/, issue 49): decorated functions rewritten so mutmut
mutates them keep their behaviour; survivors are excused by rule (where and what they change), never by number;
a module whose file changed since its run is stale."""
from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts" / "mutation"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_mutation_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


undecorate = _load("undecorate")
summarize = _load("summarize")

SAMPLE = textwrap.dedent('''
    import functools
    from pydantic import BaseModel, field_validator, model_validator


    class C:
        def __init__(self):
            self._x = 1

        @property
        def x(self):
            return self._x

        @x.setter
        def x(self, v):
            self._x = v * 2

        @staticmethod
        def s():
            return 3

        @functools.cached_property
        def c(self):
            return self._x + 10


    @functools.lru_cache(
        maxsize=None)
    def f(n):
        return 1 if n < 2 else n * f(n - 1)


    class M(BaseModel):
        a: int

        @field_validator("a")
        @classmethod
        def _pos(cls, v):
            if v < 0:
                raise ValueError("negative")
            return v

        @model_validator(mode="after")
        def _after(self):
            return self


    def check():
        c = C()
        c.x = 5
        assert (c.x, c.c, C.s(), f(5)) == (10, 20, 3, 120) and f.cache_info().currsize == 5
        assert M(a=3).a == 3
        try:
            M(a=-1)
        except ValueError as e:
            assert "negative" in str(e)
        else:
            raise AssertionError("no error")
''')


def test_undecorated_functions_behave_as_decorated_ones_and_carry_a_plain_name() -> None:
    text, n = undecorate.undecorate(SAMPLE)
    assert n == 6  # property, its setter, cached_property, lru_cache, field_validator(+classmethod), model_validator
    assert "@" not in text.replace("@staticmethod", "")  # a lone staticmethod is mutmut's own business
    assert "def x__undecorated(self)" in text and "def x__undecorated2(self, v)" in text  # getter, setter apart
    assert "f = (functools.lru_cache(\n    maxsize=None))(f__undecorated)" in text
    for source in (SAMPLE, text):
        space: dict = {}
        exec(compile(source, "<sample>", "exec"), space)  # noqa: S102 - the sample above
        space["check"]()


def test_a_protocols_decorated_members_are_left_as_they_are() -> None:
    """A runtime-checkable Protocol checks every member in isinstance: a renamed ``family__undecorated`` would be a
    member no implementation has (seen: ModelSpec), so a Protocol's body is not rewritten; other classes still are."""
    source = textwrap.dedent('''
        import typing

        @typing.runtime_checkable
        class Spec(typing.Protocol):
            @property
            def family(self) -> str: ...

        class Impl:
            @property
            def family(self) -> str:
                return "gpt"
    ''')
    text, n = undecorate.undecorate(source)
    assert n == 1 and "def family__undecorated(self)" in text and text.count("@property") == 1
    space: dict = {}
    exec(compile(text, "<sample>", "exec"), space)  # noqa: S102 - the sample above
    assert isinstance(space["Impl"](), space["Spec"]) and space["Impl"]().family == "gpt"


def test_a_rule_matches_by_file_function_and_change_not_by_number() -> None:
    rule = summarize.Rule("memo", "a miss recomputes", ("core/annotation.py:local_views",),
                          removed=r"boxes\.get\(\(ds, sub\)\)", added=r"= None$")
    diff = ["-        per_pos = boxes.get((ds, sub))", "+        per_pos = None"]
    assert rule.matches("hspmd_sdk/core/annotation.py", "local_views", diff)
    assert not rule.matches("hspmd_sdk/core/annotation.py", "local_view", diff)  # another function
    assert not rule.matches("hspmd_sdk/core/resolve.py", "local_views", diff)  # another file
    assert not rule.matches("hspmd_sdk/core/annotation.py", "local_views", ["-x = boxes.get((ds, sub))", "+x = 1"])
    keys = {"hspmd_sdk.core.annotation.x_local_views__mutmut_15": diff,
            "hspmd_sdk.core.annotation.x_local_views__mutmut_99": ["-a = 1", "+a = 2"]}
    assert summarize.judge([rule], "hspmd_sdk/core/annotation.py", keys) == {
        "hspmd_sdk.core.annotation.x_local_views__mutmut_15": "memo"}


@pytest.mark.parametrize("key, function", [
    ("hspmd_sdk.core.resolve.x__top_op__mutmut_8", "_top_op"),
    ("hspmd_sdk.planner.cost.xǁCostModelǁsend_time__mutmut_3", "CostModel.send_time"),
    ("hspmd_sdk.core.deduction.x_deduce__undecorated__mutmut_12", "deduce"),
    ("hspmd_sdk.core.annotation.xǁAnnotationǁ_check__undecorated2__mutmut_1", "Annotation._check"),
])
def test_a_mutant_name_gives_its_function(key: str, function: str) -> None:
    assert summarize.function_of(key) == function


def test_every_rule_file_parses_and_no_rule_excuses_by_number() -> None:
    rules = summarize.rules(SCRIPTS.parent.parent)
    assert rules, "no rules"
    for r in rules:
        assert r.why and r.where and (r.removed or r.added)
        assert "__mutmut_" not in "".join(r.where) + r.removed + r.added, r.id


def test_a_module_whose_file_changed_since_its_run_is_stale(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("x = 1\n")
    row = {"file": "m.py", "sha256": summarize.file_hash(tmp_path / "m.py")}
    assert not summarize.is_stale(tmp_path, row)
    (tmp_path / "m.py").write_text("x = 2\n")
    assert summarize.is_stale(tmp_path, row)
    assert summarize.is_stale(tmp_path, {"file": "m.py"})  # a run that recorded no hash
