"""The layout oracle itself (``layout_oracle``), checked three independent ways, and shown to catch a layout bug.

* by hand: boxes typed in from the paper's examples (§4, Figures 4 and 6 as the text describes them, SPEC §1) and
  from the definitions (orders, three-key DS, HDim ratios, HDim -2 summands), plus the errors;
* against PyTorch DTensor: for one device group with Shard / Replicate / Partial placements, each rank's
  ``(local shape, global offset)`` from ``compute_local_shape_and_global_offset`` on a real ``DeviceMesh`` (a
  ``fake``-backend world, one process, the rank varied) equals the oracle's box.  The DS maps to a mesh whose
  dims are the DS keys in order (the first key the slowest mesh dim) over the DG in row-major order -- the SDK's
  documented device order, "last key fastest";
* the mutation check: with the SDK's ``DS.coords`` patched so that the FIRST key varies fastest (the audit's bug),
  the oracle-based checks of resolution, switching and checkpoint planning fail on some generated case, while
  they pass on the same cases unpatched.
"""
from __future__ import annotations

import random
from typing import Any, Callable

import numpy as np
import pytest

import layout_oracle as oracle
from layout_oracle import ALL, LayoutError, annotation, layout
from resolve_reference import check_destination, plain, random_pair, source_inputs


# ---- by hand -------------------------------------------------------------------------------------------------
HAND: list[tuple[str, dict[str, Any], tuple[int, ...], dict[int, tuple]]] = [
    # SPEC §1's example: {-1: 2, 0: 2}, default order [-1, 0]: positions 0,1 hold chunks 0,1 (replica 0), 2,3 again
    ("spec-example", annotation([[0, 1, 2, 3]], [{-1: 2, 0: 2}]), (4, 6),
     {0: ((0, 2), (0, 6)), 1: ((2, 4), (0, 6)), 2: ((0, 2), (0, 6)), 3: ((2, 4), (0, 6))}),
    # the same states in order [0, -1]: now the split is the slow digit
    ("order-split-first", annotation([[0, 1, 2, 3]], [({-1: 2, 0: 2}, [0, -1])]), (4, 6),
     {0: ((0, 2), (0, 6)), 1: ((0, 2), (0, 6)), 2: ((2, 4), (0, 6)), 3: ((2, 4), (0, 6))}),
    # Figure 4 (left): DP2 x TP2 over GPU 0-3; W column-parallel (TP fastest): GPUs 0,2 cols 0:4, GPUs 1,3 cols 4:8
    ("fig4-left-W", annotation([[0, 1, 2, 3]], [({-1: 2, 1: 2}, [-1, 1])]), (6, 8),
     {0: ((0, 6), (0, 4)), 1: ((0, 6), (4, 8)), 2: ((0, 6), (0, 4)), 3: ((0, 6), (4, 8))}),
    # a DG that is not sorted: position, not rank number, decides
    ("unsorted-dg", annotation([[3, 1, 2, 0]], [{1: 4}]), (2, 8),
     {3: ((0, 2), (0, 2)), 1: ((0, 2), (2, 4)), 2: ((0, 2), (4, 6)), 0: ((0, 2), (6, 8))}),
    # Figures 4 (right) and 6: X of HSize 3, HDim 0 over subgroups [0,3] (TP: X duplicated), [1], [2,4] (CP: the
    # sequence dim split); batch 6 -> 2 rows per subgroup
    ("fig6-X", annotation([[0, 3], [1], [2, 4]], [{-1: 2}, {}, {1: 2}], 0), (6, 4, 8),
     {0: ((0, 2), (0, 4), (0, 8)), 3: ((0, 2), (0, 4), (0, 8)), 1: ((2, 4), (0, 4), (0, 8)),
      2: ((4, 6), (0, 2), (0, 8)), 4: ((4, 6), (2, 4), (0, 8))}),
    # ... and W of the same figure: HDim -1 (each subgroup holds all of W), TP-split in the first subgroup
    ("fig6-W", annotation([[0, 3], [1], [2, 4]], [{1: 2}, {}, {-1: 2}], -1), (8, 6),
     {0: ((0, 8), (0, 3)), 3: ((0, 8), (3, 6)), 1: ((0, 8), (0, 6)), 2: ((0, 8), (0, 6)), 4: ((0, 8), (0, 6))}),
    # SPEC §1's JSON example: [[0, 3], [5, 6]], S1x2 each, HDim -1
    ("spec-json", annotation([[0, 3], [5, 6]], [{1: 2}, {1: 2}], -1), (2, 4),
     {0: ((0, 2), (0, 2)), 3: ((0, 2), (2, 4)), 5: ((0, 2), (0, 2)), 6: ((0, 2), (2, 4))}),
    # HDim 0, ratios 1:2 (HAP-style uneven): rows 0:2 | 2:6, the second subgroup split again in two
    ("ratios-1-2", annotation([[0], [1, 2]], [{}, {0: 2}], 0, [1, 2]), (6, 2),
     {0: ((0, 2), (0, 2)), 1: ((2, 4), (0, 2)), 2: ((4, 6), (0, 2))}),
    # Figure 9-like (before a SplitAllGather): HDim 0 in ratios 2:1, TP2 | TP3 on dim 1
    ("ratios-2-1", annotation([[0, 1], [2, 3, 4]], [{1: 2}, {1: 3}], 0, [2, 1]), (6, 6),
     {0: ((0, 4), (0, 3)), 1: ((0, 4), (3, 6)), 2: ((4, 6), (0, 2)), 3: ((4, 6), (2, 4)), 4: ((4, 6), (4, 6))}),
    # HDim and the bottom tier split the same dim: cols 0:4 | 4:8, then 0:2, 2:4 in the first subgroup
    ("hdim-and-split-same-dim", annotation([[0, 1], [2]], [{1: 2}, {}], 1), (2, 8),
     {0: ((0, 2), (0, 2)), 1: ((0, 2), (2, 4)), 2: ((0, 2), (4, 8))}),
]


