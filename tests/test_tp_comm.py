"""The cost model's TP communication is the specialized Program's own (planner/tp_comm.py, issue 23 item 4).

Each check compares the cost model with a Program specialized independently here, of another shape than the one
``unit_collectives`` reads (more layers, one stage, another micro-batch and sequence length): the bytes every
rank sends in the Program's ring collectives, and the seconds of a layer's collectives.
"""
from __future__ import annotations

import pytest

from hspmd_sdk import Cluster, GPTConfig, LlamaConfig, specialize
from hspmd_sdk.core.cluster import Link
from hspmd_sdk.core.comm_ops import CollectiveOp, OpKind, SplitCollectiveOp
from hspmd_sdk.core.strategy import Pipeline, Stage, Strategy
from hspmd_sdk.core.strategy_plan import plan_from_strategy
from hspmd_sdk.planner.cost import BF16, CostModel, embedding_cost, head_cost, layer_cost
from hspmd_sdk.planner.tp_comm import Collective, TPCommError, unit_collectives

LLAMA, GPT = LlamaConfig.preset("tiny"), GPTConfig.preset("tiny")
B, S = 2, 24
LINK = Link("intra", 1e9, 1e-5)


def _program(model, tp: int, layers: int = 5, ratios: list[int] | None = None):
    m = model.model_copy(update={"num_layers": layers})
    st = Strategy(pipelines=[Pipeline(stages=[Stage(devices=list(range(tp)), layers=[0, layers - 1], ratios=ratios)],
                                      micro_batch_size=B, num_micro_batches=1)])
    cl = Cluster.local(tp)
    return m, specialize(m, plan_from_strategy(m, st, cl), cl, bindings={"B": B, "S": S})


_RING_OF = {OpKind.SPLIT_ALL_REDUCE: OpKind.ALL_REDUCE, OpKind.SPLIT_ALL_GATHER: OpKind.ALL_GATHER,
            OpKind.SPLIT_REDUCE_SCATTER: OpKind.REDUCE_SCATTER}


def _sent(plans) -> dict[OpKind, float]:
    """Bytes every rank together sends in the collectives of ``plans``, by (ring) kind, from the operators' own
    transfers (an uneven group's split collectives: slice by slice)."""
    out: dict[OpKind, float] = {}
    for plan in plans:
        for op in plan.ops:
            if isinstance(op, (CollectiveOp, SplitCollectiveOp)):
                sent = sum(n for src, dst, n, _ in op.transfers() if src != dst)
                if sent:
                    kind = _RING_OF.get(op.kind, op.kind)
                    out[kind] = out.get(kind, 0) + sent
    return out


def _expected(units, tokens: float, itemsize: int, layers: int, phase: str) -> dict[OpKind, float]:
    out: dict[OpKind, float] = {}
    for unit, times in (("embedding", 1), ("layer", layers), ("head", 1)):
        for c in getattr(units, f"{unit}_{phase}"):
            each = c.kind.ring(c.members, c.per_token * tokens * itemsize)[0]
            out[c.kind] = out.get(c.kind, 0) + times * c.members * each
    return out


@pytest.mark.parametrize("model", [LLAMA, GPT], ids=["llama", "gpt"])
@pytest.mark.parametrize("tp,ratios", [(2, None), (4, None), (3, [2, 1, 1])], ids=["tp2", "tp4", "tp3-2:1:1"])
def test_units_add_up_to_every_byte_a_whole_program_sends(model, tp: int, ratios) -> None:
    """Uneven (HAP, SPEC §12) too: 4 heads split 2:1:1 over three ranks, which an even TP3 cannot."""
    m, prog = _program(model, tp, ratios=ratios)
    units = unit_collectives(model, tp, ratios)
    itemsize = next(op.itemsize for p in prog.comm_plans.values() for op in p.ops
                    if isinstance(op, (CollectiveOp, SplitCollectiveOp)))
    fwd = _sent(prog.comm_plans.values())
    bwd = _sent(list(prog.backward_plans.values()) + list(prog.grad_reduce_plans.values()))
    assert fwd and bwd
    for got, phase in ((fwd, "fwd"), (bwd, "bwd")):
        want = _expected(units, B * S, itemsize, m.num_layers, phase)
        assert got.keys() == want.keys()
        for k in got:
            assert got[k] == pytest.approx(want[k], rel=1e-9), (phase, k)


def test_llama_and_gpt_units_are_megatrons_and_differ_at_the_head() -> None:
    h, v = LLAMA.hidden_size, LLAMA.vocab_size
    ar, ag = OpKind.ALL_REDUCE, OpKind.ALL_GATHER
    lu = unit_collectives(LLAMA, 2)
    assert lu.layer_fwd == lu.layer_bwd == (Collective(ar, 2, h),) * 2
    assert lu.embedding_fwd == (Collective(ag, 2, h),) and lu.embedding_bwd == ()
    assert lu.head_fwd == (Collective(ag, 2, v),) and lu.head_bwd == (Collective(ar, 2, h),)
    gu = unit_collectives(GPT, 2)
    assert gu.layer_fwd == gu.layer_bwd == (Collective(ar, 2, GPT.hidden_size),) * 2
    # GPT's head is tied to the vocab-split embedding: Partial logits, all-reduced; its input's gradient gathered
    assert gu.head_fwd == (Collective(ar, 2, GPT.vocab_size),)
    assert gu.head_bwd == (Collective(ag, 2, GPT.hidden_size),)
    assert unit_collectives(LLAMA, 1).layer_fwd == ()


