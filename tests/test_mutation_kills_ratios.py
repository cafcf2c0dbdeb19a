"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of planner/ratios.py.

Figures by hand from the module's docstring: the LP's optimum without memory limits is speeds proportional, a
device's memory caps its share at ``(M_i - B_rep) / B``; ``plan_ratios`` prices a stage at
``layers x layer_flops(micro_batch x seq, seq) x (1 + backward_factor)`` per device (speed = 1 / seconds) and
``B = params x (4 + 12) + layers x layer_activation_bytes(tokens, 2)``; the summary's text as written.
"""
from __future__ import annotations

import pytest

from hspmd_sdk import Cluster, LlamaConfig
from hspmd_sdk.core.strategy import Stage
from hspmd_sdk.errors import PlanValidationError
from hspmd_sdk.planner import ratios as R
from hspmd_sdk.planner.cost import CostModel
from hspmd_sdk.planner.ratios import RatioPlan, _times, plan_ratios, solve_ratios, split_units

close = pytest.approx
TINY = LlamaConfig.preset("tiny")  # 4 layers, hidden 64, 4 heads, max_seq_len 64


def test_summary_text_and_speedup() -> None:
    """The summary line as written (ratios joined by ':', shares to 3 decimals, speeds to 3 significant digits);
    speedup = even / step time, 1.0 for a zero step time."""
    p = RatioPlan(speeds=(3.0, 1.25), shares=(0.70588, 0.29412), ratios=(3, 1), step_time=0.5, even_time=1.0,
                  ideal_time=0.25)
    assert p.summary() == ("ratios 3:1 (LP shares 0.706, 0.294) for speeds 3, 1.25: est. 0.5 s vs 1 s even "
                           "(2.00x), ideal 0.25 s")
    assert p.speedup == 2.0
    assert RatioPlan((1.0,), (1.0,), (1,), 0.0, 1.0, 1.0).speedup == 1.0


def test_times_is_the_slowest_device_of_a_split() -> None:
    """_times: max over devices of (share x work + repeated) / speed, shares = parts / sum(parts)."""
    assert _times([3, 1], [3.0, 1.0], 8.0, 0.0) == 2.0
    assert _times([1, 1], [3.0, 1.0], 8.0, 1.0) == 5.0
    assert _times([2, 2], [1.0, 4.0], 8.0, 2.0) == 6.0


def test_solve_ratios_times_and_the_ideal() -> None:
    """Speeds 3:1, 8 of split work, 1 repeated: the LP's (8 x + 1) / 3 = (8 (1 - x) + 1) / 1 at x = 13/16; with 8
    parts T = max((n0 + 1) / 3, n1 + 1) is least at 7:1 (8/3); even: max(5/3, 5) = 5; ideal (8 + 2 x 1) / 4."""
    p = solve_ratios([3.0, 1.0], work=8.0, repeated_work=1.0, units=8)
    assert p.ratios == (7, 1)
    assert p.step_time == close(8 / 3) and p.even_time == close(5.0) and p.ideal_time == close(2.5)
    assert p.speeds == (3.0, 1.0) and p.shares == close((0.8125, 0.1875))


def test_solve_ratios_without_units_takes_up_to_64_parts() -> None:
    """units=None: 64 parts, in lowest terms: speeds 5:2 make T = max(n0 / 5, n1 / 2) least at 46:18 = 23:9."""
    assert solve_ratios([5.0, 2.0]).ratios == (23, 9)
    assert solve_ratios([63.0, 1.0]).ratios == (63, 1)


def test_solve_ratios_memory_caps_a_share() -> None:
    """Memory: x_i B + B_rep <= M_i; the fast device of 3:1 may hold (1.0 - 0.3) / 2.0 = 35%, of 5 parts 1
    (2 would need 0.8 + 0.3 > 1.0)."""
    p = solve_ratios([3.0, 1.0], memory=[1.0, 4.0], sharded_bytes=2.0, replicated_bytes=0.3, units=5)
    assert p.shares == close((0.35, 0.65)) and p.ratios == (1, 4)
    # no sharded bytes by default: any memory holds the split
    assert solve_ratios([3.0, 1.0], memory=[0.1, 0.1], units=4).ratios == (3, 1)


def test_solve_ratios_defaults_whole_parts_and_a_quiet_solver(capfd) -> None:
    """Default work 1: 3:1 speeds finish at 1/4 s, even at 1/2 s; the ratios are ints in lowest terms (the summary
    prints 3:1); units == devices is allowed (one part each); CBC prints nothing."""
    p = solve_ratios([3.0, 1.0], units=4)
    assert p.step_time == close(0.25) and p.even_time == close(0.5) and p.ideal_time == close(0.25)
    assert p.summary().startswith("ratios 3:1 (LP shares 0.750, 0.250) for speeds 3, 1: ")
    assert all(type(r) is int for r in p.ratios)
    assert solve_ratios([1.0, 1.0], units=2).ratios == (1, 1)
    assert capfd.readouterr().out == ""


def test_solve_ratios_parts_are_whole_and_at_least_one() -> None:
    """The integral program: three equal devices over 4 parts take 2:1:1 (some order), not the LP's 4/3 each
    rounded; a device 100x slower still gets one part of 4 (3:1, not 4:0)."""
    assert sorted(solve_ratios([1.0, 1.0, 1.0], units=4).ratios) == [1, 1, 2]
    assert solve_ratios([100.0, 1.0], units=4).ratios == (3, 1)


def test_solve_ratios_shares_are_never_negative() -> None:
    """A device whose repeated work alone sets the step (speed 1 beside two of 100, 10 repeated) takes share 0:
    T = 10 cannot drop by giving it a negative share."""
    p = solve_ratios([1.0, 100.0, 100.0], work=1.0, repeated_work=10.0)
    assert p.shares[0] == close(0.0, abs=1e-9) and min(p.shares) >= 0.0 and sum(p.shares) == close(1.0)


@pytest.mark.parametrize("kw, field, text", [
    (dict(speeds=[]), "speeds", "need one positive speed per device, got []"),
    (dict(speeds=[1.0, 0.0]), "speeds", "need one positive speed per device, got [1.0, 0.0]"),
    (dict(speeds=[1.0, float("nan")]), "speeds", "need one positive speed per device"),
    (dict(speeds=[1.0, 1.0], memory=[1.0]), "memory", "1 entries for 2 devices"),
    (dict(speeds=[1.0, 1.0, 1.0], units=2), "units", "2 whole parts cannot give each of 3 devices one"),
    (dict(speeds=[1.0, 1.0], memory=[1.0, 1.0], sharded_bytes=3.0, replicated_bytes=0.5), "memory",
     "no split of 3 bytes (+0.5 on each) fits devices of [1.0, 1.0] bytes"),
    (dict(speeds=[1.0, 1.0], memory=[0.4, 0.7], sharded_bytes=1.0, units=2), "units",
     "no split into 2 whole parts fits the devices' memory"),
])
def test_solve_ratios_errors_name_the_field_and_say_why(kw, field, text) -> None:
    """Each refusal names its field and says what does not fit."""
    with pytest.raises(PlanValidationError) as e:
        solve_ratios(**kw)
    assert (field, text) in [(f, r) for f, r in e.value.problems] or any(
        f == field and text in r for f, r in e.value.problems), e.value.problems


def test_split_units_counts_the_embedding_and_head_only_when_asked(monkeypatch) -> None:
    """split_units is the gcd of the sizes stage_units reaches, given the stage's first/last (default neither);
    a stage whose split reaches no tensor has one whole part."""
    seen = []

    def fake(model, stage, *, first=False, last=False):
        seen.append((first, last))
        return [("x", 0, 12)] + ([("e", 0, 8)] if first else []) + ([("h", 0, 9)] if last else [])
    monkeypatch.setattr(R, "stage_units", fake)
    stage = Stage(devices=[0, 1], layers=[0, 0])
    assert split_units(TINY, stage) == 12
    assert split_units(TINY, stage, first=True) == 4
    assert split_units(TINY, stage, last=True) == 3
    assert split_units(TINY, stage, first=True, last=True) == 1
    monkeypatch.setattr(R, "stage_units", lambda *a, **k: [])
    assert split_units(TINY, stage) == 1


def test_split_units_of_a_vocabulary_the_heads_do_not_divide() -> None:
    """Llama's head splits the vocabulary: 250 rows with 4 heads leave 2 whole parts for a last stage, 4 otherwise."""
    m = LlamaConfig(vocab_size=250, hidden_size=64, num_layers=2, num_heads=4, ffn_hidden_size=128, max_seq_len=64)
    stage = Stage(devices=[0, 1], layers=[0, 1])
    assert split_units(m, stage) == 4 and split_units(m, stage, last=True) == 2