@pytest.mark.parametrize("name,ann,shape,want", HAND, ids=[h[0] for h in HAND])
def test_hand_written_boxes(name: str, ann: dict[str, Any], shape: tuple[int, ...], want: dict[int, tuple]) -> None:
    got = layout(ann, shape)
    assert {r: h.box for r, h in got.items()} == want
    assert not any(h.partial for h in got.values())


def test_three_keys_in_a_custom_order() -> None:
    """{-2: 2, 0: 2, 1: 2} in order [1, -2, 0] over ranks 7..0: digits (c1, cP, c0), c0 the fastest."""
    ann = annotation([[7, 6, 5, 4, 3, 2, 1, 0]], [({-2: 2, 0: 2, 1: 2}, [1, -2, 0])])
    want = {7: ((0, 2), (0, 2), 0), 6: ((2, 4), (0, 2), 0), 5: ((0, 2), (0, 2), 1), 4: ((2, 4), (0, 2), 1),
            3: ((0, 2), (2, 4), 0), 2: ((2, 4), (2, 4), 0), 1: ((0, 2), (2, 4), 1), 0: ((2, 4), (2, 4), 1)}
    got = layout(ann, (4, 4))
    assert {r: (*h.box, h.index) for r, h in got.items()} == want
    assert {(h.family, h.count, h.region) for h in got.values()} == {(0, 2, ((0, 4), (0, 4)))}


def test_figure_4_left_dot_output_is_partial() -> None:
    """Y = X W with X split on its last dim and W on its first over TP (the split becomes Partial, §4.1): Y's DS
    {0: 2 (DP), -2: 2 (TP)} over GPU 0-3; GPUs 0,1 hold rows 0:2 (summands 0, 1), GPUs 2,3 rows 2:4 (summands
    0, 1): one family whose two summands add up to Y."""
    ann = annotation([[0, 1, 2, 3]], [({0: 2, -2: 2}, [0, -2])])
    got = layout(ann, (4, 8))
    assert {r: (h.box, h.index, h.count) for r, h in got.items()} == {
        0: (((0, 2), (0, 8)), 0, 2), 1: (((0, 2), (0, 8)), 1, 2),
        2: (((2, 4), (0, 8)), 0, 2), 3: (((2, 4), (0, 8)), 1, 2)}
    value = np.arange(32.0).reshape(4, 8)
    parts = [np.full((4, 8), 1.5), value - 1.5]
    local = oracle.materialize(ann, (4, 8), summands={0: parts})
    np.testing.assert_array_equal(local[1], value[0:2] - 1.5)
    np.testing.assert_array_equal(local[2], np.full((2, 8), 1.5))
    oracle.check_local_arrays(ann, (4, 8), value, local, exact=True)


