"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of planner/calibrate.py.

Every expected value is worked out by hand: events laid out by hand, least-squares problems small enough to solve
on paper, figures in and the fields of the cost model out.  The round trip through the simulator prices the
steps with a hand-built cost model and checks that the fit gets those figures back.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from hspmd_sdk import LlamaConfig
from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.core.strategy import Strategy
from hspmd_sdk.planner.calibrate import (FITTED_PHASES, Calibrated, _calibrated_model, _clean, _fit, _link_classes,
                                         _nnls, _phase_totals, _unit_models, as_recorded, calibrate,
                                         describe_figures)
from hspmd_sdk.planner.cost import ComputeFit, CostModel, LinkOverride, OperatorProfile
from hspmd_sdk.planner.simulator import Event

close = pytest.approx


# ---- describe ---------------------------------------------------------------------------------------------------
def test_describe_figures_shows_each_unit_scaled_and_an_unknown_one_as_is() -> None:
    """Each unit's scale and shown name (ms, ns, ps), in the figures' order; an unknown unit unscaled."""
    figs = {"cpu forward s/operator": 0.000998, "intra collective s/call": 0.000998, "intra send s/send": 0.000998,
            "cpu Adam s/param": 0.998e-9, "cpu forward s/FLOP": 0.998e-12, "intra s/byte": 0.998e-9, "odd thing": 7.0}
    # 0.998 of each unit: a scale 0.1% off would show 0.999
    assert describe_figures(figs) == ("cpu forward 0.998 ms/operator, intra collective 0.998 ms/call, "
                                      "intra send 0.998 ms/send, cpu Adam 0.998 ns/param, cpu forward 0.998 ps/FLOP, "
                                      "intra 0.998 ns/byte, odd 7 thing")
    assert Calibrated(CostModel(), figs, {}).describe() == describe_figures(figs)
    assert describe_figures({}) == ""


# ---- as_recorded and the phase totals ---------------------------------------------------------------------------
def _ev(start: float, end: float, kind: str, mb: int | None = None) -> Event:
    return Event(start, end, kind, mb)  # type: ignore[arg-type]


def test_as_recorded_counts_each_idle_as_the_phase_after_it() -> None:
    """Idle before a forward, a backward or a send is ``comm``, before a sync ``sync``, before the optimizer
    ``optim``; idle followed only by idle is dropped, as is an empty idle; the input is sorted by start."""
    events = [_ev(9.0, 10.0, "optim"), _ev(0.0, 1.0, "idle"), _ev(1.0, 2.0, "F", 0), _ev(2.0, 2.0, "idle"),
              _ev(2.0, 3.0, "idle"), _ev(3.0, 4.0, "B", 1), _ev(4.0, 5.0, "idle"), _ev(5.0, 6.0, "comm"),
              _ev(6.0, 7.0, "idle"), _ev(7.0, 8.0, "sync"), _ev(8.0, 9.0, "idle"), _ev(10.0, 11.0, "idle"),
              _ev(11.0, 12.0, "idle")]
    assert as_recorded(events) == [
        ("comm", 0.0, 1.0, "comm (waits for data)"), ("F", 1.0, 2.0, "F mb0"),
        ("comm", 2.0, 3.0, "comm (waits for data)"), ("B", 3.0, 4.0, "B mb1"),
        ("comm", 4.0, 5.0, "comm (waits for data)"), ("comm", 5.0, 6.0, "comm"),
        ("sync", 6.0, 7.0, "sync (waits for peers)"), ("sync", 7.0, 8.0, "sync"),
        ("optim", 8.0, 9.0, "optim (waits for peers)"), ("optim", 9.0, 10.0, "optim")]


def test_as_recorded_skips_idles_to_the_next_real_event() -> None:
    """Two idles in a row before a sync are both ``sync`` waits (the next event that is not idle decides)."""
    events = [_ev(0.0, 1.0, "idle"), _ev(1.0, 2.0, "idle"), _ev(2.0, 3.0, "sync")]
    assert [r[0] for r in as_recorded(events)] == ["sync", "sync", "sync"]


