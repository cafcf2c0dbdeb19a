"""Kills for the mutants of hspmd_sdk/core/comm_plan.py (issue 49): bytes per rank and link class, the sequential
time model, the unit choice, the volume table's layout and the CommPlan's text, simulation and errors, on
hand-made operators with known transfers."""
from __future__ import annotations

import pytest

from hspmd_sdk import Cluster
from hspmd_sdk.core.annotation import Annotation
from hspmd_sdk.core.comm_plan import CommPlan, pick_unit, time_of, volume_by_rank, volume_table

# ranks 0,1 on node 0 and 2,3 on node 1: intra 5 GB/s (cpu preset) and 1 us, inter 2 GB/s and 5 us
CL = Cluster.homogeneous("cpu", 4, per_node=2, inter_bandwidth_gbs=2, inter_latency_us=5, intra_latency_us=1)


class Op:
    """A stand-in operator: its kind, transfers, a text description, and an apply() that adds ``add``."""

    def __init__(self, kind, transfers=(), desc=("x",), add=None) -> None:
        self.kind, self._t, self._d, self.add = kind, list(transfers), list(desc), add or {}

    def transfers(self):
        return list(self._t)

    def describe(self):
        return list(self._d)

    def apply(self, state):
        return {r: state[s] + v for r, (s, v) in self.add.items()}


def _plan(ops, src="[0,1] S0x2", dst="[2,3] S0x2", cluster=None) -> CommPlan:
    return CommPlan(Annotation.parse(src), Annotation.parse(dst), (4, 2), "float32", 4, tuple(ops), cluster)


# ---- volume_by_rank ------------------------------------------------------------------------------------------
def test_volume_by_rank_splits_intra_and_inter_and_skips_self() -> None:
    """Bytes a rank sends add up per link class; a rank's message to itself counts nothing; listed ranks get
    zeros; the result is sorted by rank."""
    t = [(3, 2, 10, 1), (0, 1, 5, 1), (0, 2, 7, 1), (0, 3, 1, 0), (1, 1, 99, 1), (2, 0, 4, 2)]
    out = volume_by_rank(t, CL, ranks=[1, 5])
    assert out == {0: {"intra": 5, "inter": 8}, 1: {"intra": 0, "inter": 0}, 2: {"intra": 0, "inter": 4},
                   3: {"intra": 10, "inter": 0}, 5: {"intra": 0, "inter": 0}}
    assert list(out) == [0, 1, 2, 3, 5]
    # no cluster: everything is intra-node
    assert volume_by_rank(t, None) == {0: {"intra": 13, "inter": 0}, 2: {"intra": 4, "inter": 0},
                                       3: {"intra": 10, "inter": 0}}
    assert volume_by_rank([], None) == {}


def test_volume_by_rank_host_links_are_intra() -> None:
    """Two nodes of one host with a host bandwidth: their link counts as intra-node."""
    boxed = Cluster.load({"nodes": [{"host": "h", "kind": "cpu", "ranks": [0]},
                                    {"host": "h", "kind": "cpu", "ranks": [1]}], "host_bandwidth_gbs": 64})
    assert volume_by_rank([(0, 1, 3, 1)], boxed) == {0: {"intra": 3, "inter": 0}}


# ---- time_of -------------------------------------------------------------------------------------------------
def test_time_of_sums_operators_each_as_slow_as_its_slowest_sender() -> None:
    """Per sender: bytes / bandwidth + steps * latency summed; per op the max; ops add up."""
    op1 = [(0, 1, 5_000_000_000, 2),  # intra: 1 s + 2 us
           (0, 2, 2_000_000_000, 1),  # inter: 1 s + 5 us
           (1, 3, 4_000_000_000, 3),  # inter: 2 s + 15 us -> rank 1 is the slowest: 2.000015
           (0, 3, 0, 1000),           # no bytes: no time (else rank 0 would take 2.005007)
           (2, 2, 10**12, 7)]         # a local copy: no time
    op2: list = []                    # nothing: 0
    op3 = [(1, 0, 1_000_000_000, 1)]  # intra: 0.2 s + 1 us
    assert time_of([op1], CL) == pytest.approx(2.000015, rel=1e-12, abs=0)
    assert time_of([op2], CL) == 0.0
    assert time_of([op1, op2, op3], CL) == pytest.approx(2.000015 + 0.200001, rel=1e-12, abs=0)
    assert time_of([], CL) == 0.0
    # the slowest is rank 0 when its two messages add up to more than rank 1's one
    assert time_of([[(0, 1, 5_000_000_000, 0), (0, 2, 2_000_000_000, 0), (1, 3, 3_000_000_000, 0)]], CL) == \
        pytest.approx(2.0, rel=1e-12, abs=0)


