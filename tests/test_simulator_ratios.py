"""The simulator prices an uneven stage (SPEC §12, HAP ratios) by each device's share of the split work.

Independent reference: with the analytic cost model, compute time is linear in FLOPs, so a device holding
``r_i / sum(r)`` of a stage's TP-split tensors computes that share of the layer's FLOPs; the stage moves at the pace
of the slowest device, ``max_i(share_i * T_i)`` with ``T_i`` the whole layer's compute time on that device kind.
The group's collectives are those of its ``tp`` ranks, whatever the split.
"""
from __future__ import annotations

import pytest

from hspmd_sdk import Cluster, LlamaConfig, Strategy
from hspmd_sdk.core.strategy import Stage
from hspmd_sdk.planner import CostModel, simulate
from hspmd_sdk.planner.cost import layer_cost
from hspmd_sdk.planner.simulator import _ring_link, _stage_cost

MODEL = LlamaConfig.preset("llama-7b")
FAST_SLOW = Cluster.load({"nodes": [{"host": "a", "kind": "H800", "ranks": [0]},
                                    {"host": "b", "kind": "H20", "ranks": [1]}]})
MB, SEQ = 1, 2048


def _whole(rank: int, cost: CostModel) -> float:
    """Forward compute of one whole decoder layer on rank ``rank``'s device kind (no TP)."""
    return layer_cost(MODEL, FAST_SLOW.spec(rank), 1, _ring_link(FAST_SLOW, [0, 1]), MB, SEQ, cost).fwd_compute


@pytest.mark.parametrize("ratios", [None, [1, 1], [3, 1], [1, 3]])
def test_an_uneven_stage_moves_at_the_pace_of_its_slowest_share(ratios) -> None:
    cost = CostModel()
    stage = Stage(devices=[0, 1], layers=[0, 0], ratios=ratios)
    got = _stage_cost(MODEL, stage, False, False, FAST_SLOW, MB, SEQ, cost, share=1.0)
    shares = [r / sum(ratios) for r in ratios] if ratios else [0.5, 0.5]
    want = max(s * _whole(d, cost) for d, s in zip((0, 1), shares))
    assert got.fwd - got.fwd_comm == pytest.approx(want, rel=1e-9)
    even = _stage_cost(MODEL, Stage(devices=[0, 1], layers=[0, 0]), False, False, FAST_SLOW, MB, SEQ, cost, share=1.0)
    assert got.fwd_comm == pytest.approx(even.fwd_comm, rel=1e-12)  # the same two ranks' all-reduces


def test_the_step_time_of_an_uneven_plan_follows_the_speed_ratio() -> None:
    """H800 and H20 (990 and 148 TFLOPS): 3:1 towards the fast device is faster than the even split, the reverse
    1:3 slower, as the compute shares say."""
    times = {}
    for ratios in ([1, 1], [3, 1], [1, 3]):
        strategy = Strategy.load({"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, MODEL.num_layers - 1],
                                                            "ratios": ratios}],
                                                "micro_batch_size": 1, "num_micro_batches": 4}]},
                                 model=MODEL, cluster=FAST_SLOW)
        times[tuple(ratios)] = simulate(MODEL, strategy, FAST_SLOW, seq_len=SEQ).step_time
    assert times[(3, 1)] < 0.7 * times[(1, 1)] and times[(1, 3)] > 1.3 * times[(1, 1)], times


@pytest.mark.parametrize("ratios", [[3, 1], [1, 3], [21, 11]])
@pytest.mark.parametrize("zero1", [False, True])
def test_each_device_of_an_uneven_stage_holds_its_own_share_in_memory(ratios, zero1) -> None:
    """Memory per device follows its share (the pace-setter's share was counted for every device): against the
    strategy's own estimate (:meth:`Strategy.memory_estimate`, an independent formula over the plan's shapes)
    and the even split, whose split bytes the shares divide."""
    def strategy(rs):
        stage = {"devices": [0, 1], "layers": [0, MODEL.num_layers - 1], **({"ratios": rs} if rs else {})}
        return Strategy.load({"zero1": zero1, "pipelines": [{"stages": [stage], "micro_batch_size": 1,
                                                               "num_micro_batches": 1}]})

    uneven, even = (simulate(MODEL, strategy(rs), FAST_SLOW, global_batch=1, seq_len=SEQ) for rs in (ratios, None))
    params = {d: uneven.memory[d]["params"] for d in (0, 1)}
    assert params[0] / params[1] > 1 if ratios[0] > ratios[1] else params[0] / params[1] < 1
    # the split parameters add up to the even split's: sum over devices is the same model
    assert params[0] + params[1] == pytest.approx(2 * even.memory[0]["params"], rel=1e-9)
    est = strategy(ratios).memory_estimate(MODEL, seq_len=SEQ)
    reserve = uneven.memory[0]["reserve"]
    for d in (0, 1):  # the simulator and the strategy's estimate agree within a few percent, device by device
        assert uneven.peak_memory[d] - reserve == pytest.approx(est[d], rel=0.05), (d, uneven.memory[d], est[d])
    # 3:1 of the 7B's states overfills the H800 (one replica: ZeRO-1 has nothing to shard over)
    assert (uneven.oom == [0]) == (ratios == [3, 1])
