"""replan_elastic (scenario (b)): after failures, a strategy on every surviving device, simulated no slower than
the paper's Table 11 strategies."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk import LlamaConfig
from hspmd_sdk.core.strategy import Strategy
from hspmd_sdk.planner import replan_elastic, simulate, survivor_cluster
from hspmd_sdk.planner.elastic import renumber

pytest.importorskip("pulp")
pytest.importorskip("pyomo")

EXAMPLES = Path(__file__).resolve().parent.parent / "hspmd_sdk" / "examples"
MODEL = LlamaConfig.preset("llama-32b")


@pytest.fixture(scope="module")
def c1() -> tuple[Cluster, Strategy]:
    return Cluster.load(EXAMPLES / "h20_32.json"), Strategy.load(EXAMPLES / "table11_c1.json")


def _sim(strategy: Strategy | Path, cluster: Cluster) -> float:
    res = simulate(MODEL, strategy, cluster, global_batch=64, seq_len=4096)
    assert not res.oom
    return res.step_time


def test_one_gpu_lost_uses_31_and_matches_c2(c1: tuple[Cluster, Strategy]) -> None:
    cluster, strategy = c1
    t0 = time.perf_counter()
    new = replan_elastic(MODEL, cluster, strategy, [31], seq_len=4096)
    assert time.perf_counter() - t0 < 10
    new.check(model=MODEL, cluster=cluster, global_batch=64)
    assert new.ranks == list(range(31))
    assert new.dp_degree >= 2 and not new.zero1  # still a replica for the next failure
    paper = _sim(EXAMPLES / "table11_c2.json", Cluster.load(EXAMPLES / "h20_31.json"))
    assert _sim(new, cluster) <= paper
    # heterogeneous TP groups, as in the paper's C2
    assert {s.tp_degree for p in new.pipelines for s in p.stages} >= {4, 2, 1}


def test_node_lost_uses_the_remaining_24(c1: tuple[Cluster, Strategy]) -> None:
    cluster, strategy = c1
    new = replan_elastic(MODEL, cluster, strategy, range(24, 32), seq_len=4096)
    new.check(model=MODEL, cluster=cluster, global_batch=64)
    assert new.ranks == list(range(24))
    paper = _sim(EXAMPLES / "table11_c3.json", Cluster.load(EXAMPLES / "h20_24.json"))
    assert _sim(new, cluster) <= paper * 1.0 + 1e-9


def test_a_middle_rank_lost_and_renumbered(c1: tuple[Cluster, Strategy]) -> None:
    cluster, strategy = c1
    new = replan_elastic(MODEL, cluster, strategy, [5], seq_len=4096)
    assert 5 not in new.ranks and len(new.ranks) == 31
    compact, mapping = survivor_cluster(cluster, [5])
    assert compact.num_ranks == 31 and mapping[6] == 5 and mapping[31] == 30
    moved = renumber(new, mapping)
    moved.check(model=MODEL, cluster=compact, global_batch=64)
    assert _sim(moved, compact) == pytest.approx(_sim(new, cluster), rel=1e-9)


def test_failed_rank_outside_the_cluster_is_an_error(c1: tuple[Cluster, Strategy]) -> None:
    cluster, strategy = c1
    with pytest.raises(IndexError):
        replan_elastic(MODEL, cluster, strategy, [40], seq_len=4096)


def test_cli_plan_elastic_and_simulate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from hspmd_sdk.cli.plan import (add_plan_arguments, add_simulate_arguments, parse_ranks, run_plan,
                                       run_simulate)

    assert parse_ranks("5,7,24-26") == [5, 7, 24, 25, 26]
    out = tmp_path / "c3.json"
    p = argparse.ArgumentParser()
    add_plan_arguments(p)
    assert run_plan(p.parse_args(["--cluster", "h20_32", "--model", "llama-32b", "--scenario", "elastic",
                                  "--strategy", "table11_c1", "--failed", "24-31", "-o", str(out)])) == 0
    new = Strategy.load(out, model=MODEL, cluster=Cluster.load(EXAMPLES / "h20_24.json"), global_batch=64)
    assert new.ranks == list(range(24))
    s = argparse.ArgumentParser()
    add_simulate_arguments(s)
    assert run_simulate(s.parse_args([str(out), "--model", "llama-32b", "--cluster", "h20_24",
                                      "--global-batch", "64", "--seq-len", "4096"])) == 0
    assert "step" in capsys.readouterr().out