def test_time_of_looks_up_no_link_for_a_local_copy() -> None:
    """A rank's copy to itself is skipped before the cluster is asked (a rank the cluster lacks is fine)."""
    assert time_of([[(9, 9, 100, 1), (0, 1, 5_000_000_000, 0)]], CL) == pytest.approx(1.0, rel=1e-12, abs=0)


# ---- pick_unit / volume_table --------------------------------------------------------------------------------
def test_pick_unit_megabytes_from_one_megabyte() -> None:
    """MB when some rank sends >= 1e6 bytes (intra or inter), else bytes."""
    assert pick_unit({0: {"intra": 999_999, "inter": 0}}) == ("B", 1.0)
    assert pick_unit({0: {"intra": 1_000_000, "inter": 0}}) == ("MB", 1e6)
    assert pick_unit({0: {"intra": 0, "inter": 0}, 3: {"intra": 5, "inter": 2_000_000}}) == ("MB", 1e6)
    assert pick_unit({}) == ("B", 1.0) and pick_unit({0: {}}) == ("B", 1.0)


def test_volume_table_rows_padding_and_senders_only() -> None:
    """Cells R<rank>: intra | inter in the unit, padded to the widest, per_line to a row, three spaces apart;
    silent ranks left out unless asked."""
    vol = {0: {"intra": 2_000_000, "inter": 0}, 1: {"intra": 0, "inter": 0}, 2: {"intra": 0, "inter": 12_600_000},
           3: {"intra": 1_000_000, "inter": 1_000_000}, 4: {"intra": 0, "inter": 3_000_000},
           5: {"intra": 7, "inter": 0}}
    assert volume_table(vol) == ("R0: 2 | 0    R2: 0 | 13   R3: 1 | 1    R4: 0 | 3 \n"
                                 "R5: 0 | 0 ")
    assert volume_table(vol, per_line=2, unit=1e6, only_senders=False) == (
        "R0: 2 | 0    R1: 0 | 0 \n"
        "R2: 0 | 13   R3: 1 | 1 \n"
        "R4: 0 | 3    R5: 0 | 0 ")
    assert volume_table({1: {"intra": 3, "inter": 0}, 2: {"intra": 0, "inter": 10}}) == "R1: 3 | 0    R2: 0 | 10"
    assert volume_table({0: {"intra": 0, "inter": 0}}) == "(no rank sends anything)"
    assert volume_table({}) == "(no rank sends anything)"
    assert volume_table({0: {"intra": 0, "inter": 0}}, only_senders=False) == "R0: 0 | 0"
    assert volume_table({0: {"intra": 1500, "inter": 0}}, unit=1000.0) == "R0: 2 | 0"


# ---- CommPlan ------------------------------------------------------------------------------------------------
def test_kinds_and_transfers_in_op_order() -> None:
    """One entry per operator, in execution order."""
    p = _plan([Op("AllReduce", [(0, 1, 4, 1)]), Op("BSR", [(1, 2, 8, 1), (0, 3, 2, 1)])])
    assert p.kinds == ["AllReduce", "BSR"]
    assert p.transfers() == [[(0, 1, 4, 1)], [(1, 2, 8, 1), (0, 3, 2, 1)]]


def test_simulate_runs_ops_in_order_and_returns_the_destination_ranks() -> None:
    """Each op reads the state the previous ops left; only destination ranks come back, in their order."""
    p = _plan([Op("A", add={2: (0, 10), 3: (1, 20)}), Op("B", add={3: (2, 100), 9: (3, 0)})])
    assert p.simulate({0: 1, 1: 2}) == {2: 11, 3: 111}
    assert list(p.simulate({1: 2, 0: 1, 7: 5})) == [2, 3]