def test_phase_totals_sums_work_or_waits_per_device() -> None:
    """Per device, seconds of each fitted phase: the work (``waits=False``) or the waits (``waits=True``)."""
    result = SimpleNamespace(timeline={
        0: [_ev(0.0, 1.0, "F", 0), _ev(1.0, 3.0, "idle"), _ev(3.0, 3.5, "sync"), _ev(3.5, 4.5, "F", 1)],
        1: [_ev(0.0, 0.25, "idle"), _ev(0.25, 1.0, "B", 0), _ev(1.0, 1.5, "optim")]})
    assert _phase_totals(result) == {0: {"F": 2.0, "B": 0.0, "comm": 0.0, "sync": 0.5, "optim": 0.0},
                                     1: {"F": 0.0, "B": 0.75, "comm": 0.0, "sync": 0.0, "optim": 0.5}}
    assert _phase_totals(result, waits=True) == {0: {"F": 0.0, "B": 0.0, "comm": 0.0, "sync": 2.0, "optim": 0.0},
                                                 1: {"F": 0.0, "B": 0.0, "comm": 0.25, "sync": 0.0, "optim": 0.0}}


def test_clean_drops_rounding_below_1e9() -> None:
    """Entries of magnitude up to 1e-9 are rounding (0); larger ones, of either sign, stay."""
    assert _clean(1e-9) == 0.0 and _clean(-1e-9) == 0.0 and _clean(5e-10) == 0.0
    assert _clean(2e-9) == 2e-9 and _clean(-2e-9) == -2e-9 and _clean(3.0) == 3.0


# ---- the link classes -------------------------------------------------------------------------------------------
def _two_nodes() -> Cluster:
    return Cluster.load({"nodes": [{"host": "a", "kind": "cpu", "ranks": [0, 1]},
                                   {"host": "b", "kind": "cpu", "ranks": [2, 3]}]})


def _strategy(devices: list[list[int]]) -> Strategy:
    per = 4 // len(devices)
    stages = [{"devices": d, "layers": [i * per, (i + 1) * per - 1]} for i, d in enumerate(devices)]
    return Strategy.load({"pipelines": [{"stages": stages, "micro_batch_size": 1, "num_micro_batches": 2}]})


def test_link_classes_are_those_between_the_strategys_devices() -> None:
    """intra within a node (two of its ranks used), inter across nodes, sorted; one device: no class."""
    c = _two_nodes()
    assert _link_classes(_strategy([[0, 1], [2, 3]]), c) == ["inter", "intra"]
    assert _link_classes(_strategy([[0], [2]]), c) == ["inter"]
    assert _link_classes(_strategy([[0, 1]]), c) == ["intra"]
    assert _link_classes(_strategy([[3]]), c) == []


# ---- the fit ----------------------------------------------------------------------------------------------------
def test_fit_without_a_priceable_row_names_what_was_measured() -> None:
    """No measured phase that a column prices: ValueError quoting the measured seconds."""
    cols = [{0: {"F": 0.0}}]
    with pytest.raises(ValueError) as e:
        _fit(["x"], cols, {0: {"F": 1.0}})
    assert str(e.value) == ("calibrate: no measured phase the simulator prices (measured: {0: {'F': 1.0}})")
    with pytest.raises(ValueError, match="no measured phase"):
        _fit(["x"], [{0: {"F": 2.0}}], {0: {"F": 0.0}})  # a phase measured 0 is not a row


