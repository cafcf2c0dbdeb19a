"""Packed micro-batches (SPEC §7): several sequences back to back in one row, kept apart by the kernels.

A packed row run through either family's graph gives, token for token, the logits and the gradients of the
sequences run one by one (attention within each sequence, RoPE / learned positions restarting at each); a graph
with an op that declares no packing rule is refused packing; the dispatcher's packed micro-batches hold every
sequence once, within the window, without padding, priced with attention per sequence.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hspmd_sdk import Cluster, GPTConfig, LlamaConfig
from hspmd_sdk.planner import Dispatcher
from hspmd_sdk.planner.cost import ComputeFit, CostModel
from hspmd_sdk.planner.mixed import MixedEntry, MixedPlan
from hspmd_sdk.core.strategy import Strategy
from hspmd_sdk.runtime.workers.kernels import attention, document_positions, packing_problems, register_kernel, run_graph
from hspmd_sdk.runtime.workers.mixed_worker import micro_batch_feeds

sys.path.insert(0, str(Path(__file__).resolve().parent))
from user_model import MLPLM  # noqa: E402

LENGTHS = (5, 9, 9, 1, 3)  # two of equal length, a one-token sequence


def _models() -> list:
    return [LlamaConfig(name="t", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                        ffn_hidden_size=64, max_seq_len=64),
            GPTConfig(name="g", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64,
                      max_seq_len=64)]


@pytest.mark.parametrize("model", _models(), ids=lambda m: m.family)
def test_a_packed_row_computes_each_sequence_as_on_its_own(model) -> None:
    g = model.build_graph()
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, model.vocab_size, n + 1) for n in LENGTHS]
    params = {n: model.init_parameter(n, s, 0).requires_grad_(True) for n, s in model.param_shapes().items()}
    alone = [run_graph(g, micro_batch_feeds(model, g, [q]), params) for q in seqs]
    feeds = micro_batch_feeds(model, g, seqs, packed=True)
    assert tuple(feeds["tokens"].shape) == (1, sum(LENGTHS))
    packed = run_graph(g, feeds, params, documents=LENGTHS)
    logits = torch.cat([a["logits"] for a in alone], dim=1)
    assert float((packed["logits"] - logits).abs().max().detach()) < 1e-5
    # the gradients of the summed token losses: packed vs one by one
    total = sum(LENGTHS)
    loss_packed = packed[g.loss] * total  # the graph's loss is the mean over the row's targets
    grads_p = torch.autograd.grad(loss_packed, list(params.values()))
    loss_alone = sum(a[g.loss] * n for a, n in zip(alone, LENGTHS))
    grads_a = torch.autograd.grad(loss_alone, list(params.values()))
    scale = max(float(x.abs().max()) for x in grads_a)
    assert max(float((x - y).abs().max()) for x, y in zip(grads_p, grads_a)) < 1e-5 * scale
    # without the documents the same row is one long sequence: the sequences see each other
    mixed = run_graph(g, feeds, params)
    assert float((mixed["logits"] - logits).abs().max().detach()) > 1e-3


def test_positions_restart_at_each_document_and_bad_rows_are_named() -> None:
    assert document_positions((3, 2, 4), 0, 9).tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert document_positions((3, 2, 4), 4, 3).tolist() == [1, 0, 1]  # a shard of the row
    with pytest.raises(ValueError, match="packed row of 9 tokens"):
        document_positions((3, 2, 4), 8, 3)
    q = torch.zeros(1, 7, 2, 4)
    with pytest.raises(ValueError, match=r"documents \[3, 2\].*split across devices"):
        attention(q, q, q, documents=(3, 2))
    with pytest.raises(ValueError, match="packing="):
        register_kernel("whatever_op", lambda x: x, packing="sometimes")


def test_a_graph_with_an_op_without_a_packing_rule_is_refused_packing() -> None:
    for model in _models():
        assert packing_problems(model.build_graph()) == []
    user = MLPLM()
    problems = packing_problems(user.build_graph())
    assert len(problems) == 1 and "'square_relu'" in problems[0]
    g = user.build_graph()
    feeds = micro_batch_feeds(user, g, [np.arange(4), np.arange(6)], packed=True)
    params = {n: user.init_parameter(n, s, 0) for n, s in user.param_shapes().items()}
    with pytest.raises(ValueError, match="square_relu"):
        run_graph(g, feeds, params, documents=(3, 5))
    # tokenwise kinds that work along the sequence dim would mix a row's documents: named, per node
    from types import SimpleNamespace as NS

    from hspmd_sdk.core.symbolic import sym

    x = NS(shape=(sym("B"), sym("S"), 8))
    graph = NS(nodes=[NS(kind="split", name="halves", inputs=["x"], attr={"dim": 1, "parts": 2}),
                      NS(kind="sum", name="pool", inputs=["x"], attr={"dims": (2,)})], tensors={"x": x})
    problems = packing_problems(graph)
    assert len(problems) == 1 and "'halves'" in problems[0] and "sequence dim" in problems[0]


def _entry(windows: list[int], cap: int) -> MixedEntry:
    return MixedEntry(max_seq_len=cap, windows=windows, strategy=Strategy.load({"pipelines": [
        {"stages": [{"devices": [r], "layers": [0, 1]}], "micro_batch_size": 1, "num_micro_batches": 1}
        for r in range(len(windows))], "name": f"dp{len(windows)}"}))


def test_packed_dispatch_trains_every_sequence_once_within_the_window_without_padding() -> None:
    model = _models()[0]
    cluster = Cluster.local(2)
    plan = MixedPlan(context_len=64, tokens_per_batch=512, entries=[_entry([64, 64], 64)])
    # a fixed cost per operator call (as on a real device): fewer, fuller micro-batches pay off
    cost = CostModel(comm_scale=0.0, compute_fits={"cpu": ComputeFit(a=1e-11, b=2e-5)})
    rng = np.random.default_rng(1)
    lengths = [int(x) for x in np.clip(np.exp(rng.normal(np.log(8), 0.9, 60)), 1, 64)]
    packed = Dispatcher(plan, model, cluster, cost=cost, packing=True)(lengths)
    padded = Dispatcher(plan, model, cluster, cost=cost)(lengths)
    got = sorted(i for pipe in packed.micro_batches for mb in pipe for i in mb)
    assert got == list(range(len(lengths)))
    assert packed.padding_fraction() == 0.0 and padded.padding_fraction() > 0.0
    for pipe, shapes, cshapes in zip(packed.micro_batches, packed.shapes(), packed.cost_shapes()):
        for mb, (rows, tokens), (_, t, sq) in zip(pipe, shapes, cshapes):
            assert rows == 1 and tokens == t == sum(lengths[i] for i in mb) <= 64
            assert sq == sum(lengths[i] ** 2 for i in mb)
    assert max(len(mb) for pipe in packed.micro_batches for mb in pipe) > 1  # sequences do share rows
    # fewer, fuller micro-batches and per-sequence attention: the estimate is below the padded one
    assert packed.estimate < padded.estimate


def test_packed_rows_and_a_plan_priced_for_packing() -> None:
    from hspmd_sdk.planner import plan_mixed
    from hspmd_sdk.planner.mixed import packed_rows

    lengths = [5, 60, 3, 33, 31, 64, 2, 2]
    rows = packed_rows(lengths, 64)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 64 for r in rows) and len(rows) < len(lengths)
    with pytest.raises(ValueError, match="does not fit"):
        packed_rows([65], 64)
    model = LlamaConfig.preset("llama-7b")
    cluster = Cluster.mixed({"H800": 8, "H20": 8})
    sample = [int(x) for x in np.clip(np.exp(np.random.default_rng(0).normal(np.log(600), 1.1, 800)), 16, 8192)]
    padded = plan_mixed(model, cluster, sample, tokens_per_batch=65536, context_len=8192)
    packed = plan_mixed(model, cluster, sample, tokens_per_batch=65536, context_len=8192, packing=True)
    assert packed.entries[-1].max_seq_len == 8192 and len(packed.entries) == len(padded.entries)
    # the same DP over a superset of micro-batch forms: never a worse estimate for the longest candidate
    assert packed.entries[-1].estimate <= padded.entries[-1].estimate * 1.02
