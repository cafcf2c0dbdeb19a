"""The heterogeneous planner chooses ZeRO shares (``Pipeline.zero_share``) by the memory its devices have free.

A Llama of 2.7B parameters as two replicas, one on an 80 GB card and one on a 24 GB card: with even ZeRO-1 shares
the 24 GB card's estimate is above its memory (and ZeRO-2 does not save it: its activations and bf16 weights leave
too little), so until now ``plan_hetero`` found no data-parallel plan; with shares by free memory every device's
estimate is within its memory, and both pipelines' fullest devices fill the same fraction of the memory they have
free for the sharded state (the rule's promise).  Devices of one memory keep even shares (the JSON unchanged); a
strategy with uneven TP ratios gets none.  The tiny GPT planned the same way on fake small devices specializes and
trains like the single-device model on local CPU workers (the recipe test's job and reference).
"""
from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hspmd_sdk import Cluster, GPTConfig, LlamaConfig  # noqa: E402
from hspmd_sdk.core.strategy import Strategy  # noqa: E402
from hspmd_sdk.planner.cost import CostModel  # noqa: E402
from hspmd_sdk.planner.hetero import plan_hetero  # noqa: E402
from hspmd_sdk.planner.zero_shares import memory_shares, with_memory_shares  # noqa: E402

from test_training_recipe import (SEQ, _pipe, _program, _rel, _state_matches, gpt, reference,  # noqa: E402,F401
                                  train_plans)

LLAMA_2_7B = LlamaConfig(name="llama-2.7b", vocab_size=32000, hidden_size=2560, num_layers=32, num_heads=32,
                         num_kv_heads=32, ffn_hidden_size=6912, max_seq_len=2048)


def _pair(big: dict, small: dict, smalls: int = 1) -> Cluster:
    """Two hosts: rank 0 of ``big``, ranks 1.. (``smalls`` of them) of ``small`` (device specs)."""
    return Cluster.load({"devices": {big["kind"]: big, small["kind"]: small},
                         "nodes": [{"host": "a", "kind": big["kind"], "ranks": [0]},
                                   {"host": "b", "kind": small["kind"], "ranks": list(range(1, 1 + smalls))}]})


G80 = {"kind": "G80", "memory_mb": 81920, "bf16_tflops": 312, "intra_bandwidth_gbs": 300}
G24 = {"kind": "G24", "memory_mb": 24576, "bf16_tflops": 165, "intra_bandwidth_gbs": 32}


def _even(strategy: Strategy) -> Strategy:
    data = strategy.model_dump()
    for p in data["pipelines"]:
        p.pop("zero_share", None)
    return Strategy.model_validate(data)


def _memory(strategy: Strategy, model: Any, cluster: Cluster, seq_len: int, cost: CostModel) -> dict:
    return strategy.device_memory(model, cluster, seq_len=seq_len, **cost.memory_options())


def test_the_24gb_card_holds_a_smaller_share_and_fits() -> None:
    cluster, cost = _pair(G80, G24), CostModel()
    got = plan_hetero(LLAMA_2_7B, cluster, global_batch=8, seq_len=2048, min_pipelines=2)
    assert [p.ranks for p in got.pipelines] == [[0], [1]] and got.zero == 1
    shares = got.zero_shares()
    assert shares is not None and shares[0] == 1.0 and 0 < shares[1] < 0.5, shares
    assert float(f"{shares[1]:.3g}") == shares[1]  # three significant digits
    capacity = {r: cluster.spec(r).memory_bytes for r in (0, 1)}
    planned = _memory(got, LLAMA_2_7B, cluster, 2048, cost)
    even = _memory(_even(got), LLAMA_2_7B, cluster, 2048, cost)
    assert all(planned[r].total <= capacity[r] for r in (0, 1)), planned
    assert even[1].total > capacity[1] >= planned[1].total  # the 24 GB card: over with even shares, within now
    assert even[1].total / capacity[1] > 1.3 and planned[1].total / capacity[1] < 0.9
    # at ZeRO-2 with even shares it would not fit either
    assert _memory(_even(got).model_copy(update={"zero": 2}), LLAMA_2_7B, cluster, 2048, cost)[1].total > capacity[1]
    # the rule's promise: each pipeline's device fills the same fraction of what it has free for the sharded state
    used = []
    for r in (0, 1):
        sharded = planned[r].optimizer
        unsharded = planned[r].total - sharded
        used.append(sharded / (capacity[r] - unsharded))
    assert used[0] == pytest.approx(used[1], rel=5e-3), used
    assert "(ZeRO shares 1:" in got.name and "by free memory: the fullest device (rank 1) at 85% of its memory, " \
        "136% (rank 1) with even shares)" in got.name, got.name