def test_fit_solves_exactly_and_reports_only_used_figures() -> None:
    """Two devices, two phases: F = 2 x + 0 y, B = 1 x + 3 y per device; measured with x = 0.5, y = 0.25.  A column
    no row exercises (z) is not a fitted figure; each row's fitted seconds are in seconds, not scaled."""
    cols = [{0: {"F": 2.0, "B": 1.0}, 1: {"F": 4.0, "B": 2.0}},   # x
            {0: {"F": 0.0, "B": 3.0}, 1: {"F": 0.0, "B": 6.0}},   # y
            {0: {}, 1: {}}]                                       # z: never priced
    measured = {0: {"F": 1.0, "B": 1.25}, 1: {"F": 2.0, "B": 2.5}}
    figs, rows = _fit(["x", "y", "z"], cols, measured)
    assert figs == close({"x": 0.5, "y": 0.25}) and list(figs) == ["x", "y"]
    assert rows == close({(0, "F"): 1.0, (1, "F"): 2.0, (0, "B"): 1.25, (1, "B"): 2.5})
    assert list(rows) == [(0, "F"), (1, "F"), (0, "B"), (1, "B")]  # phase by phase, devices sorted


def test_fit_weighs_each_phase_by_its_mean() -> None:
    """One figure, two phases that disagree: F says x = 1 (1 s measured, 1 per x), optim says x = 2 (0.01 s
    measured, 0.005 per x).  Each row divided by its phase's mean weighs them alike (least squares over the
    rows, [1] and [0.5] against [1] and [1]): x = 1.5 / 1.25 = 1.2; unscaled rows would give ~1."""
    cols = [{0: {"F": 1.0, "optim": 0.005}}]
    figs, rows = _fit(["x"], cols, {0: {"F": 1.0, "optim": 0.01}})
    assert figs["x"] == close(1.2)
    assert rows == close({(0, "F"): 1.2, (0, "optim"): 0.006})


def test_fit_leaves_out_a_device_whose_columns_are_zero_in_a_phase() -> None:
    """A device with measured seconds that no column prices in that phase is not a row (and does not move the
    phase's mean): x from device 0 alone."""
    cols = [{0: {"F": 2.0}, 1: {"F": 0.0}}]
    figs, rows = _fit(["x"], cols, {0: {"F": 1.0}, 1: {"F": 100.0}})
    assert figs == close({"x": 0.5}) and list(rows) == [(0, "F")]


def test_fit_reads_missing_devices_and_phases_as_zero() -> None:
    """A column without the device (or the phase) counts 0; a measured device without a phase counts 0."""
    cols = [{0: {"F": 2.0}}, {1: {"B": 4.0}}]
    figs, rows = _fit(["x", "y"], cols, {0: {"F": 1.0}, 1: {"B": 2.0}})
    assert figs == close({"x": 0.5, "y": 0.5})


def test_fit_weighs_phases_by_mean_not_by_total() -> None:
    """The phase scale is the mean over its devices, not the sum times the count: F on two devices (x = 1 each),
    optim on one (x = 2, 0.5 per x after scaling): 2 (x - 1)^2 + (0.5 x - 1)^2 is least at x = 2.5 / 2.25."""
    cols = [{0: {"F": 1.0, "optim": 0.005}, 1: {"F": 1.0}}]
    figs, _ = _fit(["x"], cols, {0: {"F": 1.0, "optim": 0.01}, 1: {"F": 1.0}})
    assert figs["x"] == close(2.5 / 2.25)


