"""DS keys as names (issue 23, "one communication vocabulary"): :class:`DSKey` and the module-level ``PARTIAL`` /
``DUPLICATE``.

The keys are the paper's (§4; SPEC §1): ``-2`` Partial, ``-1`` Duplicate, ``d >= 0`` Split along dim ``d``.  The
enum is a name for those integers, nothing more: a DS or an Annotation built with the names equals the one built
with the integers, and prints, dumps and serialises exactly the same text (the expected strings below are
written out by hand).  The core spells the keys by name: an AST scan finds no bare ``-2`` in it, and no bare
``-1`` where a DS key or an HDim is meant.
"""
from __future__ import annotations

import ast
import json
import pickle
from pathlib import Path

import pytest

import hspmd_sdk.core as core
from hspmd_sdk.core.annotation import DS, DUPLICATE, PARTIAL, Annotation, DSKey, is_split

CORE = Path(__file__).resolve().parents[1] / "hspmd_sdk" / "core"


def test_the_enum_holds_the_papers_keys() -> None:
    assert [(m.name, m.value) for m in DSKey] == [("PARTIAL", -2), ("DUPLICATE", -1)]
    assert PARTIAL is DSKey.PARTIAL and DUPLICATE is DSKey.DUPLICATE
    assert PARTIAL == -2 and DUPLICATE == -1 and hash(PARTIAL) == hash(-2) and isinstance(PARTIAL, int)
    assert str(PARTIAL) == "-2" and f"{DUPLICATE}" == "-1" and json.dumps([PARTIAL, DUPLICATE]) == "[-2, -1]"
    assert core.DSKey is DSKey and core.PARTIAL is PARTIAL and core.DUPLICATE is DUPLICATE
    assert core.is_split is is_split and {"DSKey", "PARTIAL", "DUPLICATE", "is_split"} <= set(core.__all__)
    assert [is_split(k) for k in (PARTIAL, DUPLICATE, 0, 3)] == [False, False, True, True]


@pytest.mark.parametrize("named, ints, text", [
    (({DUPLICATE: 2, 0: 2},), ({-1: 2, 0: 2},), "D2 S0x2"),
    (({DUPLICATE: 2, 0: 2}, [0, DUPLICATE]), ({-1: 2, 0: 2}, [0, -1]), "S0x2 D2"),
    (({PARTIAL: 2, DUPLICATE: 2, 0: 4},), ({-2: 2, -1: 2, 0: 4},), "P2 D2 S0x4"),
    (({1: 2, PARTIAL: 2}, [1, PARTIAL]), ({1: 2, -2: 2}, [1, -2]), "S1x2 P2"),
    (({PARTIAL: 1, DUPLICATE: 1},), ({},), "R"),
])
def test_a_ds_with_named_keys_is_the_ds_with_integer_keys(named: tuple, ints: tuple, text: str) -> None:
    a, b = DS(*named), DS(*ints)
    assert a == b == DS(text) and hash(a) == hash(b)
    assert str(a) == text and repr(a) == f"DS({text!r})"
    assert a.model_dump() == b.model_dump() and a.model_dump_json() == b.model_dump_json()
    # stored as plain ints: what is dumped, pickled or written into a Program is the integer, never the enum
    assert all(type(k) is int for k in list(a.states) + a.order)
    assert pickle.loads(pickle.dumps(a)) == a


def test_the_json_and_string_forms_are_the_integers() -> None:
    ds = DS({DUPLICATE: 2, 0: 2})
    assert ds.model_dump_json() == '{"states":{"-1":2,"0":2},"order":[-1,0]}'
    assert ds.model_dump() == {"states": {-1: 2, 0: 2}, "order": [-1, 0]}
    ann = Annotation([[0, 1], [2, 3]], [DS({PARTIAL: 2}), DS({PARTIAL: 2})], PARTIAL)
    assert ann == Annotation("[0,1] P2 | [2,3] P2 ; hdim=-2") and str(ann) == "[0,1] P2 | [2,3] P2 ; hdim=-2"
    assert type(ann.hdim) is int and ann.model_dump()["hdim"] == -2
    assert ann.model_dump_json() == ('{"dg_union":[[0,1],[2,3]],"ds_union":[{"states":{"-2":2},"order":[-2]},'
                                     '{"states":{"-2":2},"order":[-2]}],"hdim":-2,"hratios":null}')
    # the default HDim and the HSize-1 normalisation store the plain int too
    for a in (Annotation([[0], [1]], [DS({}), DS({})]), Annotation([[0, 1]], [DS({DUPLICATE: 2})], PARTIAL)):
        assert type(a.hdim) is int and a.hdim == -1 and a.model_dump()["hdim"] == -1
    assert Annotation.model_validate_json(ann.model_dump_json()) == ann