def test_hdim_minus_2_numbers_summands_over_every_subgroup() -> None:
    """HDim -2: T = T_0 + T_1 with T_0 itself Partial 2 on [0, 1]: three summands of one family, all whole."""
    ann = annotation([[0, 1], [2]], [{-2: 2}, {}], -2)
    got = layout(ann, (3,))
    assert {r: (h.box, h.family, h.index, h.count) for r, h in got.items()} == {
        0: (((0, 3),), ALL, 0, 3), 1: (((0, 3),), ALL, 1, 3), 2: (((0, 3),), ALL, 2, 3)}
    value = np.array([1.0, 2.0, 3.0])
    local = oracle.materialize(ann, (3,), value, rng=np.random.default_rng(0))
    np.testing.assert_allclose(local[0] + local[1] + local[2], value)
    oracle.check_local_arrays(ann, (3,), value, local)
    with pytest.raises(AssertionError, match="do not add up"):
        oracle.check_local_arrays(ann, (3,), value, {**local, 2: local[2] + 1})


def test_materialize_and_check_whole_tensors() -> None:
    ann = HAND[0][1]
    value = np.arange(24.0).reshape(4, 6)
    local = oracle.materialize(ann, (4, 6), value)
    np.testing.assert_array_equal(local[1], value[2:4])
    np.testing.assert_array_equal(local[2], value[0:2])
    oracle.check_local_arrays(ann, (4, 6), value, local, exact=True)
    with pytest.raises(AssertionError):  # ranks 1 and 2 swapped
        oracle.check_local_arrays(ann, (4, 6), value, {**local, 1: local[2], 2: local[1]}, exact=True)


