"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of core/memory.py.

Every figure is worked out by hand from the module docstring's accounting, for a tiny fake model whose counts are
round numbers: a layer has 100 parameters and keeps 100 bytes of activations a token, the embedding 50
parameters, the final norm and head 30; hidden 8, vocabulary 32.
"""
from __future__ import annotations

import pytest

from hspmd_sdk import Cluster, Strategy
from hspmd_sdk.core.memory import DeviceMemory, device_memory, head_activations, layer_activations

MIB = 2.0**20


class Fake:
    """The fake model: only what the estimate reads."""

    hidden_size = 8
    vocab_size = 32
    max_seq_len = 16

    def layer_param_count(self) -> int:
        return 100

    def embedding_param_count(self) -> int:
        return 50

    def head_param_count(self) -> int:
        return 30

    def layer_activation_bytes(self, tokens: float) -> float:
        return 100 * tokens


M = Fake()


def test_runtime_text_and_parts() -> None:
    """What the runtime part is called for no device, a CPU worker and a GPU; parts() is the simulator's breakdown
    under its keys."""
    assert DeviceMemory(1, 2, 3, 4, 5).runtime_text() == "no device given"
    assert DeviceMemory(1, 2, 3, 4, 5, "cpu").runtime_text() == "process baseline (Python, torch, gloo)"
    assert DeviceMemory(1, 2, 3, 4, 5, "H800").runtime_text() == "CUDA context and allocator reserve"
    assert DeviceMemory(1, 2, 3, 4, 5, "H800").parts() == {"params": 1, "grads": 2, "optimizer": 3,
                                                           "activations": 4, "reserve": 5}


def test_layer_activations_by_hand() -> None:
    """tokens 10, split 4: the layer keeps 1000 bytes / 4 with sequence parallelism; without it the norms' 4 * hidden
    bf16 values a token (640 bytes) stay whole: 640 + 360 / 4.  Recompute keeps the layer input (10 * 8 * 2 bytes,
    split by SP only) and holds the full activations transiently."""
    assert layer_activations(M, 10, 4) == (250.0, 0.0)  # defaults: no recompute, sequence parallel
    assert layer_activations(M, 10, 4, recompute=True) == (40.0, 250.0)
    assert layer_activations(M, 10, 4, sequence_parallel=False) == (730.0, 0.0)
    assert layer_activations(M, 10, 4, recompute=True, sequence_parallel=False) == (160.0, 730.0)


def test_head_activations_by_hand() -> None:
    """The head keeps its input (10 tokens * 8 * 2 bytes) and holds fp32 logits and their gradient, split 4."""
    assert head_activations(M, 10, 4) == (160.0, 640.0)


def test_uneven_and_context_parallel_stages_by_hand() -> None:
    """Stage 0: ratios 3:1 over ranks 0, 1 (shares 3/4 and 1/4: splits 4/3 and 4), layers 0-1 and the embedding
    (250 parameters), 2 micro-batches in flight (1F1B, 2 stages), 2 * 16 tokens.  Stage 1: CP2 over ranks 2, 3
    (TP1), layer 2 and the head (130 parameters), one micro-batch in flight of 2 * 16 / 2 tokens; its head's logits
    (2 * 16 * 32 * 4 bytes) are the transient.  The runtime part is the GPU reserve given, for the device given."""
    s = Strategy.load({"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, 1], "ratios": [3, 1]},
                                                 {"devices": [2, 3], "layers": [2, 2], "cp": 2}],
                                      "micro_batch_size": 2, "num_micro_batches": 4}]})
    got = device_memory(s, M, device="cuda", gpu_reserve_mb=3)
    reserve = 3 * MIB
    exp = {0: (375, 375, 2250, 2 * 2 * 2400, reserve, "cuda"),
           1: (125, 125, 750, 2 * 2 * 800, reserve, "cuda"),
           2: (260, 260, 1560, 1600 + 256 + 4096, reserve, "cuda"),
           3: (260, 260, 1560, 1600 + 256 + 4096, reserve, "cuda")}
    assert sorted(got) == [0, 1, 2, 3]
    for r, (params, grads, opt, act, runtime, kind) in exp.items():
        m = got[r]
        assert (m.params, m.grads, m.optimizer, m.activations) == pytest.approx((params, grads, opt, act),
                                                                                rel=1e-12), r
        assert (m.runtime, m.kind) == (runtime, kind), r


def test_sequence_parallel_switch_reaches_the_layers() -> None:
    """One TP2 stage of layer 0 (first and last), 4 tokens: with SP the layer keeps 400 / 2 bytes, without it
    256 + 144 / 2; the head keeps 64 bytes and its logits (2 * 4 * 32 * 4 / 2 bytes) are the transient."""
    s = Strategy.load({"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, 0]}],
                                      "micro_batch_size": 1, "num_micro_batches": 1}]})
    assert device_memory(s, M, seq_len=4)[0].activations == 200 + 64 + 512
    assert device_memory(s, M, seq_len=4, sequence_parallel=False)[0].activations == 328 + 64 + 512
    assert device_memory(s, M, seq_len=4)[0].params == 180 / 2 * 2


def test_runtime_part_by_the_cluster_s_kinds() -> None:
    """Without a device the cluster's kind of each rank picks the runtime part given (CPU baseline, GPU reserve);
    a rank outside the cluster has none (kind "")."""
    s = Strategy.load({"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, 0]}],
                                      "micro_batch_size": 1, "num_micro_batches": 1}]})
    cpu = device_memory(s, M, Cluster.local(2), gpu_reserve_mb=7, cpu_baseline_mb=5)
    assert [(cpu[r].runtime, cpu[r].kind) for r in (0, 1)] == [(5 * MIB, "cpu")] * 2
    gpu = device_memory(s, M, Cluster.mixed({"H800": 2}), gpu_reserve_mb=7, cpu_baseline_mb=5)
    assert [(gpu[r].runtime, gpu[r].kind) for r in (0, 1)] == [(7 * MIB, "H800")] * 2
    short = device_memory(s, M, Cluster.local(1), gpu_reserve_mb=7, cpu_baseline_mb=5)
    assert [(short[r].runtime, short[r].kind) for r in (0, 1)] == [(5 * MIB, "cpu"), (0.0, "")]
    forced = device_memory(s, M, Cluster.mixed({"H800": 2}), device="cpu", gpu_reserve_mb=7, cpu_baseline_mb=5)
    assert [(forced[r].runtime, forced[r].kind) for r in (0, 1)] == [(5 * MIB, "cpu")] * 2


def test_an_even_stage_splits_by_its_degree_exactly() -> None:
    """An even stage divides by its TP degree itself, not by 1 / share: for TP49, 1 / (1 / 49) is
    49.00000000000001 in floating point, and the figures would differ in their last bits."""
    s = Strategy.load({"pipelines": [{"stages": [{"devices": list(range(49)), "layers": [0, 0]}],
                                      "micro_batch_size": 1, "num_micro_batches": 1}]})
    m = device_memory(s, M, seq_len=4)[48]
    assert m.params == 50 / 49 * 2 + 100 / 49 * 2 + 30 / 49 * 2
    assert m.optimizer == 50 / 49 * 12 + 100 / 49 * 12 + 30 / 49 * 12


# ---- ZeRO levels: shards by shares, ZeRO-2's gradients, ZeRO-3's parameters and what it gathers -------------------
class Big(Fake):
    """A model large enough that ZeRO-3 merges its units into more than one (ZERO3_UNIT_BYTES is 4 MiB): a layer
    of 2**20 parameters (2 MiB in bf16), the embedding 3 * 2**20 (6 MiB), the head 2**19 (1 MiB)."""

    def layer_param_count(self) -> int:
        return 2**20

    def embedding_param_count(self) -> int:
        return 3 * 2**20

    def head_param_count(self) -> int:
        return 2**19


BIG = Big()
#: the parameter counts of a stage holding the whole model (4 layers, the embedding, the head)
BIG_UNITS = [3 * 2**20] + [2**20] * 4 + [2**19]


def _gathered(largest: float, total: float) -> float:
    """ZeRO-3's gathered bytes, worked out here: units up to 4 MiB plus one layer; the unit read and the next
    prefetched, or everything when one unit holds it."""
    unit = min(total, largest + 4 * MIB)
    return unit if unit >= total else 2 * unit


def test_zero3_gathered_both_branches() -> None:
    """zero3_gathered: everything when one unit holds it (at the bound too), else twice the largest unit."""
    from hspmd_sdk.core.memory import zero3_gathered
    assert zero3_gathered(10.0, 100.0) == 100.0
    assert zero3_gathered(0.0, 0.0) == 0.0
    assert zero3_gathered(MIB, 5 * MIB) == 5 * MIB  # exactly one unit: largest + 4 MiB == total
    assert zero3_gathered(MIB, 5 * MIB + 1) == 2 * 5 * MIB
    assert zero3_gathered(3.0, 16 * MIB) == 2 * (3.0 + 4 * MIB)
    assert zero3_gathered(6 * MIB, 15 * MIB) == 20 * MIB


def _dp2(zero: int, shares: bool) -> Strategy:
    """Two one-stage replicas of the whole model, the first with ZeRO share 3 when ``shares``."""
    pipes = [{"stages": [{"devices": [r], "layers": [0, 3]}], "micro_batch_size": 1, "num_micro_batches": 2}
             for r in (0, 1)]
    if shares:
        pipes[0]["zero_share"] = 3
    return Strategy.load({"pipelines": pipes, "zero": zero})


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_states_at_every_zero_level_with_shares_3_to_1(zero: int) -> None:
    """Shares 3:1 (from ZeRO-1 on; none at level 0): rank 0 holds 3/4 of each sharded tensor, rank 1 1/4.  Level 1
    shards the 12 optimizer bytes a parameter, 2 also the 2 gradient bytes, 3 also the 2 parameter bytes, plus what
    it gathers: its units (15 MiB in all, the largest 6 MiB) merge into units of 10 MiB, read and prefetched."""
    got = device_memory(_dp2(zero, shares=zero >= 1), BIG)
    n = sum(BIG_UNITS)
    whole = {0: 1.0, 1: 1.0} if zero == 0 else {0: 3 / 4, 1: 1 / 4}
    for r in (0, 1):
        part = whole[r]
        params = 2 * n * (part if zero >= 3 else 1) + (_gathered(6 * MIB, 15 * MIB) if zero >= 3 else 0)
        grads = 2 * n * (part if zero >= 2 else 1)
        optimizer = 12 * n * (part if zero >= 1 else 1)
        m = got[r]
        assert (m.params, m.grads, m.optimizer) == pytest.approx((params, grads, optimizer), rel=1e-12), (zero, r)
    if zero == 3:
        assert got[0].params == pytest.approx(2 * n * 3 / 4 + 20 * MIB, rel=1e-12)
        assert got[1].params == pytest.approx(2 * n / 4 + 20 * MIB, rel=1e-12)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_even_shares_halve_the_sharded_states(zero: int) -> None:
    """Without shares (even) two replicas halve each sharded state."""
    got = device_memory(_dp2(zero, shares=False), BIG)
    n = sum(BIG_UNITS)
    for r in (0, 1):
        m = got[r]
        assert m.optimizer == 12 * n / 2
        assert m.grads == (2 * n / 2 if zero >= 2 else 2 * n)
        assert m.params == (2 * n / 2 + 20 * MIB if zero >= 3 else 2 * n)


def test_zero3_gathers_nothing_for_units_no_other_rank_holds() -> None:
    """One pipeline at ZeRO-3: no unit has another holder, nothing is sharded or gathered: the whole bf16 states."""
    s = Strategy.load({"pipelines": [{"stages": [{"devices": [0], "layers": [0, 1]},
                                                 {"devices": [1], "layers": [2, 3]}],
                                      "micro_batch_size": 1, "num_micro_batches": 2}], "zero": 3})
    got = device_memory(s, BIG)
    assert (got[0].params, got[0].grads, got[0].optimizer) == (2 * 5 * 2**20, 2 * 5 * 2**20, 12 * 5 * 2**20)
    assert (got[1].params, got[1].grads, got[1].optimizer) == (2 * 2.5 * 2**20, 2 * 2.5 * 2**20, 12 * 2.5 * 2**20)


def test_zero3_gathers_only_the_units_sharded_over_a_stage_s_replicas() -> None:
    """Pipeline 0 holds layers 0-1 (+ embedding) on rank 0 and 2-3 (+ head) on rank 1; pipeline 1 all of them on
    rank 2.  Each unit has two holders: rank 0 shards 5 * 2**20 parameters (10 MiB, largest 6 MiB: one unit of
    10 MiB), rank 1 2.5 * 2**20 (5 MiB: one unit), rank 2 all 15 MiB (two units of 10 MiB)."""
    s = Strategy.load({"pipelines": [
        {"stages": [{"devices": [0], "layers": [0, 1]}, {"devices": [1], "layers": [2, 3]}],
         "micro_batch_size": 1, "num_micro_batches": 2},
        {"stages": [{"devices": [2], "layers": [0, 3]}], "micro_batch_size": 1, "num_micro_batches": 2}],
        "zero": 3, "schedule": "gpipe"})
    got = device_memory(s, BIG)
    assert got[0].params == 2 * 5 * 2**20 / 2 + 10 * MIB
    assert got[1].params == 2 * 2.5 * 2**20 / 2 + 5 * MIB
    assert got[2].params == 2 * 7.5 * 2**20 / 2 + 20 * MIB
    assert got[2].grads == 2 * 7.5 * 2**20 / 2 and got[2].optimizer == 12 * 7.5 * 2**20 / 2