def test_a_program_holds_plain_integers_and_round_trips() -> None:
    """A gradient synchronisation across pipelines is a SplitAllReduce from HDim Partial to Duplicate (§5.2): the
    resolver names both HDims, the Program's JSON writes them as ``-2``/``-1`` and reads them back equal."""
    from hspmd_sdk import Cluster, LlamaConfig, Strategy, specialize
    from hspmd_sdk.core.comm_ops import SplitCollectiveOp
    from hspmd_sdk.core.resolve import resolve
    from hspmd_sdk.core.specialize import Program
    from hspmd_sdk.core.strategy_plan import plan_from_strategy

    plan = resolve(Annotation("[0,1] P2 | [2,3] P2 ; hdim=-2"), Annotation("[0,1] D2 | [2,3] D2"), (4, 4), "float32")
    (op,) = [o for o in plan.ops if isinstance(o, SplitCollectiveOp)]
    assert op.kind == "SplitAllReduce"
    assert (op.src_hdim, op.dst_hdim) == (-2, -1) and type(op.src_hdim) is int and type(op.dst_hdim) is int
    pipe = {"stages": [{"devices": [0, 1], "layers": [0, 3]}], "micro_batch_size": 2, "num_micro_batches": 2}
    strategy = Strategy.load({"pipelines": [pipe, {**pipe, "stages": [{"devices": [2, 3], "layers": [0, 3]}]}]})
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(4)
    program = specialize(model, plan_from_strategy(model, strategy, cluster), cluster, bindings={"B": 8, "S": 16})
    syncs = [o for plan in program.grad_sync_plans.values() for o in plan.ops if isinstance(o, SplitCollectiveOp)]
    assert syncs and {(o.kind, o.src_hdim, o.dst_hdim) for o in syncs} == {("SplitAllReduce", -2, -1)}
    assert all(type(o.src_hdim) is int and type(o.dst_hdim) is int for o in syncs)
    text = program.to_json()
    assert "DSKey" not in text
    back = Program.from_json(text)
    assert back == program and back.to_json() == text


def test_the_program_writer_writes_an_enum_as_its_integer() -> None:
    from hspmd_sdk.core.program_json import from_json_value, to_json_value

    assert to_json_value({PARTIAL: [DUPLICATE, 0]}) == to_json_value({-2: [-1, 0]})
    assert from_json_value(to_json_value((PARTIAL, DUPLICATE))) == (-2, -1)


# ---- the core spells the keys by name ---------------------------------------------------------------------------
def _literal(node: ast.AST) -> int | None:
    """``-1`` or ``-2`` when ``node`` is that literal (``-2`` parses as ``USub(2)``), else ``None``."""
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant)
            and type(node.operand.value) is int and node.operand.value in (1, 2)):
        return -node.operand.value
    return None


def _mentions_hdim(node: ast.AST) -> bool:
    return any((isinstance(n, ast.Name) and "hdim" in n.id) or (isinstance(n, ast.Attribute) and "hdim" in n.attr)
               for n in ast.walk(node))


def bare_keys(source: str) -> list[tuple[int, int, str]]:
    """``(line, value, why)`` for every bare ``-2`` in ``source`` (but for an index from the end, ``x[-2]``, and
    :class:`DSKey`'s own definition), and every bare ``-1`` used where a key or an HDim is meant: a key of a dict
    literal, compared with an HDim, an HDim keyword, default or assignment (``-1`` is too common as an index, a
    "none yet" or a reshape wildcard to be found anywhere else without guessing)."""
    tree = ast.parse(source)
    parent: dict[ast.AST, ast.AST] = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    out = []
    for node in ast.walk(tree):
        v = _literal(node)
        if v is None:
            continue
        inner, up = node, parent.get(node)
        while isinstance(up, (ast.Slice, ast.Tuple, ast.List, ast.Set)):  # the nearest enclosing non-literal
            inner, up = up, parent.get(up)
        if isinstance(up, ast.Subscript) and up.slice is inner:
            continue  # an index or slice from the end
        if isinstance(up, ast.Assign) and isinstance(parent.get(up), ast.ClassDef) and parent[up].name == "DSKey":
            continue
        direct = parent.get(node)
        why = ""
        if isinstance(direct, ast.Dict) and any(k is node for k in direct.keys):
            why = "a dict key"
        elif isinstance(up, ast.Compare) and _mentions_hdim(up):
            why = "compared with an HDim"
        elif isinstance(up, ast.keyword) and up.arg and "hdim" in up.arg:
            why = "an hdim keyword"
        elif isinstance(up, (ast.Assign, ast.AnnAssign)) and _mentions_hdim(
                ast.Tuple(up.targets if isinstance(up, ast.Assign) else [up.target], ast.Load())):
            why = "assigned to an HDim"
        elif isinstance(direct, ast.arguments) and any(
                d is node and "hdim" in a.arg
                for a, d in zip(direct.args[len(direct.args) - len(direct.defaults):], direct.defaults)):
            why = "an hdim default"
        elif v == -2:
            why = "a bare -2"
        if why:
            out.append((node.lineno, v, why))
    return sorted(out)


def test_the_scan_finds_what_it_looks_for() -> None:
    src = ("swap = {-2: -1}\nif ann.hdim == -2:\n    pass\nf(hdim=-1)\nhdim = -1\ndef g(hdim=-1): pass\n"
           "key = -2\nok = xs[-2] + ys[-1] + zs[-2:] + m[..., -2] + t.reshape(-1)\nstep = -1\n"
           "if src.hdim in (-1, 0):\n    pass\n")
    assert bare_keys(src) == [(1, -2, "a dict key"), (2, -2, "compared with an HDim"), (4, -1, "an hdim keyword"),
                              (5, -1, "assigned to an HDim"), (6, -1, "an hdim default"), (7, -2, "a bare -2"),
                              (10, -1, "compared with an HDim")]


def test_the_core_names_its_keys() -> None:
    found = {f.name: bare_keys(f.read_text()) for f in sorted(CORE.rglob("*.py"))}
    assert {name: hits for name, hits in found.items() if hits} == {}
