"""Tests written to kill the surviving mutants of mutation testing (scripts/mutation.sh) of core/cluster.py.

Each pins a behaviour a user sees: the display strings of memory and counts, the link of a rank to itself, the
exact problems (path and text) of the constructors' and the hostfile reader's errors, and the bounds (one rank,
:data:`MAX_RANKS` ranks) the checks let through.  Every figure is worked out by hand.
"""
from __future__ import annotations

import locale
import math
import sys
from pathlib import Path

import pytest

import hspmd_sdk.core.cluster as cluster_mod
from hspmd_sdk.core.cluster import (DEVICE_PRESETS, MAX_RANKS, Cluster, DeviceSpec, Link, Node, format_count,
                                    format_memory)
from hspmd_sdk.errors import PlanValidationError


def _problems(fn, *args, **kw) -> list[tuple[str, str]]:
    with pytest.raises(PlanValidationError) as info:
        fn(*args, **kw)
    return info.value.problems


# ---- display helpers ------------------------------------------------------------------------------------------

def test_memory_bytes_and_describe() -> None:
    """memory_bytes is MiB * 2**20; describe() shows binary GiB, TFLOPS and NVLink (a cpu device: what it is)."""
    h800 = DEVICE_PRESETS["H800"]
    assert h800.memory_bytes == 81559 * 1048576
    assert h800.describe() == "79.6 GiB, 990 TFLOPS bf16, NVLink 400 GB/s"
    assert DEVICE_PRESETS["cpu"].describe() == ("local worker process, nominal 8.0 GiB, 0.5 TFLOPS bf16, "
                                                "5 GB/s between processes")


def test_format_memory_switches_to_gib_at_a_tenth() -> None:
    """Exactly 0.1 GiB is shown in GiB; below it in MiB; the figures are binary (2**30, 2**20)."""
    assert format_memory(0.1 * 2**30) == "0.1 GiB"
    assert format_memory(0.1 * 2**30 - 2**20) == "101.4 MiB"
    assert format_memory(0.5 * 2**30) == "0.5 GiB"
    assert format_memory(3 * 2**30) == "3.0 GiB"
    assert format_memory(5 * 2**20) == "5.0 MiB"
    assert format_memory(0) == "0.0 MiB"


@pytest.mark.parametrize("n, text", [
    (1e12, "1.00T"), (2.5e12, "2.50T"), (1e9, "1.00B"), (6.74e9, "6.74B"), (1e6, "1.00M"), (1e3, "1.00K"),
    (999, "999"), (512, "512"), (-2e6, "-2.00M"),
    (9.99e3, "9.99K"), (10e3, "10.0K"), (10.5e3, "10.5K"), (99.5e3, "99.5K"), (100e3, "100K"), (100.7e3, "101K"),
    (197.2e3, "197K"),
])
def test_format_count(n: float, text: str) -> None:
    """The unit is the largest of T, B, M, K not above |n|; two decimals below 10, one below 100, none above."""
    assert format_count(n) == text


# ---- links ----------------------------------------------------------------------------------------------------

def test_link_to_itself_is_free_and_zero_bytes_cost_nothing() -> None:
    """A rank's link to itself is Link("self", inf, 0.0); moving 0 bytes takes 0 s on any link, and a "self" link
    takes 0 s whatever its figures (not latency + bytes / bandwidth)."""
    c = Cluster.local(2)
    assert c.link(0, 0) == Link("self", math.inf, 0.0)
    assert c.link(1, 1) == Link("self", math.inf, 0.0)
    assert c.link(0, 1).time(0) == 0.0
    assert Link("inter", 1e9, 1e-3).time(0) == 0.0 and Link("inter", 1e9, 1e-3).time(1) == 1e-3 + 1e-9
    assert Link("self", 1.0, 1.0).time(5) == 0.0


def test_rank_queries() -> None:
    """ranks is 0..n-1; rank 0 is a rank; a negative rank is an IndexError naming it, not Python's -1 indexing."""
    c = Cluster.local(3)
    assert c.ranks == [0, 1, 2]
    c.check_rank(0)
    assert c.node_index(0) == 0
    with pytest.raises(IndexError, match=r"^rank -1 is not in the cluster \(3 ranks: 0\.\.2\)$"):
        c.node_index(-1)
    with pytest.raises(IndexError, match=r"^rank 3 is not in the cluster \(3 ranks: 0\.\.2\)$"):
        c.node_index(3)


def test_str() -> None:
    assert str(Cluster.mixed({"H800": 16, "H20": 4})) == "Cluster(20 ranks on 3 nodes: 16 H800, 4 H20)"


# ---- constructors ----------------------------------------------------------------------------------------------

def test_homogeneous_passes_per_node_and_fields_on() -> None:
    c = Cluster.homogeneous("H20", 6, per_node=4, inter_bandwidth_gbs=12.5)
    assert [n.ranks for n in c.nodes] == [[0, 1, 2, 3], [4, 5]] and c.inter_bandwidth_gbs == 12.5