def _brute_nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The reference: every subset of columns solved by least squares, the feasible (non-negative) solution with
    the smallest residual."""
    import itertools
    n = A.shape[1]
    best, best_r = np.zeros(n), float(np.linalg.norm(b))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            x = np.zeros(n)
            x[list(cols)] = np.linalg.lstsq(A[:, list(cols)], b, rcond=None)[0]
            if (x >= -1e-12).all():
                r = float(np.linalg.norm(A @ x - b))
                if r < best_r - 1e-12:
                    best, best_r = np.clip(x, 0.0, None), r
    return best


def test_nnls_matches_an_exhaustive_search_on_seeded_problems() -> None:
    """Seeded random problems (4 to 8 rows, 2 to 5 columns, mixed signs; columns of very different norms on some)
    solved alike by the active set and by trying every subset of columns; many need the step back out of the
    passive set."""
    rng = np.random.default_rng(7)
    for i in range(120):
        m = int(rng.integers(4, 9))
        n = int(rng.integers(2, min(6, m)))  # fewer columns than rows: a unique solution
        A = rng.normal(size=(m, n))
        if i % 3 == 0:
            A *= 10.0 ** rng.integers(-6, 4, size=n)
        b = rng.normal(size=m)
        got, want = _nnls(A, b), _brute_nnls(A, b)
        assert (got >= 0).all(), i
        assert np.linalg.norm(A @ got - b) == close(np.linalg.norm(A @ want - b), rel=1e-7, abs=1e-9), i
        assert list(got) == close(list(want), rel=1e-6, abs=1e-6 * max(1.0, float(np.abs(want).max()))), i


def test_nnls_steps_back_out_of_the_passive_set_as_an_exhaustive_search_says() -> None:
    """Small integer problems (4 x 3, entries 0-3, right-hand sides -1-4), where the column entered first must often
    leave again when the next one enters (about one problem in sixty): the same solution as trying every subset."""
    rng = np.random.default_rng(5)
    for i in range(900):
        A = rng.integers(0, 4, size=(4, 3)).astype(float)
        b = rng.integers(-1, 5, size=4).astype(float)
        if np.linalg.matrix_rank(A) < 3:
            continue
        got, want = _nnls(A, b), _brute_nnls(A, b)
        assert list(got) == close(list(want), rel=1e-7, abs=1e-9), (i, A.tolist(), b.tolist())


def test_nnls_clamps_a_negative_least_squares_component_to_zero() -> None:
    """A = [[1, 0], [0, 1], [1, 1]], b = [2, -1, 1]: unconstrained x = (2, -1); with x >= 0, y = 0 and x
    minimises (x-2)^2 + (x-1)^2: x = 1.5."""
    x = _nnls(np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), np.array([2.0, -1.0, 1.0]))
    assert list(x) == close([1.5, 0.0])


def test_nnls_exact_solution_with_scaled_columns() -> None:
    """Columns of very different norms (1e-6 and 1e3): the exact non-negative solution (3, 2)."""
    A = np.array([[1e-6, 0.0], [0.0, 1e3], [1e-6, 1e3]])
    x = _nnls(A, A @ np.array([3.0, 2.0]))
    assert list(x) == close([3.0, 2.0], rel=1e-6)


def test_nnls_zero_column_and_all_negative() -> None:
    """A zero column gets 0; a right-hand side no non-negative x approaches gives all zeros."""
    assert list(_nnls(np.array([[1.0, 0.0], [2.0, 0.0]]), np.array([1.0, 2.0]))) == close([1.0, 0.0])
    assert list(_nnls(np.array([[1.0], [1.0]]), np.array([-1.0, -2.0]))) == [0.0]


def test_nnls_leaves_the_passive_set_when_a_component_turns_negative() -> None:
    """A problem where the first column entered (the most correlated) must leave again: A = [[1, 1], [0, 1]],
    b = [1, 1]... solved on paper: x = (0, 1) fits exactly; also b = [2, 1]: x = (1, 1)."""
    A = np.array([[1.0, 1.0], [0.0, 1.0]])
    assert list(_nnls(A, np.array([1.0, 1.0]))) == close([0.0, 1.0], abs=1e-12)
    assert list(_nnls(A, np.array([2.0, 1.0]))) == close([1.0, 1.0])
    # three columns, the greedy first choice (column 2, most correlated with b) leaves: b = A (1, 1, 0)
    A3 = np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0], [1.0, 1.0, 1.9], [1.0, -1.0, 0.0]])
    want = np.array([1.0, 1.0, 0.0])
    assert list(_nnls(A3, A3 @ want)) == close(list(want), abs=1e-9)


# ---- the calibrated model ---------------------------------------------------------------------------------------
def test_calibrated_model_puts_each_figure_in_its_field() -> None:
    """Per kind an OperatorProfile (forward and backward lines, the embedding's backward per operator, Adam), per
    link class a LinkOverride (call latency, bytes at 1 / s-per-byte on both, sends); a kind with no figure keeps
    the base's profile; processor sharing off, no comm scale."""
    base = CostModel(cores=4, comm_scale=2.0)
    figs = {"cpu forward s/FLOP": 1e-12, "cpu forward s/operator": 2e-3, "cpu backward s/FLOP": 3e-12,
            "cpu backward s/operator": 4e-3, "cpu Adam s/param": 5e-9,
            "intra collective s/call": 6e-3, "intra s/byte": 2e-9, "intra send s/send": 7e-4}
    model = LlamaConfig.preset("tiny")
    cm = _calibrated_model(base, ["cpu", "gpu"], figs, model)
    p = cm.profiles["cpu"]
    assert (p.layer_fwd.a, p.layer_fwd.b, p.head_fwd.a, p.head_fwd.b) == (1e-12, 2e-3, 1e-12, 2e-3)
    assert (p.layer_bwd.a, p.layer_bwd.b, p.head_bwd.a, p.head_bwd.b) == (3e-12, 4e-3, 3e-12, 4e-3)
    assert (p.embed.a, p.embed.b, p.optimizer_s_per_param) == (0.0, 4e-3, 5e-9)
    assert (p.layer_fwd.device, p.layer_fwd.dtype, p.layer_bwd.device, p.layer_bwd.dtype) == (
        "cpu", "calibrated", "cpu", "calibrated")
    assert p.model == model.name
    assert "gpu" not in cm.profiles
    link = cm.link_overrides["intra"]
    assert (link.latency, link.collective_latency, link.call_latency, link.send_overhead, link.backend) == (
        0.0, 0.0, 6e-3, 7e-4, "calibrated")
    assert link.bandwidth == close(5e8) and link.collective_bandwidth == close(5e8)
    assert set(cm.link_overrides) == {"intra"}
    assert cm.cores is None and cm.comm_scale == 1.0


def test_calibrated_model_defaults_of_missing_figures() -> None:
    """Missing line figures are 0, Adam at 0 is kept at 1e-18 (not the memory-bound fallback), a link with no
    per-byte figure gets free bytes (1e30) and no call or send cost; a model without a name: ``""``."""
    cm = _calibrated_model(CostModel(), ["cpu"], {"cpu forward s/operator": 1e-3, "inter collective s/call": 1e-3},
                           SimpleNamespace())
    p = cm.profiles["cpu"]
    assert (p.layer_fwd.a, p.layer_bwd.a, p.layer_bwd.b, p.optimizer_s_per_param, p.model) == (
        0.0, 0.0, 0.0, 1e-18, "")
    link = cm.link_overrides["inter"]
    assert (link.bandwidth, link.collective_bandwidth, link.send_overhead) == (1e30, 1e30, 0.0)
    zero_byte = _calibrated_model(CostModel(), [], {"inter s/byte": 0.0}, SimpleNamespace(name=None))
    assert zero_byte.link_overrides["inter"].bandwidth == 1e30
    bytes_only = _calibrated_model(CostModel(), ["cpu"], {"cpu forward s/FLOP": 1e-12, "inter s/byte": 1e-9},
                                   SimpleNamespace(name="m"))
    assert bytes_only.link_overrides["inter"].call_latency == 0.0  # no call figure: no call cost
    assert bytes_only.link_overrides["inter"].bandwidth == close(1e9)
    fwd = bytes_only.profiles["cpu"].layer_fwd
    assert (fwd.a, fwd.b) == (1e-12, 0.0)  # no per-operator figure: 0


def test_unit_models_have_one_figure_at_one() -> None:
    """The names in order (per kind: forward, backward per FLOP and per operator, Adam; per class: calls, bytes,
    sends), and in each the one figure at 1, everything else free."""
    base = CostModel(cores=4, comm_scale=3.0)
    units = _unit_models(base, ["cpu"], ["intra"])
    assert list(units) == ["", "cpu forward s/FLOP", "cpu forward s/operator", "cpu backward s/FLOP",
                           "cpu backward s/operator", "cpu Adam s/param", "intra collective s/call", "intra s/byte",
                           "intra send s/send"]
    zero = units[""]
    assert zero.cores is None and zero.comm_scale == 1.0 and zero.hbm_gbs["cpu"] == 1e30
    zp = zero.profiles["cpu"]
    assert all((f.a, f.b) == (0.0, 0.0) for f in (zp.layer_fwd, zp.layer_bwd, zp.head_fwd, zp.head_bwd, zp.embed))
    zl = zero.link_overrides["intra"]
    assert (zl.latency, zl.bandwidth, zl.collective_latency, zl.collective_bandwidth) == (0.0, 1e30, 0.0, 1e30)
    f = units["cpu forward s/FLOP"].profiles["cpu"]
    assert (f.layer_fwd.a, f.layer_fwd.b, f.head_fwd.a, f.head_fwd.b, f.layer_bwd.a) == (1.0, 0.0, 1.0, 0.0, 0.0)
    o = units["cpu forward s/operator"].profiles["cpu"]
    assert (o.layer_fwd.a, o.layer_fwd.b, o.head_fwd.b, o.embed.b) == (0.0, 1.0, 1.0, 0.0)
    bf = units["cpu backward s/FLOP"].profiles["cpu"]
    assert (bf.layer_bwd.a, bf.head_bwd.a, bf.layer_bwd.b, bf.layer_fwd.a) == (1.0, 1.0, 0.0, 0.0)
    bo = units["cpu backward s/operator"].profiles["cpu"]
    assert (bo.layer_bwd.b, bo.head_bwd.b, bo.embed.b, bo.layer_bwd.a) == (1.0, 1.0, 1.0, 0.0)
    assert units["cpu Adam s/param"].profiles["cpu"].optimizer_s_per_param == 1.0
    call = units["intra collective s/call"].link_overrides["intra"]
    assert (call.call_latency, call.bandwidth, call.send_overhead) == (1.0, 1e30, 0.0)
    byte = units["intra s/byte"].link_overrides["intra"]
    assert (byte.latency, byte.bandwidth, byte.collective_latency, byte.collective_bandwidth) == (0.0, 1.0, 0.0, 1.0)
    send = units["intra send s/send"].link_overrides["intra"]
    assert (send.send_overhead, send.call_latency, send.bandwidth) == (1.0, 0.0, 1e30)
    assert all(u.profiles["cpu"] == zp for n, u in units.items() if n.startswith("intra"))


# ---- the round trip: hand-built figures priced by the simulator, fitted back --------------------------------------
_OP = ComputeFit(a=0.0, b=1e-3)
_PROF = OperatorProfile(layer_fwd=_OP, layer_bwd=_OP, head_fwd=_OP, head_bwd=_OP, embed=_OP,
                        optimizer_s_per_param=1e-9)


def _truth(**link: float) -> CostModel:
    """1 ms per operator each way, 1 ns per parameter of Adam, free bytes, the given call and send costs."""
    return CostModel(profiles={"cpu": _PROF}, cores=None, link_overrides={"intra": LinkOverride(
        latency=0.0, bandwidth=1e30, collective_latency=0.0, collective_bandwidth=1e30, **link)})


def test_calibrate_recovers_the_call_latency_of_two_replicas() -> None:
    """Two one-stage replicas (DP2) priced with 2 ms per collective call: the gradient all-reduce is the only
    comm; the fit gets the call latency, the forward's 1 ms per operator and Adam back, and every row matches."""
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(2)
    pipe = {"micro_batch_size": 2, "num_micro_batches": 2}
    strat = {"pipelines": [{"stages": [{"devices": [d], "layers": [0, 3]}], **pipe} for d in (0, 1)]}
    from hspmd_sdk.planner.simulator import simulate
    measured = dict(_with_waits(simulate(model, strat, cluster, seq_len=16, cost=_truth(call_latency=2e-3))))
    fit = calibrate(model, strat, cluster, measured, seq_len=16)
    assert fit.figures["intra collective s/call"] == close(2e-3, rel=1e-6)
    assert fit.figures["cpu forward s/operator"] == close(1e-3, rel=1e-6)
    assert fit.figures["cpu forward s/FLOP"] == close(0.0, abs=1e-15)
    assert fit.figures["cpu Adam s/param"] == close(1e-9, rel=1e-6)
    assert "intra send s/send" not in fit.figures  # no send: its column is never exercised
    assert fit.cost.link_overrides["intra"].call_latency == close(2e-3, rel=1e-6)
    assert fit.cost.profiles["cpu"].model == model.name
    for (d, phase), (got, fitted) in fit.rows.items():
        assert fitted == close(got, rel=1e-6), (d, phase)
    assert set(fit.rows) == {(d, p) for d in (0, 1) for p in FITTED_PHASES if measured[d][p] > 0}


def test_calibrate_fits_sends_and_calls_to_the_measured_seconds_less_the_waits() -> None:
    """HSPMD's heterogeneous pipelines (a two-stage pipeline beside a one-stage one) priced with 2 ms per call and
    0.5 ms per send: the recorded comm and sync hold long waits for peers (ranks 0 and 1 wait several ms for
    rank 2).  The fixed point takes the planned waits off and gets the figures back within a few percent (the
    waits themselves move with the figures); without it the waits would be fitted as sends and calls, several
    times too slow.  The compute figures are exact."""
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(3)
    pipe = {"micro_batch_size": 2, "num_micro_batches": 2}
    strat = {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 1]}, {"devices": [1], "layers": [2, 3]}],
                            **pipe}, {"stages": [{"devices": [2], "layers": [0, 3]}], **pipe}]}
    from hspmd_sdk.planner.simulator import simulate
    truth = _truth(call_latency=2e-3, send_overhead=5e-4)
    measured = dict(_with_waits(simulate(model, strat, cluster, seq_len=16, cost=truth)))
    assert measured[0]["comm"] > 8 * 2 * 5e-4  # mostly waits: two sends of 0.5 ms and many ms of waiting
    fit = calibrate(model, strat, cluster, measured, seq_len=16)
    assert fit.figures["intra collective s/call"] == close(2e-3, rel=0.05)
    assert fit.figures["intra send s/send"] == close(5e-4, rel=0.15)
    for n in ("cpu forward s/operator", "cpu backward s/operator"):
        assert fit.figures[n] == close(1e-3, rel=1e-6)
    assert fit.figures["cpu Adam s/param"] == close(1e-9, rel=1e-6)
    for (d, phase), (got, fitted) in fit.rows.items():  # the fitted seconds include the planned waits
        assert fitted == close(got, rel=0.05), (d, phase)