def test_devices_of_one_memory_keep_even_shares() -> None:
    """A fast and a slow card of the same memory: the same plan shape, no share set, no ``zero_share`` in the JSON
    and nothing about shares in the name."""
    slow = {**G80, "kind": "G80slow", "bf16_tflops": 120}
    got = plan_hetero(LLAMA_2_7B, _pair(G80, slow), global_batch=8, seq_len=2048, min_pipelines=2)
    assert got.zero1 and len(got.pipelines) == 2 and got.zero_shares() is None
    assert "zero_share" not in got.model_dump_json() and "ZeRO shares" not in got.name
    one = plan_hetero(LLAMA_2_7B, Cluster.mixed({"H800": 8}), global_batch=16, seq_len=2048, min_pipelines=2)
    assert one.zero_shares() is None and "ZeRO shares" not in one.name


def test_no_shares_beside_ratios_or_without_zero() -> None:
    cluster, cost = _pair(G80, G24, smalls=3), CostModel()
    kw = dict(seq_len=2048, cost=cost)
    ratios = Strategy.load({"pipelines": [_pipe([([0, 1], [0, 31], {"ratios": [3, 1]})], 1, 4),
                                          _pipe([([2, 3], [0, 31], {"ratios": [3, 1]})], 1, 4)], "zero1": True})
    assert memory_shares(ratios, LLAMA_2_7B, cluster, **kw) is None
    plain = Strategy.load({"pipelines": [_pipe([([0], [0, 31])], 1, 4), _pipe([([1], [0, 31])], 1, 4)]})
    assert memory_shares(plain, LLAMA_2_7B, cluster, **kw) is None
    zero1 = plain.model_copy(update={"zero1": True})
    assert with_memory_shares(zero1, LLAMA_2_7B, cluster, **kw).zero_shares() is not None


def test_planned_shares_specialize_and_train_like_the_reference(gpt: GPTConfig, reference: Any,
                                                                tmp_path: Any) -> None:
    """The tiny GPT on fake devices of 4 MiB and 2 MiB (no runtime reserve): even shares put the small one at 113%
    of its memory, the planner's shares 1:0.333 at 82%; the strategy specializes on that cluster and, run on local
    CPU workers, trains like the single-device model (losses, norms, final parameters and Adam moments)."""
    big = {"kind": "BIG", "memory_mb": 4, "bf16_tflops": 1, "intra_bandwidth_gbs": 5}
    small = {"kind": "SMALL", "memory_mb": 2, "bf16_tflops": 0.5, "intra_bandwidth_gbs": 5}
    cluster, cost = _pair(big, small), CostModel(memory_reserve_mb=0)
    got = plan_hetero(gpt, cluster, global_batch=8, seq_len=SEQ, min_pipelines=2, cost=cost)
    assert got.zero_shares() == [1.0, 0.333] and got.zero == 1, got
    planned, even = _memory(got, gpt, cluster, SEQ, cost), _memory(_even(got), gpt, cluster, SEQ, cost)
    assert planned[1].total <= 2 * 2**20 < even[1].total and planned[0].total <= 4 * 2**20
    program = _program(gpt, got.model_dump(), cluster)
    assert program.pipelines == [[[0]], [[1]]]
    # the Adam moments of the embedding (256 rows) in the shares' proportions: 192 rows on rank 0, 64 on rank 1
    assert "hdim=0 ratios=192:64" in str(program.state_layouts()["wte.weight.exp_avg"].annotation)
    trained = train_plans(gpt, {"planned": got.model_dump()}, tmp_path)
    run = trained["runs"]["planned"]
    assert _rel(run["losses"], reference.losses) <= 1e-5
    assert _rel(run["grad_norms"], reference.grad_norms) <= 1e-6, (run["grad_norms"], reference.grad_norms)
    _state_matches(trained["out"], reference, 0)