def test_mixed_places_every_device() -> None:
    """One device of a kind is a node; a remainder of one after full nodes is a node too."""
    c = Cluster.mixed({"H800": 1, "H20": 9})
    assert [(n.host, n.kind, n.ranks) for n in c.nodes] == [
        ("node0", "H800", [0]), ("node1", "H20", list(range(1, 9))), ("node2", "H20", [9])]
    assert Cluster.local(1).ranks == [0]


@pytest.mark.parametrize("counts, per_node, problems", [
    ({"H800": 0}, 8, [("counts['H800']", "0 is not a whole number >= 1")]),
    ({"H800": -3}, 8, [("counts['H800']", "-3 is not a whole number >= 1")]),
    ({"H800": True}, 8, [("counts['H800']", "True is not a whole number >= 1")]),
    ({"H800": 2.5}, 8, [("counts['H800']", "2.5 is not a whole number >= 1")]),
    ({"H800": "4"}, 8, [("counts['H800']", "'4' is not a whole number >= 1")]),
    ({"H800": 4}, 0, [("per_node", "0 is not a whole number >= 1")]),
    ({"H800": 4}, True, [("per_node", "True is not a whole number >= 1")]),
    ({"H800": 4}, 2.5, [("per_node", "2.5 is not a whole number >= 1")]),
    ({"H800": 0, "H20": 1}, 0, [("counts['H800']", "0 is not a whole number >= 1"),
                                ("per_node", "0 is not a whole number >= 1")]),
    ({"H800": MAX_RANKS, "H20": 1}, 8, [("counts", f"{MAX_RANKS + 1} ranks is more than the {MAX_RANKS} a "
                                                   "cluster may have")]),
    ({"H800": MAX_RANKS + 1, "H20": 0}, 8, [("counts['H20']", "0 is not a whole number >= 1")]),
])
def test_mixed_count_problems(counts, per_node, problems) -> None:
    """The constructors' own checks: every problem with its path and text, before any node is built."""
    with pytest.raises(PlanValidationError) as info:
        Cluster.mixed(counts, per_node=per_node)
    assert info.value.problems == problems and info.value.what == "cluster"


def test_max_ranks_is_allowed() -> None:
    """Exactly MAX_RANKS ranks is a valid cluster (the bound is inclusive), by every constructor."""
    assert Cluster.local(MAX_RANKS).num_ranks == MAX_RANKS
    assert Cluster.load({"nodes": [{"host": "a", "kind": "cpu", "ranks": list(range(MAX_RANKS))}]}).num_ranks \
        == MAX_RANKS
    assert _problems(Cluster.load, {"nodes": [{"host": "a", "kind": "cpu", "ranks": list(range(MAX_RANKS + 1))}]}) \
        == [("nodes", f"{MAX_RANKS + 1} ranks is more than the {MAX_RANKS} a cluster may have")]


def test_local_checks_its_count() -> None:
    assert _problems(Cluster.local, 0) == [("counts['cpu']", "0 is not a whole number >= 1")]


def test_repeated_and_missing_ranks_are_named() -> None:
    """A rank given twice is listed once under "repeated", a rank given once is not."""
    got = _problems(Cluster.load, {"nodes": [{"host": "a", "kind": "cpu", "ranks": [0, 0, 1]}]})
    assert got == [("nodes", "ranks must be 0..2, each once; repeated: [0]; missing: [2]")]
    got = _problems(Cluster.load, {"nodes": [{"host": "a", "kind": "cpu", "ranks": [0, 2]},
                                             {"host": "b", "kind": "cpu", "ranks": [2, 3]}]})
    assert got == [("nodes", "ranks must be 0..3, each once; repeated: [2]; missing: [1]")]


def test_load_names_what_it_loads() -> None:
    with pytest.raises(PlanValidationError) as info:
        Cluster.load({"nodes": []})
    assert info.value.what == "cluster" and str(info.value).startswith("invalid cluster: nodes: ")


# ---- presets ---------------------------------------------------------------------------------------------------

def test_presets_fill_in_beside_given_devices() -> None:
    """Given device specs are kept (a kind that is no preset) and presets fill in the kinds not given."""
    x9 = DeviceSpec(kind="X9", memory_mb=1024, bf16_tflops=1, intra_bandwidth_gbs=2)
    c = Cluster.load({"nodes": [{"host": "a", "kind": "X9", "ranks": [0]}, {"host": "b", "kind": "H20", "ranks": [1]}],
                      "devices": {"X9": x9}})
    assert c.devices == {"X9": x9, "H20": DEVICE_PRESETS["H20"]}


def test_presets_fill_in_for_node_objects() -> None:
    """Nodes given as Node objects get their preset like dicts do."""
    c = Cluster.load({"nodes": [Node(host="a", kind="H800", ranks=[0, 1])]})
    assert c.devices == {"H800": DEVICE_PRESETS["H800"]} and c.num_ranks == 2