@pytest.mark.parametrize("ann,shape,match", [
    (annotation([[0, 1, 2]], [{0: 3}]), (4, 2), "equal chunks"),                      # no padding
    (annotation([[0], [1]], [{}, {}], 0, [1, 1]), (5,), "not integral"),               # 5 in halves
    (annotation([[0], [1]], [{}, {}], 0, [1, 2]), (4,), "not integral"),               # 4 in thirds
    (annotation([[0, 1], [1]], [{0: 2}, {}]), (4,), "distinct"),                       # a rank twice
    (annotation([[0, 1, 2]], [{0: 2}]), (4,), "spans 2"),                             # DG / DS sizes
    (annotation([[0, 1, 2, 3]], [({0: 2, 1: 2}, [0])]), (4, 4), "permutation"),         # order misses a key
    (annotation([[0, 1]], [{2: 2}]), (4, 4), "dim 2"),                                 # no such dim
])
def test_what_does_not_fit_is_an_error(ann: dict[str, Any], shape: tuple[int, ...], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        layout(ann, shape)


def test_degree_one_keys_are_no_axis_and_the_sdk_reads_the_same_order() -> None:
    """A degree-1 key changes nothing; the SDK's DS (public ``states`` / ``order``) read through the adapter gives
    the oracle the layout of the plain default order (keys ascending)."""
    from hspmd_sdk.core.annotation import DS, Annotation

    a = layout(annotation([[0, 1, 2, 3]], [({-1: 2, 0: 2, 1: 1}, [1, 0, -1])]), (4, 4))
    b = layout(annotation([[0, 1, 2, 3]], [({0: 2, -1: 2}, [0, -1])]), (4, 4))
    assert a == b
    for states in ({-1: 2, 0: 2}, {1: 2, -2: 2, 0: 2}, {0: 3, -1: 2}):
        sdk = Annotation([list(range(int(np.prod(list(states.values())))))], [DS(states)])
        shape = (6, 6)
        assert layout(plain(sdk), shape) == layout(annotation(sdk.dg_union, [(states, None)]), shape), states


# ---- against DTensor -----------------------------------------------------------------------------------------
def _dtensor_cases(n: int, seed: int = 0) -> list[tuple[list[int], dict[int, int], list[int], tuple[int, ...], int]]:
    """(dg, states, order, shape, world): one device group, keys among Partial, Duplicate and split dims."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ndim = rng.randint(1, 3)
        keys = rng.sample([-2, -1] + list(range(ndim)), rng.randint(1, min(3, ndim + 2)))
        states = {k: rng.choice([2, 2, 3, 4]) for k in keys}
        order = rng.sample(keys, len(keys))
        size = int(np.prod(list(states.values())))
        world = size + rng.randint(0, 3)
        dg = rng.sample(range(world), size)
        shape = tuple(states.get(d, 1) * rng.randint(1, 3) for d in range(ndim))
        out.append((dg, states, order, shape, world))
    return out


def test_the_oracle_agrees_with_dtensor_on_one_device_group() -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():  # pragma: no cover - never in this suite
        pytest.skip("a process group is already initialised in this process")
    checked = 0
    for dg, states, order, shape, world in _dtensor_cases(120):
        ann = annotation([dg], [(states, order)])
        want = layout(ann, shape)
        mesh_shape = [states[k] for k in order]
        placements = [Partial() if k == -2 else Replicate() if k == -1 else Shard(k) for k in order]
        for rank in range(world):
            dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
            try:
                mesh = DeviceMesh("cpu", torch.tensor(dg).reshape(mesh_shape), _init_backend=False)
                coordinate = mesh.get_coordinate()
                if rank in want:
                    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
            finally:
                dist.destroy_process_group()
            if rank not in want:
                assert coordinate is None, (dg, rank)
                continue
            h = want[rank]
            box = tuple((o, o + s) for o, s in zip(offset, local_shape))
            assert box == h.box, (dg, states, order, shape, rank, box, h.box)
            if -2 in states:  # the mesh coordinate of the Partial dim is the summand number
                assert h.index == dict(zip(order, coordinate))[-2], (dg, states, order, rank)
            checked += 1
    assert checked > 500


# ---- the mutation check --------------------------------------------------------------------------------------
def _first_key_fastest(self: Any, position: int) -> dict[int, int]:
    """The audit's bug: ``DS.coords`` with the FIRST key of ``order`` varying fastest."""
    out: dict[int, int] = {}
    for key in self.order:
        n = self.states[key]
        out[key] = position % n
        position //= n
    return out


def _resolution_case(rng: random.Random, i: int) -> Callable[[], None]:
    src, dst, shape = random_pair(rng, ["bottom", "top", "random"][i % 3], range(rng.randint(2, 8)), 1024)

    def check() -> None:
        from hspmd_sdk.core.resolve import resolve

        plan = resolve(src, dst, shape)
        nrng = np.random.default_rng(i)
        value = nrng.standard_normal(shape)
        check_destination(dst, shape, value, plan.simulate(source_inputs(src, shape, value, nrng)))
    return check


def _switch_case(rng: random.Random, i: int) -> Callable[[], None]:
    from test_switch import check_switch, random_switch

    src, dst, failed = random_switch(rng)
    return lambda: check_switch(src, dst, failed, fused=bool(i % 2), heuristics=True, seed=i)


def _checkpoint_case(rng: random.Random, i: int) -> Callable[[], None]:
    from test_checkpoint import check_save_and_load, random_layouts

    saved, loaded = random_layouts(rng)
    return lambda: check_save_and_load(saved, loaded, seed=i)


@pytest.mark.parametrize("make", [_resolution_case, _switch_case, _checkpoint_case],
                         ids=["resolution", "switching", "checkpoint"])
def test_the_oracle_catches_the_first_key_fastest_bug(make: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded cases, one at a time: the first that the patched SDK gets wrong (an ``AssertionError`` of the
    oracle's check) must come within 200 draws, and must pass unpatched."""
    from hspmd_sdk.core.annotation import DS

    rng = random.Random(7)
    for i in range(200):
        check = make(rng, i)
        with monkeypatch.context() as m:
            m.setattr(DS, "coords", _first_key_fastest)
            try:
                check()
            except AssertionError:  # the oracle's check failed: caught
                break
            except Exception:  # noqa: BLE001 - the patched SDK failing on its own is not the oracle's catch
                pass
        check()  # unpatched: every case passes
    else:
        pytest.fail("no generated case exposes DS.coords with the first key fastest")
    check()  # the one that exposed it passes unpatched