# ---- ZeRO-3: the weights sharded too, by the same shares --------------------------------------------------------
G6 = {"kind": "G6", "memory_mb": 6144, "bf16_tflops": 165, "intra_bandwidth_gbs": 32}
G8 = {**G6, "kind": "G8", "memory_mb": 8192}


def test_the_planner_prices_zero3_weights_as_sharded_and_never_recomputes_there() -> None:
    """The planner's model-state bytes at ZeRO-3 divide the bf16 weights by the replicas too; everything is then
    sharded (nothing of the model state is outside ZeRO's shares); a stage's transient holds the two layers
    gathered at once (the one read, the next prefetched); the layer ILPs never fall back to recomputation."""
    from hspmd_sdk.planner.hetero import PlanContext, _gathered, _static_bytes

    assert _static_bytes(10.0, 4, 3) == 10 * (2 / 4 + 2 / 4 + 12 / 4)
    assert _static_bytes(10.0, 4, 2) == 10 * (2 + 2 / 4 + 12 / 4)
    assert _gathered(10.0, 3) == 40.0 and _gathered(10.0, 2) == 0.0
    cluster = _pair(G80, G6)
    three = PlanContext(LLAMA_2_7B, cluster, global_batch=8, seq_len=512, zero=3, zero_shares=True)
    two = PlanContext(LLAMA_2_7B, cluster, global_batch=8, seq_len=512, zero=2, zero_shares=True)
    params = LLAMA_2_7B.param_count()
    assert three.state_bytes() == (0.0, pytest.approx(params * 16))
    assert two.state_bytes()[0] == pytest.approx(params * 2)  # the bf16 weights, whole on every replica
    assert three.recompute_options == (False,) and two.recompute_options == (False, True)
    from hspmd_sdk.planner.hetero import TPGroup

    group = TPGroup((1,), "G6", 1)
    p3, p2 = three.profile(group, 1, 2), two.profile(group, 1, 2)
    layer_bf16 = LLAMA_2_7B.layer_param_count() * 2
    assert p3.layer_transient == pytest.approx(p2.layer_transient + 2 * max(
        layer_bf16, LLAMA_2_7B.embedding_param_count() * 2, LLAMA_2_7B.head_param_count() * 2))
    assert p3.layer_static == pytest.approx(p2.layer_static - layer_bf16 / 2)


