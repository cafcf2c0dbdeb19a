"""The independent reference for resolution tests: per-rank inputs and expected outputs from a global tensor.

Built from ``local_view`` and numpy alone -- never from a plan.
"""
from __future__ import annotations

import numpy as np

from hspmd_sdk.core.annotation import Annotation, local_views


def _family(ann: Annotation, subgroup: int) -> int:
    """Views whose summands add up together: every rank when HDim is -2, else one subgroup."""
    return -1 if ann.hdim == -2 else subgroup


def source_inputs(src: Annotation, shape: tuple[int, ...], value: np.ndarray,
                  rng: np.random.Generator) -> dict[int, np.ndarray]:
    """Each source rank's local tensor: its box of a random decomposition of ``value`` into summands.

    Summand i < count-1 is random, the last is value minus the others; ranks with equal family, box and summand
    index get identical data.
    """
    summands: dict[tuple[int, int], list[np.ndarray]] = {}
    out = {}
    for v in local_views(src, shape):
        key = (_family(src, v.subgroup), v.partial_count)
        if key not in summands:
            parts = [rng.standard_normal(shape) for _ in range(v.partial_count - 1)]
            parts.append(value - sum(parts, np.zeros(shape)))
            summands[key] = parts
        out[v.rank] = summands[key][v.partial_index][v.slices].copy()
    return out


def check_destination(dst: Annotation, shape: tuple[int, ...], value: np.ndarray,
                      out: dict[int, np.ndarray]) -> None:
    """Every destination rank holds its box of ``value`` or, for Partial, summands that add up to it."""
    assert set(out) == set(dst.ranks)
    families: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    regions: dict[int, tuple[slice, ...]] = {}
    for v in local_views(dst, shape):
        got = np.asarray(out[v.rank])
        assert got.shape == v.shape, (v.rank, got.shape, v.shape)
        if v.partial_count == 1:
            np.testing.assert_allclose(got, value[v.slices], rtol=1e-9, atol=1e-9, err_msg=f"rank {v.rank}")
            continue
        fam = _family(dst, v.subgroup)
        regions[fam] = tuple(slice(a, b) for a, b in dst.subgroup_box(shape, v.subgroup)) if fam >= 0 else \
            tuple(slice(0, n) for n in shape)
        acc, seen = families.setdefault(fam, {}).setdefault(
            v.partial_index, (np.zeros(shape), np.zeros(shape, dtype=bool)))
        overlap = seen[v.slices]
        np.testing.assert_allclose(got[overlap], acc[v.slices][overlap], rtol=1e-9, atol=1e-9,
                                   err_msg=f"copies of summand {v.partial_index} disagree (rank {v.rank})")
        acc[v.slices] = got
        seen[v.slices] = True
    for fam, parts in families.items():
        region = regions[fam]
        total = np.zeros(shape)
        for acc, seen in parts.values():
            assert seen[region].all(), f"summand not covering its region in family {fam}"
            total += acc
        np.testing.assert_allclose(total[region], value[region], rtol=1e-9, atol=1e-9)