def test_input_that_is_no_dict_is_a_validation_error() -> None:
    """A list, or a node that is neither a dict nor a Node, is reported as a validation problem, not a crash."""
    assert _problems(Cluster.load, [1, 2])[0][0] == "<root>"
    assert [p for p, _ in _problems(Cluster.load, {"nodes": [42]})] == ["nodes[0]"]


# ---- Slurm -----------------------------------------------------------------------------------------------------

def test_from_slurm_asks_for_the_nodes_with_the_known_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    """from_slurm passes partition, nodes and every known kind (presets, then the given devices) to the reader and
    builds the cluster of its nodes with the other fields."""
    calls = []

    def fake(partition, nodes, *, known):
        calls.append((partition, nodes, known))
        return [{"host": "gpu01", "kind": "X9", "ranks": [0, 1]}]

    monkeypatch.setattr(cluster_mod, "slurm_cluster_nodes", fake)
    x9 = DeviceSpec(kind="X9", memory_mb=1024, bf16_tflops=1, intra_bandwidth_gbs=2)
    c = Cluster.from_slurm("gpu", "gpu[01-02]", devices={"X9": x9}, inter_bandwidth_gbs=50)
    assert calls == [("gpu", "gpu[01-02]", [*DEVICE_PRESETS, "X9"])]
    assert c.nodes == [Node(host="gpu01", kind="X9", ranks=[0, 1])] and c.inter_bandwidth_gbs == 50
    assert c.devices == {"X9": x9}
    calls.clear()
    monkeypatch.setattr(cluster_mod, "slurm_cluster_nodes",
                        lambda partition, nodes, *, known: calls.append(known) or [{"host": "h", "kind": "cpu",
                                                                                   "ranks": [0]}])
    assert Cluster.from_slurm().num_ranks == 1 and calls == [list(DEVICE_PRESETS)]


# ---- hostfiles -------------------------------------------------------------------------------------------------

def _hostfile(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "hostfile"
    f.write_text(text, encoding="utf-8")
    return f


def test_hostfile_defaults_and_comments(tmp_path: Path) -> None:
    """A host without slots= has one rank; a comment runs from the first '#' to the end of the line."""
    c = Cluster.from_hostfile(_hostfile(tmp_path, "a\nb slots=1 # one # more\nc slots=00000000000000000002\n"))
    assert [(n.host, n.ranks) for n in c.nodes] == [("a", [0]), ("b", [1]), ("c", [2, 3])]


@pytest.mark.parametrize("text, reason", [
    ("a slots=000000000000000000001\n", "slots='000000000000000000001' is not an integer"),
    ("a slots==2\n", "slots='=2' is not an integer"),
    ("a kind=H=1\n", None),
    ("a slots=1\nb slots=131072\n", "slots=131072 is too many: a cluster has at most 131072 ranks"),
])
def test_hostfile_value_errors(tmp_path: Path, text: str, reason: str | None) -> None:
    """The slots value is read up to 20 characters; a field splits at its first '='; slots may fill the cluster
    up to MAX_RANKS and not beyond (a line's error names it)."""
    f = _hostfile(tmp_path, text)
    if reason is None:  # kind=H=1 is the kind 'H=1', unknown
        assert _problems(Cluster.from_hostfile, f)[0][1].startswith("unknown device kind 'H=1'")
        return
    lineno = text.count("\n")
    assert _problems(Cluster.from_hostfile, f) == [(f"{f}:{lineno}", reason)]


def test_hostfile_may_hold_max_ranks(tmp_path: Path) -> None:
    assert Cluster.from_hostfile(_hostfile(tmp_path, f"a slots={MAX_RANKS}\n")).num_ranks == MAX_RANKS


def test_hostfile_unreadable(tmp_path: Path) -> None:
    """A missing file, a directory and a path with a NUL each give their reason, with the path."""
    missing = tmp_path / "nope"
    assert _problems(Cluster.from_hostfile, missing) == [(str(missing), "no such file")]
    assert _problems(Cluster.from_hostfile, tmp_path) == [(str(tmp_path), "cannot read: Is a directory")]
    assert _problems(Cluster.from_hostfile, "a\0b") == [("a\0b", "cannot read: embedded null byte")]


@pytest.mark.skipif(sys.flags.utf8_mode, reason="UTF-8 mode: the locale's encoding is UTF-8 anyway")
def test_hostfile_is_read_as_utf8_whatever_the_locale(tmp_path: Path) -> None:
    """A hostfile is UTF-8 text also under an ASCII locale (the process's LC_CTYPE set to C for the test)."""
    f = _hostfile(tmp_path, "höst slots=1\n")
    old = locale.setlocale(locale.LC_CTYPE)
    try:
        locale.setlocale(locale.LC_CTYPE, "C")
        c = Cluster.from_hostfile(f)
    finally:
        locale.setlocale(locale.LC_CTYPE, old)
    assert c.nodes[0].host == "höst"