def test_a_card_too_small_for_zero2_gets_an_uneven_zero3_plan() -> None:
    """Llama 2.7B beside a 6 GB card (seq 512): with ZeRO-1 and ZeRO-2 no plan fits (the card cannot hold the bf16
    weights, 5 GB, and the runtime's reserve), so ``plan_hetero`` plans ZeRO-3 with shares by free memory and says
    why; every device's estimate is within its memory, each pipeline's fullest device fills the same fraction of
    what it has free for the sharded state (weights, gradients, master weights and moments), and the pipelines'
    unequal micro-batch counts run under GPipe.  Beside an 8 GB card, where ZeRO-2 fits, the planner keeps ZeRO-2:
    the simulator prices ZeRO-3's gathers (every layer before each forward and backward, over a 32 GB/s link)
    at twice the step."""
    from hspmd_sdk.errors import PlanValidationError
    from hspmd_sdk.planner.simulator import simulate

    cluster, cost = _pair(G80, G6), CostModel()
    got = plan_hetero(LLAMA_2_7B, cluster, global_batch=8, seq_len=512, min_pipelines=2)
    assert got.zero == 3 and [p.ranks for p in got.pipelines] == [[0], [1]]
    assert got.schedule == "gpipe" and len({p.num_micro_batches for p in got.pipelines}) == 2
    assert not any(st.recompute for p in got.pipelines for st in p.stages)
    shares = got.zero_shares()
    assert shares is not None and shares[0] == 1.0 and 0 < shares[1] < 0.1, shares
    assert "(ZeRO-3: with ZeRO-1, no strategy for llama-2.7b fits 2 devices" in got.name and \
        "and with ZeRO-2 too)" in got.name and "ZeRO shares 1:" in got.name, got.name
    with pytest.raises(PlanValidationError, match="no strategy"):
        plan_hetero(LLAMA_2_7B, cluster, global_batch=8, seq_len=512, min_pipelines=2, zero=2)
    capacity = {r: cluster.spec(r).memory_bytes for r in (0, 1)}
    planned = _memory(got, LLAMA_2_7B, cluster, 512, cost)
    even = _memory(_even(got), LLAMA_2_7B, cluster, 512, cost)
    assert all(planned[r].total <= capacity[r] for r in (0, 1)), planned
    assert even[1].total > 2 * capacity[1]
    # the small card holds its share of the weights: its bf16 weights are its gradients' bytes (same shard)
    assert planned[1].grads < 0.1 * planned[0].grads
    used = []
    for r in (0, 1):
        sharded = planned[r].optimizer + 2 * planned[r].grads  # moments and masters, gradients, weights
        used.append(sharded / (capacity[r] - (planned[r].total - sharded)))
    assert used[0] == pytest.approx(used[1], rel=5e-3), used
    assert not simulate(LLAMA_2_7B, got, cluster, seq_len=512, cost=cost).oom

    roomier = _pair(G80, G8)
    auto = plan_hetero(LLAMA_2_7B, roomier, global_batch=8, seq_len=512, min_pipelines=2)
    three = plan_hetero(LLAMA_2_7B, roomier, global_batch=8, seq_len=512, min_pipelines=2, zero=3)
    assert (auto.zero, three.zero) == (2, 3)
    t2, t3 = (simulate(LLAMA_2_7B, s, roomier, seq_len=512, cost=cost) for s in (auto, three))
    assert not t2.oom and not t3.oom and t3.step_time > 1.5 * t2.step_time, (t2.step_time, t3.step_time)


def test_where_memory_binds_the_planner_takes_the_fastest_level() -> None:
    """Llama-70B on 8 H800 and 16 H20 (global batch 64, 4K tokens): the ZeRO-1 plan fits with its fullest device at
    99% of its memory, three pipelines; at ZeRO-2 four fit, and the simulator finds that plan 1.6x faster, so
    ``plan_hetero`` returns it and its name gives each level's simulated step.  A plan whose memory does not bind
    is not compared (Llama-7B on 8 H800 keeps ZeRO-1 and its name)."""
    from hspmd_sdk.planner.hetero import BINDING
    from hspmd_sdk.planner.simulator import simulate
    from hspmd_sdk.planner.zero_shares import peak_fraction

    model, cost = LlamaConfig.preset("llama-70b"), CostModel()
    cluster = Cluster.mixed({"H800": 8, "H20": 16})
    one = plan_hetero(model, cluster, global_batch=64, seq_len=4096, zero=1)
    assert peak_fraction(one, model, cluster, seq_len=4096, cost=cost)[0] >= BINDING
    got = plan_hetero(model, cluster, global_batch=64, seq_len=4096)
    assert got.zero == 2 and len(got.pipelines) > len(one.pipelines), (got.name, one.name)
    t1, t2 = (simulate(model, s, cluster, seq_len=4096, cost=cost).step_time for s in (one, got))
    assert t2 < t1 / 1.3, (t1, t2)
    assert f"(ZeRO-2: the fastest where memory binds, ZeRO-1's fullest device (rank " in got.name, got.name
    assert f"simulated steps ZeRO-1 {t1:.3g} s, ZeRO-2 {t2:.3g} s" in got.name, got.name
    roomy = plan_hetero("llama-7b", Cluster.mixed({"H800": 8}), global_batch=16, seq_len=2048)
    assert roomy.zero == 1 and "memory binds" not in roomy.name
