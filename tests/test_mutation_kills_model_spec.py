"""Kills for the mutants of hspmd_sdk/core/model_spec.py (issue 49): a config's JSON with its family tag, the
placement table by tensor and its duplicate error, a Placement's default, the protocol check."""
from __future__ import annotations

import pytest

from hspmd_sdk import LlamaConfig
from hspmd_sdk.core.model_spec import ModelSpec, Placement, model_json, placements_by_tensor
from hspmd_sdk.errors import SpecializationError


class Cfg:
    """A stand-in config: model_dump(mode=...) records the mode it was asked for."""

    def __init__(self, data, family=None, places=()) -> None:
        self.data, self.places, self.modes = data, list(places), []
        if family is not None:
            self.family = family

    def model_dump(self, *, mode="python"):
        self.modes.append(mode)
        return dict(self.data)

    def placements(self):
        return self.places


def test_model_json_adds_the_family_tag_from_the_model_or_its_class() -> None:
    """JSON mode; the family of the config, else its class name; a family already in the data stays."""
    c = Cfg({"n": 1}, family="mine")
    assert model_json(c) == {"n": 1, "family": "mine"} and c.modes == ["json"]
    assert model_json(Cfg({"n": 1})) == {"n": 1, "family": "Cfg"}
    assert model_json(Cfg({"family": "kept"}, family="other")) == {"family": "kept"}
    tiny = LlamaConfig.preset("tiny")
    assert model_json(tiny) == {**tiny.model_dump(mode="json"), "family": "llama"}


def test_placements_by_tensor_in_order_and_refuses_a_tensor_placed_twice() -> None:
    """Keyed by tensor name in the model's order; a repeat names the model and the tensor."""
    a, b = Placement("x", "data", "first"), Placement("w", "parameter", 0, tp_split=1)
    table = placements_by_tensor(Cfg({}, places=[a, b]))
    assert table == {"x": a, "w": b} and list(table) == ["x", "w"]
    m = Cfg({}, places=[a, b, Placement("x", "activation", "last")])
    m.name = "toy"
    with pytest.raises(SpecializationError) as info:
        placements_by_tensor(m)
    assert str(info.value) == "model 'toy' places tensor 'x' twice"
    nameless = Cfg({}, places=[a, a])
    with pytest.raises(SpecializationError) as info:
        placements_by_tensor(nameless)
    assert str(info.value) == f"model {nameless!r} places tensor 'x' twice"


def test_placement_defaults() -> None:
    """tp_split defaults to None (Duplicate on the stage); a Placement is frozen."""
    p = Placement("x", "data", "first")
    assert p.tp_split is None and (p.tensor, p.kind, p.where) == ("x", "data", "first")
    with pytest.raises(Exception):
        p.where = 1


def test_configs_are_model_specs() -> None:
    """The runtime-checkable protocol accepts a family's config and refuses a plain object.  (Left out of the
    mutation run: its copy's undecorated property adds a protocol member no config has.)"""
    assert isinstance(LlamaConfig.preset("tiny"), ModelSpec) and not isinstance(object(), ModelSpec)