def _with_waits(result) -> list[tuple[int, dict[str, float]]]:
    """Per device, the seconds the executor would record: each phase's work plus the waits before it (by hand:
    an idle stretch is the phase of the next event that is not idle, ``comm`` before F/B/comm, ``sync`` before
    sync, ``optim`` before optim; the idle after the last event is not counted)."""
    out = []
    for d, events in result.timeline.items():
        tot = dict.fromkeys(FITTED_PHASES, 0.0)
        evs = sorted(events, key=lambda e: e.start)
        for i, e in enumerate(evs):
            if e.kind == "idle":
                nxt = next((n for n in evs[i + 1:] if n.kind != "idle"), None)
                if nxt is not None:
                    tot[{"sync": "sync", "optim": "optim"}.get(nxt.kind, "comm")] += e.end - e.start
            elif e.kind in tot:
                tot[e.kind] += e.end - e.start
        out.append((d, tot))
    return out


def test_calibrate_with_nothing_priceable_raises() -> None:
    """Measured seconds of no phase: the fit's ValueError reaches the caller."""
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(2)
    strat = {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 3]}], "micro_batch_size": 1,
                            "num_micro_batches": 1}]}
    with pytest.raises(ValueError, match="no measured phase the simulator prices"):
        calibrate(model, strat, cluster, {0: {}}, seq_len=16)


