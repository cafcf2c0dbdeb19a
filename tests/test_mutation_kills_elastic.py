"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of planner/elastic.py.

Clusters, strategies and cost models small enough that every expected value is written out by hand: the ranks a
survivor cluster keeps and their new numbers, the device kinds and scaled figures of a slowed cluster, the ratios
an uneven stage passes on.
"""
from __future__ import annotations


import pytest

from hspmd_sdk.core.cluster import Cluster, DeviceSpec
from hspmd_sdk.core.strategy import Strategy
from hspmd_sdk.planner.cost import ComputeFit, CostModel, OperatorProfile
from hspmd_sdk.planner.elastic import renumber, slowed_cluster, survivor_cluster

pytest.importorskip("pulp")
pytest.importorskip("pyomo")


def _cluster() -> Cluster:
    return Cluster.load({"nodes": [{"host": "a", "kind": "H20", "ranks": [0, 1]},
                                   {"host": "b", "kind": "H20", "ranks": [2, 3]},
                                   {"host": "c", "kind": "H20", "ranks": [4]}]})


# ---- survivor_cluster and renumber ------------------------------------------------------------------------------
def test_survivor_cluster_renumbers_in_order_and_drops_empty_nodes() -> None:
    """Ranks 1, 2 and 3 lost: node b is gone, node a keeps 0, node c's 4 becomes 1; host and kind kept."""
    c, mapping = survivor_cluster(_cluster(), [1, 2, 3])
    assert mapping == {0: 0, 4: 1}
    assert [(n.host, n.kind, n.ranks) for n in c.nodes] == [("a", "H20", [0]), ("c", "H20", [1])]
    assert c.inter_bandwidth_gbs == _cluster().inter_bandwidth_gbs


def test_survivor_cluster_without_failures_is_the_same_cluster() -> None:
    """Nothing lost: every rank keeps its number."""
    c, mapping = survivor_cluster(_cluster(), [])
    assert mapping == {r: r for r in range(5)}
    assert [n.ranks for n in c.nodes] == [[0, 1], [2, 3], [4]]


def test_renumber_replaces_every_rank() -> None:
    """Each stage's devices mapped, in order."""
    s = Strategy.load({"pipelines": [{"stages": [{"devices": [4, 2], "layers": [0, 1]},
                                                 {"devices": [0], "layers": [2, 3]}],
                                      "micro_batch_size": 1, "num_micro_batches": 2}]})
    got = renumber(s, {4: 0, 2: 1, 0: 2})
    assert [st.devices for st in got.pipelines[0].stages] == [[0, 1], [2]]


# ---- slowed_cluster ---------------------------------------------------------------------------------------------
def _profile() -> OperatorProfile:
    def fit(a: float, b: float) -> ComputeFit:
        return ComputeFit(a=a, b=b)

    return OperatorProfile(layer_fwd=fit(1.0, 2.0), layer_bwd=fit(3.0, 4.0), head_fwd=fit(5.0, 6.0),
                           head_bwd=fit(7.0, 8.0), embed=fit(9.0, 10.0), optimizer_s_per_param=0.5)


def test_slowed_cluster_moves_each_slow_rank_to_a_node_of_a_scaled_kind() -> None:
    """Rank 1 at 2x and rank 4 at 1.5x: each on its own node on the same host, of kind ``H20/2`` and ``H20/1.5``
    whose peak FLOPS are divided by the factor (memory and intra bandwidth kept); the other ranks keep their
    nodes (node c, emptied, is gone); the moved nodes come after the others, in the order met."""
    base = _cluster()
    c, cost = slowed_cluster(base, {4: 1.5, 1: 2.0})
    assert [(n.host, n.kind, n.ranks) for n in c.nodes] == [
        ("a", "H20", [0]), ("b", "H20", [2, 3]), ("a", "H20/2", [1]), ("c", "H20/1.5", [4])]
    h20 = base.devices["H20"]
    for kind, k in (("H20/2", 2.0), ("H20/1.5", 1.5)):
        d = c.devices[kind]
        assert d == DeviceSpec(kind=kind, memory_mb=h20.memory_mb, bf16_tflops=h20.bf16_tflops / k,
                               intra_bandwidth_gbs=h20.intra_bandwidth_gbs)
    assert c.devices["H20"] == h20
    assert cost == CostModel()  # nothing profiled: nothing to scale


def test_slowed_cluster_names_the_kind_with_three_significant_digits() -> None:
    """A factor of 1.23456 makes kind ``H20/1.23``."""
    c, _ = slowed_cluster(_cluster(), {0: 1.23456})
    assert c.kind(0) == "H20/1.23"