@pytest.mark.parametrize("model", [LLAMA, GPT], ids=["llama", "gpt"])
def test_the_cost_model_prices_a_programs_own_collectives(model) -> None:
    """A layer's, the embedding's and the head's communication seconds equal the CostModel's price of the
    collectives a 5-layer TP2 Program runs for layer 2's Reshards, the embedding's and the head's."""
    cost = CostModel(collective_efficiency=0.7)
    m, prog = _program(model, 2)
    spec = Cluster.local(1).spec(0)

    def price(names, plans) -> float:
        total = 0.0
        for name in names:
            for op in plans[name].ops:
                if isinstance(op, CollectiveOp) and len(op.groups[0].ranks) > 1:
                    g = op.groups[0]
                    numel = 1
                    for lo, hi in g.in_boxes[0]:
                        numel *= hi - lo
                    whole = numel * (len(g.ranks) if op.kind is OpKind.ALL_GATHER else 1)
                    total += cost.collective_time(op.kind, whole * BF16, len(g.ranks), LINK)
        return total

    layer = [n for n in prog.comm_plans if n.startswith("layers.2.")]
    layer_b = [n for n in prog.grad_reduce_plans if n.startswith("layers.2.")]
    assert sum(price([n], prog.comm_plans) > 0 for n in layer) == 2  # attn.out and mlp.out
    assert sum(price([n], prog.grad_reduce_plans) > 0 for n in layer_b) == 2
    lc = layer_cost(m, spec, 2, LINK, B, S, cost)
    assert lc.fwd_comm == pytest.approx(price(layer, prog.comm_plans), rel=1e-12)
    assert lc.bwd_comm == pytest.approx(price(layer_b, prog.grad_reduce_plans), rel=1e-12)
    rc = layer_cost(m, spec, 2, LINK, B, S, cost, recompute=True)
    assert rc.bwd_comm == pytest.approx(lc.bwd_comm + lc.fwd_comm, rel=1e-12)  # the recomputed forward's again
    assert embedding_cost(m, spec, 2, LINK, B, S, cost).fwd_comm == pytest.approx(price(["embed.out"],
                                                                                         prog.comm_plans))
    head = [n for n in prog.comm_plans if not n.startswith(("layers.", "embed"))]
    head_b = [n for n in list(prog.backward_plans) if not n.startswith(("layers.", "embed"))]
    hc = head_cost(m, spec, 2, LINK, B, S, cost)
    assert hc.fwd_comm == pytest.approx(price(head, prog.comm_plans), rel=1e-12)
    grads = {**prog.backward_plans, **{k: v for k, v in prog.grad_reduce_plans.items() if not k.startswith("layers.")}}
    assert hc.bwd_comm == pytest.approx(price([n for n in grads if not n.startswith(("layers.", "embed"))], grads),
                                        rel=1e-12)
    assert hc.fwd_comm > 0 and hc.bwd_comm > 0


def test_an_uneven_three_way_stage_is_priced_and_simulated() -> None:
    """4 heads cannot split evenly three ways, but 2:1:1 can: the simulator prices that stage's own collectives
    (all-reduces of the whole hidden state over 3 ranks) instead of failing on an even TP3."""
    from hspmd_sdk.planner import simulate

    h = LLAMA.hidden_size
    u = unit_collectives(LLAMA, 3, [2, 1, 1])
    assert u.layer_fwd == (Collective(OpKind.ALL_REDUCE, 3, h),) * 2
    assert u.embedding_fwd == (Collective(OpKind.ALL_GATHER, 3, h),)  # the gathered whole, from uneven parts
    st = Strategy(pipelines=[Pipeline(stages=[Stage(devices=[0, 1, 2], layers=[0, 3], ratios=[2, 1, 1])],
                                      micro_batch_size=2, num_micro_batches=1)])
    r = simulate(LLAMA, st, Cluster.local(3), seq_len=16)
    assert r.step_time > 0 and not r.oom


def test_a_fractional_degree_has_no_collectives_and_a_bad_degree_names_the_model() -> None:
    spec = Cluster.local(1).spec(0)
    assert layer_cost(LLAMA, spec, 4 / 3, LINK, B, S, CostModel()).fwd_comm == 0.0  # an uneven share: the group's
    assert layer_cost(LLAMA, spec, 2.0, LINK, B, S, CostModel()).fwd_comm > 0.0  # a whole degree as a float
    with pytest.raises(TPCommError, match=r"'tiny' at tp=3"):
        unit_collectives(LLAMA, 3)  # 4 heads cannot split 3 ways