def _box(fast_mb: int) -> Cluster:
    """A 3-TFLOPS device of ``fast_mb`` MiB (rank 0) and a 1-TFLOPS one of 1000 MiB (rank 1)."""
    return Cluster.load({"nodes": [{"host": "a", "kind": "fast", "ranks": [0]},
                                   {"host": "b", "kind": "slow", "ranks": [1]}],
                         "devices": {"fast": {"kind": "fast", "memory_mb": fast_mb, "bf16_tflops": 3.0,
                                              "intra_bandwidth_gbs": 1.0},
                                     "slow": {"kind": "slow", "memory_mb": 1000, "bf16_tflops": 1.0,
                                              "intra_bandwidth_gbs": 1.0}}})


def _speeds(flops: float) -> tuple[float, float]:
    return tuple(1.0 / (flops / (t * 1e12 * 0.45)) for t in (3.0, 1.0))


def test_plan_ratios_defaults_by_hand() -> None:
    """Defaults: one micro-batch of the model's max length (64), the stage holds embedding and head.  Speeds: 1 /
    the seconds of 4 layers x layer_flops(64, 64) x 3; the fast device's 2 MiB cap its share at 2 MiB / B with
    B = (4 x 41088 + 16384 + 16448) x 16 + 4 x layer_activation_bytes(64, 2)."""
    stage = Stage(devices=[0, 1], layers=[0, 3])
    p = plan_ratios(TINY, _box(2), stage)
    assert p.speeds == close(_speeds(4 * TINY.layer_flops(64, 64) * 3))
    B = (4 * 41088 + 16384 + 16448) * 16 + 4 * TINY.layer_activation_bytes(64, 2)
    assert p.shares[0] == close(2 * 2**20 / B, rel=1e-7)  # CBC reports 8 digits
    assert p.ratios == (1, 1)  # 4 whole parts (heads): the cap (0.58) allows the fast device 2 of them
    # the work of the whole stage is 1: ideal 1 / sum(speeds); 1:1 leaves the slow device half of it
    assert p.ideal_time == close(1 / sum(p.speeds)) and p.step_time == close(0.5 / p.speeds[1])