def test_slowed_cluster_scales_the_profiled_costs_of_the_kind() -> None:
    """Every compute line of the profile (both coefficients), the compute fit and Adam's seconds per parameter
    are k times longer under the new kind; the MFU is copied; the original kind's figures are unchanged; another
    kind's are not copied."""
    prof = _profile()
    cost = CostModel(profiles={"H20": prof, "A100": prof}, compute_fits={"H20": ComputeFit(a=1.0, b=2.0)},
                     mfu={"H20": 0.3, "A100": 0.9})
    _, got = slowed_cluster(_cluster(), {3: 2.0}, cost)
    new = got.profiles["H20/2"]
    for name, (a, b) in {"layer_fwd": (1, 2), "layer_bwd": (3, 4), "head_fwd": (5, 6), "head_bwd": (7, 8),
                         "embed": (9, 10)}.items():
        line = getattr(new, name)
        assert (line.a, line.b) == (2.0 * a, 2.0 * b), name
    assert new.optimizer_s_per_param == 1.0
    assert (got.compute_fits["H20/2"].a, got.compute_fits["H20/2"].b) == (2.0, 4.0)
    assert got.mfu["H20/2"] == 0.3
    assert got.profiles["H20"] == prof and got.compute_fits["H20"].a == 1.0
    assert set(got.profiles) == {"H20", "A100", "H20/2"} and set(got.mfu) == {"H20", "A100", "H20/2"}
    assert cost.profiles.keys() == {"H20", "A100"}  # the caller's model is not changed


def test_slowed_cluster_without_profiles_or_mfu_adds_none() -> None:
    """A kind with only a compute fit: the fit is scaled, no profile or MFU appears."""
    cost = CostModel(compute_fits={"H20": ComputeFit(a=1.0, b=2.0)})
    _, got = slowed_cluster(_cluster(), {0: 3.0}, cost)
    assert (got.compute_fits["H20/3"].a, got.compute_fits["H20/3"].b) == (3.0, 6.0)
    assert "H20/3" not in got.profiles and "H20/3" not in got.mfu


# ---- replan_elastic and replan_straggler: names, errors --------------------------------------------------------
C1 = {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 8, "stages": [
    {"devices": [0, 1], "layers": [0, 15]}, {"devices": [2, 3], "layers": [16, 31]}]}]}


def test_replan_elastic_names_the_plan_after_the_loss() -> None:
    """The default name says the model, the survivors and the ranks lost (sorted); a given name is kept."""
    from hspmd_sdk.planner.elastic import replan_elastic

    c = Cluster.homogeneous("H20", 4)
    got = replan_elastic("llama-7b", c, C1, [3], seq_len=2048, simulate_top=1, refine=False)
    assert got.name == "replan_elastic: llama-7b on 3 devices (lost [3])"
    assert got.ranks == [0, 1, 2]
    mine = replan_elastic("llama-7b", c, C1, (3,), seq_len=2048, simulate_top=1, refine=False, name="mine")
    assert mine.name == "mine"


def test_replan_elastic_without_a_candidate_says_so() -> None:
    """More pipelines asked for than three survivors of a one-pipeline plan can hold: the error names the model
    and the number of survivors, under ``invalid elastic plan``."""
    from hspmd_sdk.errors import PlanValidationError
    from hspmd_sdk.planner.elastic import replan_elastic

    with pytest.raises(PlanValidationError) as e:
        replan_elastic("llama-7b", Cluster.homogeneous("H20", 4), C1, [3], seq_len=2048, min_pipelines=5)
    assert str(e.value) == "invalid elastic plan: failed: no strategy for llama-7b fits the 3 surviving devices"


def test_replan_straggler_names_each_slow_rank_with_its_factor() -> None:
    """``replan_straggler: <model>, ranks <r> x<factor>, ...`` in the order given, factors to two decimals; no rank
    is dropped."""
    from hspmd_sdk.planner.elastic import replan_straggler

    got = replan_straggler("llama-7b", Cluster.homogeneous("H20", 4), C1, {2: 2.0, 0: 1.5}, seq_len=2048)
    assert got.name == "replan_straggler: llama-7b, ranks 2 x2.00, 0 x1.50"
    assert got.ranks == [0, 1, 2, 3]



def test_replan_straggler_gives_a_slow_replica_fewer_micro_batches() -> None:
    """Two TP2 replicas of 8 micro-batches each, the second running 3x slower: the 16 micro-batches are split so
    that both finish together, 12 : 4 (12 x 1 = 4 x 3); the templates (devices, layers) are kept."""
    from hspmd_sdk.planner.elastic import replan_straggler

    one = {"micro_batch_size": 1, "num_micro_batches": 8}
    dp2 = {"pipelines": [{**one, "stages": [{"devices": [0, 1], "layers": [0, 31]}]},
                         {**one, "stages": [{"devices": [2, 3], "layers": [0, 31]}]}]}
    got = replan_straggler("llama-7b", Cluster.homogeneous("H20", 4), dp2, {2: 3.0, 3: 3.0}, seq_len=2048)
    assert [(p.micro_batch_size, p.num_micro_batches) for p in got.pipelines] == [(1, 12), (1, 4)]
    assert [[s.devices for s in p.stages] for p in got.pipelines] == [[[0, 1]], [[2, 3]]]


def test_replan_straggler_checks_the_strategy_against_the_cluster() -> None:
    """A running strategy on a rank the cluster lacks (rank 9 of 4) is refused up front, naming the rank."""
    from hspmd_sdk.errors import PlanValidationError
    from hspmd_sdk.planner.elastic import replan_straggler

    bad = {"pipelines": [{"micro_batch_size": 1, "num_micro_batches": 8, "stages": [
        {"devices": [0, 1], "layers": [0, 15]}, {"devices": [2, 9], "layers": [16, 31]}]}]}
    with pytest.raises(PlanValidationError, match="9"):
        replan_straggler("llama-7b", Cluster.homogeneous("H20", 4), bad, {2: 2.0}, seq_len=2048)