def test_as_recorded_counts_idle_before_an_unknown_kind_as_comm_and_drops_the_event() -> None:
    """An event of a kind the fit does not know (not one of FITTED_PHASES): the idle before it is a ``comm`` wait,
    the event itself is not recorded."""
    assert as_recorded([_ev(0.0, 1.0, "idle"), _ev(1.0, 2.0, "other")]) == [
        ("comm", 0.0, 1.0, "comm (waits for data)")]


def test_calibrate_checks_the_strategy_against_the_model_and_the_cluster() -> None:
    """The strategy is loaded with the model (layers beyond its 4: an error naming the layers) and the cluster (a
    device it lacks: an error naming the device)."""
    from hspmd_sdk.errors import PlanValidationError
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(2)
    pipe = {"micro_batch_size": 1, "num_micro_batches": 1}
    too_many = {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 7]}], **pipe}]}
    with pytest.raises(PlanValidationError, match="layer"):
        calibrate(model, too_many, cluster, {0: {"F": 1.0}}, seq_len=16)
    outside = {"pipelines": [{"stages": [{"devices": [5], "layers": [0, 3]}], **pipe}]}
    with pytest.raises(PlanValidationError, match="5"):
        calibrate(model, outside, cluster, {5: {"F": 1.0}}, seq_len=16)


