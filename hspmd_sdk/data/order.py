"""The deterministic global sample order: which samples make up step ``k``, for every dataset and every plan.

Sample positions ``k*B .. k*B+B-1`` of an endless stream; the stream visits the ``n`` samples epoch by epoch, each
epoch ``e`` in the permutation ``np.random.default_rng([seed, e]).permutation(n)``.  A pure function of
``(seed, step, B, n)``: the plan, the rank and the machine never enter.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

#: ``permutation(epoch) -> the epoch's order of the samples`` (what :func:`sample_indices` draws from).
Permutation = Callable[[int], np.ndarray]


def epoch_permutation(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    """The order in which epoch ``epoch`` visits ``num_samples`` samples under ``seed``."""
    return np.random.default_rng([int(seed), int(epoch)]).permutation(int(num_samples))


def sample_indices(step: int, global_batch_size: int, num_samples: int, seed: int, *,
                   permutation: Permutation | None = None) -> np.ndarray:
    """Sample indices of a step: positions ``step*B ..`` of per-epoch permutations seeded by ``(seed, epoch)``.

    ``permutation`` (optional) gives an epoch's permutation, e.g. from a :class:`PermutationCache`; it must be
    :func:`epoch_permutation` of the same ``seed`` and ``num_samples``."""
    if step < 0 or global_batch_size < 1:
        raise ValueError(f"step must be >= 0 and global_batch_size >= 1 (got {step}, {global_batch_size})")
    if num_samples < 1:
        raise ValueError(f"there must be at least one sample to draw from, not {num_samples}")
    perm_of = permutation or (lambda epoch: epoch_permutation(seed, epoch, num_samples))
    positions = np.arange(step * global_batch_size, (step + 1) * global_batch_size, dtype=np.int64)
    epochs, offsets = positions // num_samples, positions % num_samples
    out = np.empty(global_batch_size, dtype=np.int64)
    for epoch in np.unique(epochs):
        mask = epochs == epoch
        out[mask] = perm_of(int(epoch))[offsets[mask]]
    return out


class PermutationCache:
    """The last few epoch permutations of one dataset (an instance's own cache: no global state), so consecutive
    steps of one epoch draw the permutation once."""

    def __init__(self, size: int = 2) -> None:
        self.size = max(int(size), 1)
        self._perms: dict[tuple[int, int, int], np.ndarray] = {}

    def get(self, seed: int, epoch: int, num_samples: int) -> np.ndarray:
        key = (int(seed), int(epoch), int(num_samples))
        got = self._perms.get(key)
        if got is None:
            got = epoch_permutation(seed, epoch, num_samples)
            got.setflags(write=False)
            if len(self._perms) >= self.size:
                self._perms.pop(next(iter(self._perms)))
            self._perms[key] = got
        return got

    def indices(self, step: int, global_batch_size: int, num_samples: int, seed: int) -> np.ndarray:
        """:func:`sample_indices` drawing permutations from this cache."""
        return sample_indices(step, global_batch_size, num_samples, seed,
                              permutation=lambda epoch: self.get(seed, epoch, num_samples))
