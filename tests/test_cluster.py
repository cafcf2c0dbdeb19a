"""The cluster model: Table 7 presets, link classes, hostfiles, JSON round trips."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hspmd_sdk.core.cluster import DEVICE_PRESETS, Cluster
from hspmd_sdk.errors import PlanValidationError


def test_presets_match_table7() -> None:
    # Table 7: H800 81559 MB, 990 TFLOPS bf16, 400 GB/s NVLink; H20 97871 MB, 148 TFLOPS, 900 GB/s.
    h800, h20 = DEVICE_PRESETS["H800"], DEVICE_PRESETS["H20"]
    assert (h800.memory_mb, h800.bf16_tflops, h800.intra_bandwidth_gbs) == (81559, 990, 400)
    assert (h20.memory_mb, h20.bf16_tflops, h20.intra_bandwidth_gbs) == (97871, 148, 900)


def test_paper_cluster_ranks_and_nodes() -> None:
    c = Cluster.mixed({"H800": 16, "H20": 32})
    assert c.num_ranks == 48 and len(c.nodes) == 6
    assert [c.kind(r) for r in (0, 15, 16, 47)] == ["H800", "H800", "H20", "H20"]
    assert c.kinds() == {"H800": 16, "H20": 32}
    assert c.node_index(7) == 0 and c.node_index(8) == 1 and c.node_index(16) == 2


def test_link_classes_and_bandwidths() -> None:
    c = Cluster.mixed({"H800": 16, "H20": 32}, inter_bandwidth_gbs=50, inter_latency_us=10)
    assert c.link(3, 3).cls == "self" and c.link(3, 3).time(10**9) == 0
    h800 = c.link(0, 7)
    assert h800.cls == "intra" and h800.bandwidth == 400e9 and h800.latency == pytest.approx(1e-6)
    assert c.link(16, 23).cls == "intra" and c.link(16, 23).bandwidth == 900e9
    inter = c.link(7, 8)
    assert inter.cls == "inter" and inter.bandwidth == 50e9 and inter.latency == pytest.approx(10e-6)
    assert c.link(15, 16).cls == "inter"
    # time = latency + bytes / bandwidth
    assert inter.time(50 * 10**9) == pytest.approx(1 + 10e-6)
    with pytest.raises(IndexError, match=r"rank 48 is not in the cluster \(48 ranks: 0..47\)"):
        c.link(0, 48)


def test_nodes_of_one_host_talk_over_the_host_link_where_it_is_given() -> None:
    """A box of mixed kinds is one Node per kind on one host: with ``host_bandwidth_gbs`` its kinds talk over that
    link (class "intra"), other hosts over the network; without, as before, over the network."""
    nodes = [{"host": f"box{b}", "kind": k, "ranks": [4 * b + 2 * i, 4 * b + 2 * i + 1]}
             for b in range(2) for i, k in enumerate(("H800", "H20"))]
    boxes = Cluster.load({"nodes": nodes, "inter_bandwidth_gbs": 25, "host_bandwidth_gbs": 64})
    assert boxes.link(0, 1).bandwidth == 400e9  # one node: NVLink
    inside = boxes.link(1, 2)  # H800 and H20 of box0
    assert inside.cls == "intra" and inside.bandwidth == 64e9 and inside.latency == pytest.approx(1e-6)
    assert boxes.link(3, 4).cls == "inter" and boxes.link(3, 4).bandwidth == 25e9  # box0 to box1
    plain = Cluster.load({"nodes": nodes, "inter_bandwidth_gbs": 25})
    assert plain.link(1, 2).cls == "inter" and plain.link(1, 2).bandwidth == 25e9
    with pytest.raises(PlanValidationError, match="host_bandwidth_gbs"):
        Cluster.load({"nodes": nodes, "host_bandwidth_gbs": 0})


def test_local_and_homogeneous() -> None:
    assert Cluster.local(4).num_ranks == 4 and Cluster.local(4).kinds() == {"cpu": 4}
    h = Cluster.homogeneous("H20", 31)
    assert [len(n.ranks) for n in h.nodes] == [8, 8, 8, 7]
    assert len(Cluster.mixed({"A100": 8}, per_node=4).nodes) == 2


def test_hostfile(tmp_path: Path) -> None:
    f = tmp_path / "hostfile"
    f.write_text("# the paper's cluster, shortened\nh800-a slots=8 kind=H800\n\nh20-a slots=4 kind=H20  # half\n"
                 "cpu-box slots=2\n")
    c = Cluster.from_hostfile(f)
    assert [n.host for n in c.nodes] == ["h800-a", "h20-a", "cpu-box"]
    assert [n.ranks for n in c.nodes] == [list(range(8)), [8, 9, 10, 11], [12, 13]]
    assert c.kind(13) == "cpu" and c.spec(9).kind == "H20"


@pytest.mark.parametrize("text, line, fragment", [
    ("a slots=two\n", 1, "is not an integer"),
    ("a slots=2\nb gpus=2\n", 2, "cannot read 'gpus=2'"),
    ("a slots=0\n", 1, "must be >= 1"),
])
def test_hostfile_errors_name_the_line(tmp_path: Path, text: str, line: int, fragment: str) -> None:
    f = tmp_path / "hostfile"
    f.write_text(text)
    with pytest.raises(PlanValidationError) as info:
        Cluster.from_hostfile(f)
    (path, reason), = info.value.problems
    assert path == f"{f}:{line}" and fragment in reason


def test_hostfile_empty_and_unknown_kind(tmp_path: Path) -> None:
    f = tmp_path / "hostfile"
    f.write_text("# nothing\n")
    with pytest.raises(PlanValidationError, match="no hosts"):
        Cluster.from_hostfile(f)
    f.write_text("a slots=2 kind=TPU9\n")
    with pytest.raises(PlanValidationError, match="unknown device kind 'TPU9'"):
        Cluster.from_hostfile(f)


@pytest.mark.parametrize("cluster", [Cluster.local(3), Cluster.mixed({"H800": 16, "H20": 32}),
                                     Cluster.homogeneous("H20", 31, inter_bandwidth_gbs=12.5)])
def test_json_round_trip(cluster: Cluster, tmp_path: Path) -> None:
    text = cluster.model_dump_json()
    assert Cluster.model_validate_json(text) == cluster
    assert Cluster.load(text) == cluster and Cluster.load(json.loads(text)) == cluster
    path = tmp_path / "c.json"
    path.write_text(text)
    assert Cluster.load(path) == cluster and Cluster.load(str(path)) == cluster
    assert Cluster.load(path).num_ranks == cluster.num_ranks  # private rank table rebuilt


def test_bad_clusters_name_the_field() -> None:
    with pytest.raises(PlanValidationError) as info:
        Cluster.load({"nodes": [{"host": "a", "kind": "cpu", "ranks": [0, 2]}]})
    assert info.value.problems[0][0] == "nodes" and "missing: [1]" in info.value.problems[0][1]
    with pytest.raises(PlanValidationError) as info:
        Cluster.load({"nodes": [{"host": "a", "kind": "cpu", "ranks": []}]})
    assert info.value.problems[0][0] == "nodes[0].ranks"


def test_example_cluster_files_match_constructors(examples_dir: Path) -> None:
    expected = {"paper_16h800_16h20.json": {"H800": 16, "H20": 16},
                "paper_16h800_24h20.json": {"H800": 16, "H20": 24},
                "paper_16h800_32h20.json": {"H800": 16, "H20": 32},
                "h20_32.json": {"H20": 32}, "h20_31.json": {"H20": 31}, "h20_24.json": {"H20": 24}}
    for name, counts in expected.items():
        assert Cluster.load(examples_dir / name) == Cluster.mixed(counts), name
    assert Cluster.load(examples_dir / "local_4.json") == Cluster.local(4)


def test_json_schema_validates_cluster_files(examples_dir: Path) -> None:
    import jsonschema
    schema = Cluster.model_json_schema()
    for name in ("paper_16h800_32h20.json", "h20_31.json", "local_4.json"):
        jsonschema.validate(json.loads((examples_dir / name).read_text()), schema)