def test_calibrate_ignores_a_measured_device_outside_the_strategy() -> None:
    """A measured rank that the strategy does not use (rank 7 here, with comm and sync seconds) is no row and
    changes nothing: the DP2 fit as without it."""
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(2)
    pipe = {"micro_batch_size": 2, "num_micro_batches": 2}
    strat = {"pipelines": [{"stages": [{"devices": [d], "layers": [0, 3]}], **pipe} for d in (0, 1)]}
    from hspmd_sdk.planner.simulator import simulate
    measured = dict(_with_waits(simulate(model, strat, cluster, seq_len=16, cost=_truth(call_latency=2e-3))))
    fit = calibrate(model, strat, cluster, {**measured, 7: {"comm": 5.0, "sync": 5.0}}, seq_len=16)
    assert fit.figures["intra collective s/call"] == close(2e-3, rel=1e-6)
    assert {d for d, _ in fit.rows} == {0, 1}


def test_calibrate_stops_once_the_figures_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    """DP2 with no waits: the second round fits the same figures as the first, so the fixed point stops there: one
    simulation of the all-zero model, one per figure's column, one per round (2), not the 6 rounds' cap."""
    import hspmd_sdk.planner.calibrate as cal
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(2)
    pipe = {"micro_batch_size": 2, "num_micro_batches": 2}
    strat = {"pipelines": [{"stages": [{"devices": [d], "layers": [0, 3]}], **pipe} for d in (0, 1)]}
    measured = dict(_with_waits(cal.simulate(model, strat, cluster, seq_len=16, cost=_truth(call_latency=2e-3))))
    calls = []

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    real = cal.simulate
    monkeypatch.setattr(cal, "simulate", counting)
    calibrate(model, strat, cluster, measured, seq_len=16)
    n_figures = 5 + 3  # one kind (5 figures), one link class (3)
    assert len(calls) == 1 + n_figures + 2


def test_calibrate_checks_the_global_batch_it_is_given() -> None:
    """``global_batch`` is checked against the strategy's (one micro-batch of 1 on one pipeline: 1, not 8)."""
    from hspmd_sdk.errors import PlanValidationError
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(2)
    strat = {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 3]}], "micro_batch_size": 1,
                            "num_micro_batches": 1}]}
    with pytest.raises(PlanValidationError, match="8"):
        calibrate(model, strat, cluster, {0: {"F": 1.0}}, seq_len=16, global_batch=8)