def test_plan_ratios_arguments_by_hand() -> None:
    """micro_batch 2, seq_len 32, neither embedding nor head, a cost model of backward factor 1: speeds from 4 x
    layer_flops(64, 32) x 2 and B = 4 x 41088 x 16 + 4 x layer_activation_bytes(64, 2)."""
    stage = Stage(devices=[0, 1], layers=[0, 3])
    p = plan_ratios(TINY, _box(2), stage, micro_batch=2, seq_len=32, first=False, last=False,
                    cost=CostModel(backward_factor=1.0))
    assert p.speeds == close(_speeds(4 * TINY.layer_flops(64, 32) * 2))
    B = 4 * 41088 * 16 + 4 * TINY.layer_activation_bytes(64, 2)
    assert p.shares[0] == close(2 * 2**20 / B, rel=1e-7)


def test_plan_ratios_takes_measured_speeds() -> None:
    """Given speeds replace the cost model's; without a binding memory the LP follows them."""
    p = plan_ratios(TINY, _box(1000), Stage(devices=[0, 1], layers=[0, 3]), speeds=[1.0, 3.0])
    assert p.speeds == (1.0, 3.0) and p.shares == close((0.25, 0.75)) and p.ratios == (1, 3)


def test_plan_ratios_units_count_the_embedding_and_head_it_holds(monkeypatch) -> None:
    """plan_ratios asks split_units with its own first/last (default: both held): a stage whose embedding adds a
    size of 2 beside the layers' 4 has 2 whole parts, and 3:1 speeds then give 1:1 (not 3:1, as without it)."""
    monkeypatch.setattr(R, "stage_units", lambda model, stage, *, first=False, last=False:
                        [("x", 0, 4)] + ([("e", 0, 2)] if first else []))
    stage = Stage(devices=[0, 1], layers=[0, 3])
    assert plan_ratios(TINY, _box(1000), stage, speeds=[3.0, 1.0]).ratios == (1, 1)
    assert plan_ratios(TINY, _box(1000), stage, speeds=[3.0, 1.0], first=False).ratios == (3, 1)
