"""ZeRO-3's bookkeeping (:class:`hspmd_sdk.runtime.workers.zero3.Zero3Params`) without processes: a fake gather
(``start(k)`` returns the unit's values, counting the calls) stands in for the collectives, so each rule is checked
on its own -- what is filled when, what is freed when, the prefetch, the aliases, the backward's refill and the
passes a replica with fewer micro-batches joins.  The training itself is checked against the single-device model in
``test_zero3.py``."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hspmd_sdk.runtime.workers.comm import Pending  # noqa: E402
from hspmd_sdk.runtime.workers.zero3 import Zero3Params  # noqa: E402

UNITS = [["emb"], ["l0.a", "l0.b"], ["l1.a"]]
VALUES = {"emb": torch.arange(6.0).reshape(2, 3), "l0.a": torch.ones(4), "l0.b": torch.full((2, 2), 2.0),
          "l1.a": torch.tensor([5.0, 6.0])}


class Fake:
    """The gathers: ``posts`` lists the units posted, in order; each value a fresh tensor (as a collective's)."""

    def __init__(self) -> None:
        self.posts: list[int] = []
        self.watched: list[str] = []

    def start(self, k: int) -> list[Pending]:
        self.posts.append(k)
        return [Pending.done(VALUES[m].clone()) for m in UNITS[k]]

    def params(self) -> Zero3Params:
        return Zero3Params([list(u) for u in UNITS], self.start, lambda name, leaf: self.watched.append(name))


def _nbytes(*names: str) -> int:
    return sum(VALUES[n].numel() * VALUES[n].element_size() for n in names)


def _held(z: Zero3Params, name: str) -> int:
    """The bytes of ``name``'s leaf storage (never put a freed leaf itself in an assertion: printing it reads
    memory it no longer has)."""
    return int(z.leaves[name].untyped_storage().nbytes())


def test_a_read_fills_its_unit_and_posts_the_next() -> None:
    fake = Fake()
    z = fake.params()
    leaf = z.read("l0.b")
    assert torch.equal(leaf, VALUES["l0.b"]) and leaf.requires_grad and leaf.is_leaf
    assert fake.posts == [1, 2]  # its unit, then the next one (prefetch)
    assert torch.equal(z.read("l0.a"), VALUES["l0.a"]) and fake.posts == [1, 2]  # already filled
    assert torch.equal(z.read("l1.a"), VALUES["l1.a"]) and fake.posts == [1, 2]  # the prefetched one
    assert fake.watched == ["l0.a", "l0.b", "l1.a"]  # one leaf each, watched once
    assert z.held_bytes == z.peak_bytes == _nbytes("l0.a", "l0.b", "l1.a")
    assert z.gathers == 2


def test_the_last_name_dropped_frees_the_storage_and_a_later_read_refills_it() -> None:
    fake = Fake()
    z = fake.params()
    first = z.read("emb")
    z.dropped("emb")
    assert _held(z, "emb") == 0 and z.held_bytes == 0  # (l0's prefetched values are placed when read)
    again = z.read("emb")
    assert again is first and _held(z, "emb") == _nbytes("emb")  # the same leaf, its storage filled again
    assert torch.equal(again, VALUES["emb"])
    assert fake.posts == [0, 1, 0]  # l0's gathers are still posted: no second prefetch
    z.read("l0.a")
    assert fake.posts == [0, 1, 0, 2] and z.held_bytes == _nbytes("emb", "l0.a", "l0.b")
    z.dropped("l0.b")  # never read in this pass: nothing of it was live
    assert _held(z, "l0.b") == _nbytes("l0.b")
    z.dropped("l0.a")
    assert _held(z, "l0.a") == 0 and z.held_bytes == _nbytes("emb", "l0.b")


def test_an_alias_keeps_the_parameter_until_its_own_last_reader() -> None:
    """A view of a gathered parameter (a ``split`` of a fused weight) shares its storage: the parameter stays
    filled until the view is dropped too; an output that is not a view does not hold it."""
    z = Fake().params()
    w = z.read("l0.b")
    view, copy = w[0], w[1] * 2
    out = z.produced(("l0.b",), {"half": view, "scaled": copy})
    z.dropped("l0.b")
    assert _held(z, "l0.b") > 0  # "half" still reads it
    z.dropped("scaled")
    assert _held(z, "l0.b") > 0
    z.dropped("half")
    assert _held(z, "l0.b") == 0
    assert z.owners(["half", "x"]) == ("l0.b",) and z.owners(["scaled"]) == ()
    assert out["half"].requires_grad and out["scaled"].requires_grad


def test_the_backward_refills_what_the_forward_freed_and_frees_it_once_its_gradient_is_in() -> None:
    """y = sum(w * x): w is freed after the forward; the backward of the operator that read it needs it, so the
    output's wrapper refills it first (one more gather of its unit); once autograd has accumulated w's gradient it
    is freed again.  The gradient is the one of the filled values."""
    fake = Fake()
    z = fake.params()
    w = z.read("l1.a")
    x = torch.tensor([1.0, -1.0])
    y = z.produced(("l1.a",), {"y": (w * x).sum()})["y"]
    z.dropped("l1.a")
    assert _held(z, "l1.a") == 0 and fake.posts == [2]
    y.backward()
    assert fake.posts == [2, 2]  # refilled for the backward
    grad = w.grad
    assert torch.equal(grad, x) and _held(z, "l1.a") == 0 and z.held_bytes == 0


def test_a_replica_with_fewer_micro_batches_joins_the_recorded_passes() -> None:
    fake = Fake()
    z = fake.params()
    with z.recording("F"):
        z.read("emb")
        z.read("l1.a")
    assert z.sequences["F"] == [0, 1, 2]  # emb, its prefetched next, then l1 (read, nothing after it)
    fake.posts.clear()
    z.phantom("F", 2)
    assert fake.posts == [0, 1, 2, 0, 1, 2]
    z.phantom("B", 3)  # nothing recorded for the backward: nothing to join
    assert fake.posts == [0, 1, 2, 0, 1, 2]
    assert _held(z, "emb") == _nbytes("emb")  # the phantoms' values are dropped, not placed


def test_a_new_step_forgets_the_leaves_and_the_counts() -> None:
    fake = Fake()
    z = fake.params()
    old = z.read("emb")
    z.begin_step()
    assert z.leaves == {} and z.held_bytes == z.peak_bytes == z.gathers == 0 and z.sequences == {}
    assert z.read("emb") is not old and fake.watched == ["emb", "emb"]
