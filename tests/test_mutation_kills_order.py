"""Kills for the mutants of hspmd_sdk/data/order.py (issue 49): the global sample order, value for value, its
argument checks and messages, and the bounded permutation cache.  All fast and in-process."""
from __future__ import annotations

import numpy as np
import pytest

from hspmd_sdk.data.order import PermutationCache, epoch_permutation, sample_indices


def _reference(step: int, b: int, n: int, seed: int) -> list[int]:
    """The documented order, written out: position p is sample perm(seed, p // n)[p % n]."""
    out = []
    for p in range(step * b, (step + 1) * b):
        out.append(int(np.random.default_rng([seed, p // n]).permutation(n)[p % n]))
    return out


def test_order_epoch_permutation_is_the_seeded_numpy_permutation() -> None:
    """``default_rng([seed, epoch]).permutation(n)``; arguments are taken as ints."""
    assert epoch_permutation(3, 1, 10).tolist() == np.random.default_rng([3, 1]).permutation(10).tolist()
    assert epoch_permutation(np.int32(3), np.int64(1), np.int64(10)).tolist() == epoch_permutation(3, 1, 10).tolist()
    assert sorted(epoch_permutation(0, 0, 7).tolist()) == list(range(7))
    assert epoch_permutation(0, 0, 7).tolist() != epoch_permutation(0, 1, 7).tolist()


@pytest.mark.parametrize("step,b,n", [(0, 1, 1), (0, 4, 10), (2, 4, 10), (1, 7, 10), (3, 5, 4), (0, 10, 10)])
def test_order_sample_indices_follow_the_documented_stream(step: int, b: int, n: int) -> None:
    """Every step (first, inside one epoch, straddling epochs, a batch larger than the dataset) is exactly the
    documented positions of per-epoch permutations, as int64."""
    got = sample_indices(step, b, n, seed=5)
    assert got.dtype == np.int64 and got.shape == (b,)
    assert got.tolist() == _reference(step, b, n, 5)


def test_order_sample_indices_checks_its_arguments_with_messages() -> None:
    """Step >= 0, batch >= 1, samples >= 1 (the bounds themselves are allowed); each message names the values."""
    assert sample_indices(0, 1, 1, seed=0).tolist() == [0]
    with pytest.raises(ValueError) as e:
        sample_indices(-1, 4, 10, seed=0)
    assert str(e.value) == "step must be >= 0 and global_batch_size >= 1 (got -1, 4)"
    with pytest.raises(ValueError) as e:
        sample_indices(0, 0, 10, seed=0)
    assert str(e.value) == "step must be >= 0 and global_batch_size >= 1 (got 0, 0)"
    with pytest.raises(ValueError) as e:
        sample_indices(0, 2, 0, seed=0)
    assert str(e.value) == "there must be at least one sample to draw from, not 0"


def test_order_sample_indices_draws_from_the_permutation_given() -> None:
    """A ``permutation`` callable is used instead of the default, called once per epoch with a Python int."""
    calls = []

    def perm(epoch):
        calls.append(epoch)
        return np.arange(10)[::-1] + 100 * epoch

    assert sample_indices(1, 7, 10, seed=5, permutation=perm).tolist() == [2, 1, 0, 109, 108, 107, 106]
    assert calls == [0, 1] and all(type(c) is int for c in calls)


def test_order_cache_gives_the_same_indices_and_read_only_arrays() -> None:
    """The cache's indices equal sample_indices; its permutations are read-only (a caller cannot corrupt the
    cache) and the same array for the same key."""
    cache = PermutationCache()
    for step in range(4):
        assert cache.indices(step, 7, 10, 5).tolist() == sample_indices(step, 7, 10, 5).tolist()
    p = cache.get(5, 0, 10)
    assert p.tolist() == epoch_permutation(5, 0, 10).tolist()
    assert not p.flags.writeable
    with pytest.raises(ValueError):
        p[0] = 1
    assert cache.get(5, 0, 10) is p
    assert cache.get(np.int64(5), np.int64(0), np.int64(10)) is p


def test_order_cache_keeps_at_most_size_permutations_dropping_the_oldest() -> None:
    """Bounded memory: at most ``size`` (at least 1, default 2) permutations; a new one evicts the oldest."""
    assert PermutationCache().size == 2
    assert PermutationCache(0).size == 1 and PermutationCache(-3).size == 1 and PermutationCache(3.7).size == 3
    cache = PermutationCache(2)
    a = cache.get(1, 0, 5)
    cache.get(1, 1, 5)
    assert list(cache._perms) == [(1, 0, 5), (1, 1, 5)]
    cache.get(1, 2, 5)
    assert list(cache._perms) == [(1, 1, 5), (1, 2, 5)]
    b = cache.get(1, 0, 5)  # evicted: drawn again, equal but a new array
    assert b is not a and b.tolist() == a.tolist()
    assert list(cache._perms) == [(1, 2, 5), (1, 0, 5)]
    one = PermutationCache(0)
    one.get(1, 0, 5)
    one.get(1, 1, 5)
    assert list(one._perms) == [(1, 1, 5)]


def test_order_cache_indices_draw_through_the_cache() -> None:
    """``indices`` takes its permutations from the cache (a step straddling two epochs stores both), so the next
    step reuses epoch 1's permutation and draws only epoch 2's."""
    cache = PermutationCache(4)
    cache.indices(1, 7, 10, 5)
    assert list(cache._perms) == [(5, 0, 10), (5, 1, 10)]
    p = cache._perms[(5, 1, 10)]
    cache.indices(2, 7, 10, 5)
    assert cache._perms[(5, 1, 10)] is p and list(cache._perms) == [(5, 0, 10), (5, 1, 10), (5, 2, 10)]