def test_simulate_names_missing_source_ranks() -> None:
    """Every source rank without an input is named, sorted, with the source annotation."""
    p = _plan([Op("A")], src="[3,1,0] D3")
    with pytest.raises(ValueError) as info:
        p.simulate({1: 0})
    assert str(info.value) == "simulate: no input for source rank(s) [0, 3] of [3,1,0] D3"


def test_volume_counts_source_and_destination_ranks_on_the_plans_or_given_cluster() -> None:
    """Every rank of src and dst appears; the given cluster wins over the plan's; without both all is intra."""
    p = _plan([Op("A", [(0, 2, 5, 1), (1, 1, 9, 1)])], cluster=CL)
    z = {"intra": 0, "inter": 0}
    assert p.volume() == {0: {"intra": 0, "inter": 5}, 1: z, 2: z, 3: z}
    assert p.volume(Cluster.local(4)) == {0: {"intra": 5, "inter": 0}, 1: z, 2: z, 3: z}
    assert _plan(p.ops).volume() == {0: {"intra": 5, "inter": 0}, 1: z, 2: z, 3: z}
    assert _plan(p.ops).volume(CL) == p.volume()


def test_estimated_time_needs_a_cluster() -> None:
    """The plan's cluster, or the one given (which wins); none: an error saying what to pass."""
    ops = [Op("A", [(0, 2, 2_000_000_000, 1)]), Op("B", [(0, 1, 5_000_000_000, 0)])]
    assert _plan(ops, cluster=CL).estimated_time() == pytest.approx(2.000005, rel=1e-12, abs=0)
    assert _plan(ops).estimated_time(CL) == pytest.approx(2.000005, rel=1e-12, abs=0)
    assert _plan(ops, cluster=CL).estimated_time(Cluster.local(4)) == pytest.approx(0.4 + 1e-6 + 1.0, rel=1e-12)
    with pytest.raises(ValueError) as info:
        _plan(ops).estimated_time()
    assert str(info.value) == "estimated_time needs a cluster: pass one, or resolve(..., cluster=...)"


def test_render_text() -> None:
    """Header, kinds, each op's numbered description, then the sent bytes per rank in the unit picked."""
    p = _plan([Op("AllReduce", [(0, 1, 3_000_000, 1)], desc=("AllReduce: 1 group(s)", "    ranks [0, 1]")),
               Op("BSR", [(1, 2, 2_000_000, 1)], desc=("BSR: 1 message(s)",))], cluster=CL)
    text = ("Reshard [0,1] S0x2  ->  [2,3] S0x2\n"
            "  shape (4, 2) float32;  kinds: AllReduce -> BSR\n"
            "  [0] AllReduce: 1 group(s)\n"
            "      ranks [0, 1]\n"
            "  [1] BSR: 1 message(s)\n"
            "  sent per rank, MB (intra-node | inter-node):\n"
            "    R0: 3 | 0   R1: 0 | 2")
    assert p.render() == text and str(p) == text
    small = _plan([Op("SendRecv", [(0, 1, 7, 1)], desc=("S",))])
    assert small.render().endswith("  [0] S\n  sent per rank, B (intra-node | inter-node):\n    R0: 7 | 0")


def test_render_without_bytes_and_html() -> None:
    """No bytes moved: says so; the HTML form escapes the text inside <pre>."""
    p = _plan([Op("Identity", [(0, 0, 8, 1)], desc=("Identity <local>",))], src="[0] R", dst="[0] R")
    assert p.render() == ("Reshard [0] R  ->  [0] R\n  shape (4, 2) float32;  kinds: Identity\n"
                          "  [0] Identity <local>\n  no bytes sent")
    assert p._repr_html_() == ("<pre>Reshard [0] R  -&gt;  [0] R\n  shape (4, 2) float32;  kinds: Identity\n"
                               "  [0] Identity &lt;local&gt;\n  no bytes sent</pre>")
    inter_only = _plan([Op("X", [(0, 2, 5, 1)], desc=("X",))], cluster=CL)
    assert inter_only.render().endswith("    R0: 0 | 5")
