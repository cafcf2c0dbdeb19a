"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of planner/mixed.py.

Only its pure functions are mutated (the cfg's [select]); every figure here is worked out by hand on a few
sequence lengths, so that each test runs in milliseconds.
"""
from __future__ import annotations

import pytest

from hspmd_sdk.planner.mixed import Method, _boundaries, micro_batches, packed_rows


def test_boundaries_are_one_and_one_and_a_half_powers_of_two_below_the_context() -> None:
    """1K, 1.5K, 2K, 3K, ... strictly below the context, then the context itself."""
    assert _boundaries(8192) == [1024, 1536, 2048, 3072, 4096, 6144, 8192]
    assert _boundaries(3000) == [1024, 1536, 2048, 3000]
    assert _boundaries(1024) == [1024]
    assert _boundaries(1536) == [1024, 1536]


def test_method_names_and_sizes() -> None:
    """``str`` names kind, TP, CP (only above 1), PP and recomputation; width = tp * cp, devices = width * pp."""
    m = Method("H800", 2, 3, True, 4)
    assert str(m) == "H800 TP2CP4PP3+AC" and m.width == 8 and m.devices == 24
    assert str(Method("H20", 4, 1)) == "H20 TP4PP1"


def test_micro_batches_and_packed_rows_name_a_sequence_too_long() -> None:
    """The error names the sequence's length and the window."""
    with pytest.raises(ValueError, match="^a sequence of 9 tokens does not fit a window of 8$"):
        micro_batches([3, 9], 8)
    with pytest.raises(ValueError, match="^a sequence of 9 tokens does not fit a window of 8$"):
        packed_rows([3, 9], 8)


def test_micro_batches_by_hand() -> None:
    """Longest first (ties by index); a sequence joins the open micro-batch while rows x its longest <= window."""
    assert micro_batches([4, 4, 3], 8) == [[0, 1], [2]]
    assert micro_batches([2, 5, 2, 2, 2], 8) == [[1], [0, 2, 3, 4]]
    assert micro_batches([3, 3, 3], 9) == [[0, 1, 2]]
    assert micro_batches([8], 8) == [[0]]
    assert micro_batches([], 8) == []


def test_packed_rows_by_hand() -> None:
    """Longest first; a sequence joins the open row while the row's tokens stay within the window."""
    assert packed_rows([6, 3, 3], 10) == [[0, 1], [2]]
    assert packed_rows([2, 7, 3, 1], 10) == [[1, 2], [0, 3]]
    assert packed_rows([5, 5], 10) == [[0, 1]]
    assert packed_rows([10], 10) == [[0]]
    assert packed_rows([], 10) == []


def test_sample_lengths_is_seeded_clipped_and_long_tailed() -> None:
    """Same seed, same sample; every length within [16, context]; the tail fraction lands in [0.6, 1] x context."""
    from hspmd_sdk.planner.mixed import sample_lengths

    a = sample_lengths(2000, 4096, seed=3)
    assert a == sample_lengths(2000, 4096, seed=3) and a != sample_lengths(2000, 4096, seed=4)
    assert len(a) == 2000 and all(isinstance(x, int) for x in a)
    assert min(a) >= 16 and max(a) == 4096
    tiny = sample_lengths(500, 4096, seed=0, median=1, sigma=0.1, tail=0.0)
    assert set(tiny) == {16}  # exp(N(0, 0.1)) is about 1: clipped to 16
    top = sample_lengths(500, 1000, seed=0, median=1, sigma=0.1, tail=1.0)
    assert min(top) >= 600 and max(top) <= 1000  # every sequence from the tail
    mid = sample_lengths(4000, 1 << 20, seed=0, median=1000, sigma=0.5, tail=0.0)
    import statistics
    assert 900 < statistics.median(mid) < 1100 and max(mid) < 10000
    spread = sample_lengths(4000, 1 << 20, seed=0, median=1000, sigma=1.5, tail=0.0)
    assert max(spread) > 20000
    tail = sample_lengths(4000, 1 << 20, seed=0, median=100, sigma=0.1, tail=0.25)
    assert 0.2 < sum(x > 1000 for x in tail) / 4000 < 0.3


class _Fake:
    """A pipeline cost whose parts are simple: padded (rows, longest): bottleneck rows * longest, fill longest / 10;
    packed (1, tokens, squares): bottleneck tokens, fill tokens / 10; the calls are recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def parts(self, *a):
        self.calls.append(a)
        if len(a) == 3:
            return float(a[1]), a[1] / 10
        return float(a[0] * a[1]), a[1] / 10


def test_assign_padded_by_hand() -> None:
    """One pipeline, window 8: 4 and 4 share a micro-batch (a tie between joining and opening is joined), 3 opens
    another (3 rows x 4 > 8); the time is the sum of bottlenecks plus the largest fill."""
    from hspmd_sdk.planner.mixed import _assign

    mbs, t = _assign([_Fake()], [8], [0, 1, 2], [4, 4, 3])
    assert mbs == [[[0, 1], [2]]] and t == [pytest.approx(4 + 4 + 3 + 0.4)]


def test_assign_two_pipelines_by_hand() -> None:
    """Windows 8 and 4: the 6 only fits pipeline 0; each sequence then goes where the finish time grows least; an
    idle pipeline's time is 0."""
    from hspmd_sdk.planner.mixed import _assign

    mbs, t = _assign([_Fake(), _Fake()], [8, 4], [0, 1, 2, 3], [6, 4, 4, 2])
    assert mbs == [[[0], [3]], [[1], [2]]] and t == [pytest.approx(8.6), pytest.approx(8.4)]
    mbs, t = _assign([_Fake(), _Fake()], [8, 4], [0], [6, 4, 4, 2])
    assert mbs == [[[0]], []] and t == [pytest.approx(6.6), 0.0]
    mbs, t = _assign([_Fake(), _Fake()], [4, 4], [0], [3])
    assert mbs == [[[0]], []]  # a tie: the lower pipeline


def test_assign_packed_by_hand() -> None:
    """Packed, window 10: joining 3 to the 6 (9 tokens, squares 45, fill 0.9) grows the time more than a row of its
    own; the next 3 joins that row (6 tokens, squares 18: a tie, joined)."""
    from hspmd_sdk.planner.mixed import _assign

    f = _Fake()
    mbs, t = _assign([f], [10], [0, 1, 2], [6, 3, 3], packed=True)
    assert mbs == [[[0], [1, 2]]] and t == [pytest.approx(6 + 6 + 0.6)]
    assert (1, 9, 45) in f.calls and (1, 6, 36) in f.calls and (1, 6, 18) in f.calls


def test_fewest_rows_best_fit_by_hand() -> None:
    """Window 10: 6 and 5 open rows; 4 goes to the fuller row that holds it (6), 3 to the other; the time is the
    sum of the rows' bottlenecks plus the largest fill."""
    from hspmd_sdk.planner.mixed import _fewest_rows

    f = _Fake()
    mbs, t = _fewest_rows([f], [10], [0, 1, 2, 3], [6, 5, 4, 3])
    assert mbs == [[[0, 2], [1, 3]]] and t == [pytest.approx(10 + 8 + 1.0)]
    assert (1, 10, 52) in f.calls and (1, 8, 34) in f.calls
    mbs, _ = _fewest_rows([_Fake()], [9], [0, 1, 2], [5, 5, 2])
    assert mbs == [[[0, 2], [1]]]  # equally full rows: the first


def test_fewest_rows_two_pipelines_by_hand() -> None:
    """Window 6 and 10: the 8 only fits pipeline 1; the 5 grows pipeline 0 least; an idle pipeline's time is 0."""
    from hspmd_sdk.planner.mixed import _fewest_rows

    mbs, t = _fewest_rows([_Fake(), _Fake()], [6, 10], [0, 1], [8, 5])
    assert mbs == [[[1]], [[0]]] and t == [pytest.approx(5.5), pytest.approx(8.8)]
    mbs, t = _fewest_rows([_Fake(), _Fake()], [6, 10], [0], [8, 5])
    assert mbs == [[], [[0]]] and t == [0.0, pytest.approx(8.8)]
    mbs, _ = _fewest_rows([_Fake(), _Fake()], [6, 6], [0], [5])
    assert mbs == [[[0]], []]  # a tie: the lower pipeline


def test_boundaries_are_integers() -> None:
    """Windows are token counts: ints, not floats (1.5 x 1024 = 1536 exactly)."""
    assert all(type(x) is int for x in _boundaries(65536))


def test_sample_lengths_defaults() -> None:
    """The defaults: seed 0, median 1024, sigma 1.1, tail 1 %."""
    from hspmd_sdk.planner.mixed import sample_lengths

    assert sample_lengths(300, 8192) == sample_lengths(300, 8192, seed=0, median=1024, sigma=1.1, tail=0.01)


def test_sample_lengths_tail_is_spread_over_its_range() -> None:
    """Tail lengths are drawn uniformly in [0.6, 1] x context, one draw each (not one value for all; rarely the
    context itself)."""
    from hspmd_sdk.planner.mixed import sample_lengths

    top = sample_lengths(400, 100000, seed=1, median=1, sigma=0.1, tail=1.0)
    assert len(set(top)) > 300 and top.count(100000) == 0
    assert 0.75 < sum(top) / len(top) / 100000 < 0.85


def test_cost_shapes_padded_and_packed() -> None:
    """Padded: (rows, longest); packed: (1, tokens, sum of squared lengths)."""
    from hspmd_sdk.planner.mixed import _cost_shapes

    lengths = [4, 2, 3, 5]
    mbs = [[[0, 1], [2]], [[3]]]
    assert _cost_shapes(mbs, lengths, False) == [[(2, 4), (1, 3)], [(1, 5)]]
    assert _cost_shapes(mbs, lengths, True) == [[(1, 6, 20), (1, 3, 9)], [(1, 5, 25)]]
    assert _cost_shapes([[], [[1]]], lengths, False) == [[], [(1, 2)]]


def _strategy(name: str = "", ranks: int = 1):
    from hspmd_sdk.core.strategy import Strategy

    return Strategy.load({"name": name, "pipelines": [{"micro_batch_size": 1, "num_micro_batches": 1, "stages": [
        {"devices": list(range(ranks)), "layers": [0, 1]}]}]})


def test_dispatch_shapes_padding_and_estimate() -> None:
    """Per pipeline (rows, padded length); padding = 1 - tokens / padded tokens (0 packed or empty); the estimate
    is the chosen candidate's."""
    from hspmd_sdk.planner.mixed import Dispatch

    kw = dict(choice=1, estimates=(1.0, 2.0), switch=(0.0, 0.0), micro_batches=(((0, 1), (2,)), ((3,),)),
              lengths=(4, 2, 3, 5), strategy=_strategy(), windows=(8, 8), max_seq_len=8, pipeline_estimates=(1.0, 1.0))
    d = Dispatch(**kw)
    assert d.estimate == 2.0
    assert d.shapes() == [[(2, 4), (1, 3)], [(1, 5)]] and d.cost_shapes() == [[(2, 4), (1, 3)], [(1, 5)]]
    assert d.padding_fraction() == pytest.approx(1 - 14 / 16)
    p = Dispatch(**{**kw, "packed": True})
    assert p.cost_shapes() == [[(1, 6, 20), (1, 3, 9)], [(1, 5, 25)]] and p.shapes() == [[(1, 6), (1, 3)], [(1, 5)]]
    assert p.padding_fraction() == 0.0
    assert Dispatch(**{**kw, "micro_batches": ((), ()), "lengths": ()}).padding_fraction() == 0.0


def test_overhead_is_the_first_forward_start_plus_the_sync() -> None:
    """The earliest forward's start (0 when there is none) plus the simulated synchronisation time."""
    from types import SimpleNamespace as NS

    from hspmd_sdk.planner.mixed import _overhead

    ev = lambda kind, start: NS(kind=kind, start=start)  # noqa: E731
    r = NS(timeline={0: [ev("B", 0.5), ev("F", 2.0)], 1: [ev("F", 1.0), ev("F", 3.0)]}, sync_time=3.0)
    assert _overhead(r) == 4.0
    assert _overhead(NS(timeline={0: [ev("B", 0.5)]}, sync_time=3.0)) == 3.0


def test_variants_by_hand() -> None:
    """All methods; without CP where some use it; sharing cores: each set held to pipelines of >= 2, 4, ... stages
    (empty sets dropped)."""
    from hspmd_sdk.planner.mixed import _variants

    a, b, c = Method("H20", 1, 1), Method("H20", 1, 2, cp=2), Method("H20", 2, 4)
    assert _variants([a, b, c], False) == [[a, b, c], [a, c]]
    assert _variants([a, b, c], True) == [[a, b, c], [a, c], [b, c], [c], [c], [c]]
    assert _variants([a, c], False) == [[a, c]]
    assert _variants([b], False) == [[b]]
    assert _variants([a, b], True) == [[a, b], [a], [b]]
    assert _variants([a], True) == [[a]]


def test_distinct_drops_an_entry_a_later_one_serves_alike() -> None:
    """An entry whose strategy (name aside) and windows equal a later one's with a max_seq_len at least as long is
    dropped; different windows, a different strategy or a shorter later entry keep it."""
    from hspmd_sdk.planner.mixed import MixedEntry, _distinct

    def e(n: int, w: int, name: str = "a", ranks: int = 1) -> MixedEntry:
        return MixedEntry(max_seq_len=n, windows=[w], strategy=_strategy(name, ranks))

    a, b = e(100, 100, "x"), e(200, 100, "y")
    assert _distinct([a, b]) == [b]
    assert _distinct([a, e(100, 100, "z")]) == [e(100, 100, "z")]  # as long: dropped too
    assert _distinct([b, a]) == [b, a]  # the later one is shorter
    assert _distinct([a, e(200, 120)]) == [a, e(200, 120)]
    assert _distinct([a, e(200, 100, ranks=2)]) == [a, e(200, 100, ranks=2)]
    assert _distinct([a, e(150, 90), b]) == [e(150, 90), b]


def test_segments_count_and_forms_by_hand() -> None:
    """Lengths kept longest first; count of (lo, hi]; forms: one row a sequence, padded micro-batches of the
    window hi, and (packing) packed rows with tokens and squares; cached per interval."""
    import numpy as np

    from hspmd_sdk.planner.mixed import _Segments

    s = _Segments([5, 1, 3, 3, 8])
    assert s.lengths.tolist() == [8, 5, 3, 3, 1] and not s.packing
    assert (s.count(1, 3), s.count(3, 8), s.count(0, 8), s.count(3, 4)) == (2, 2, 5, 0)
    forms = s.forms(2, 6)
    assert len(forms) == 2 and s.forms(2, 6) is forms
    (r0, x0, q0), (r1, x1, q1) = forms
    assert r0.tolist() == [1, 1, 1] and x0.tolist() == [5, 3, 3] and q0 is None
    assert r1.tolist() == [1, 2] and x1.tolist() == [5, 3] and q1 is None
    assert all(a.dtype == np.float64 for a in (r0, x0, r1, x1))
    p = _Segments([5, 1, 3, 3, 8], packing=True)
    assert p.packing
    f = p.forms(2, 6)
    assert len(f) == 3 and f[2][0].tolist() == [1, 1] and f[2][1].tolist() == [5, 6] and f[2][2].tolist() == [25, 18]
    assert all(a.dtype == np.float64 for a in f[2])
    assert len(p.forms(8, 10)) == 2  # no sequence in (8, 10]: no packed form
    assert p.forms(1, 3)[1][0].tolist() == [1, 1]  # (1, 3]: the two 3s, a micro-batch each (2 x 3 > 3)


def test_fewest_rows_fullest_row_by_tokens_and_new_rows_priced_from_nothing() -> None:
    """Best fit is by tokens, not squares: with rows [6] (36) and [4, 4] (8 tokens, 32) in a window of 9, the 1
    joins [4, 4]; a new row is priced from an empty row (parts of (1, x, x * x), nothing taken off)."""
    from hspmd_sdk.planner.mixed import _fewest_rows

    f = _Fake()
    mbs, _ = _fewest_rows([f], [9], [0, 1, 2, 3], [6, 4, 4, 1])
    assert mbs == [[[0], [1, 2, 3]]] and f.calls[0] == (1, 6, 36)
    # windows 3 and 4: 3 -> p0, 2 -> p1, 1 joins p1's row (3.3 against a new row on p0 at 4.3), the last 1 opens a
    # row on p0 (4.3) rather than fill p1's (4.4)
    mbs, t = _fewest_rows([_Fake(), _Fake()], [3, 4], [1, 2, 0, 3], [1, 3, 2, 1])
    assert mbs == [[[1], [3]], [[2, 0]]] and t == [pytest.approx(4.3), pytest.approx(3.3)]
