"""Cluster.from_slurm: the parser on captured ``scontrol show node -o`` text, and the reader against a real Slurm
(slurmctld, slurmd in network namespaces, munged: :class:`hspmd_sdk.testing.slurm.LocalSlurm`) whose nodes the
test configures itself -- the configuration is the independent reference."""
from __future__ import annotations

import socket
import subprocess

import pytest
from _needs import skip_or_fail

from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk.core.cluster import DEVICE_PRESETS
from hspmd_sdk.core.slurm_nodes import device_kind, parse_gres, parse_scontrol_nodes, read_slurm_nodes
from hspmd_sdk.errors import PlanValidationError
from hspmd_sdk.testing.slurm import LocalSlurm, SlurmNode, slurm_unavailable

# Captured from Slurm 22.05.8 (``scontrol show node -o``), with a down node and a GRES with socket bindings.
CAPTURED = (
    "NodeName=g01 Arch=x86_64 CoresPerSocket=32  CPUAlloc=0 CPUEfctv=128 CPUTot=128 CPULoad=0.12 "
    "AvailableFeatures=h800,ib ActiveFeatures=h800,ib Gres=gpu:h800:8(S:0-1) NodeAddr=10.0.0.1 NodeHostName=g01 "
    "Version=22.05.8 OS=Linux 6.1.0-18-amd64 #1 SMP PREEMPT_DYNAMIC Debian 6.1.76-1 (2024-02-01)  RealMemory=2000000 "
    "AllocMem=0 FreeMem=1900000 Sockets=2 Boards=1 State=IDLE ThreadsPerCore=2 TmpDisk=0 Weight=1 Owner=N/A "
    "MCS_label=N/A Partitions=gpu,all  BootTime=2024-03-01T10:00:00 SlurmdStartTime=2024-03-01T10:01:00\n"
    "NodeName=g02 Arch=x86_64 CoresPerSocket=24  CPUAlloc=0 CPUEfctv=96 CPUTot=96 CPULoad=0.00 "
    "AvailableFeatures=ib,H20 ActiveFeatures=ib,H20 Gres=gpu:4,nic:2 NodeAddr=g02.ib NodeHostName=g02 "
    "RealMemory=1000000 State=DOWN* ThreadsPerCore=1 Partitions=gpu "
    "Reason=Not responding [slurm@2024-03-01T11:00:00]\n"
    "NodeName=c01 CPUTot=64 RealMemory=256000 AvailableFeatures=(null) Gres=(null) NodeAddr=c01 State=MIXED "
    "Partitions=all\n")


def test_parse_scontrol_nodes_reads_every_field() -> None:
    g01, g02, c01 = parse_scontrol_nodes(CAPTURED)
    assert (g01.name, g01.address, g01.cpus, g01.memory_mb, g01.state) == ("g01", "10.0.0.1", 128, 2000000, "IDLE")
    assert g01.partitions == ("gpu", "all") and g01.features == ("h800", "ib")
    assert g01.gres == (("gpu", "h800", 8),) and g01.gpus == 8 and g01.usable
    assert g02.gres == (("gpu", None, 4), ("nic", None, 2)) and g02.gpus == 4 and g02.gpu_types == []
    assert g02.reason == "Not responding [slurm@2024-03-01T11:00:00]" and not g02.usable
    assert (c01.gres, c01.features, c01.gpus, c01.usable) == ((), (), 0, True)


def test_parse_gres_forms() -> None:
    assert parse_gres("gpu:a100:4,gpu:v100:2") == (("gpu", "a100", 4), ("gpu", "v100", 2))
    assert parse_gres("gpu:h800:8(S:0-1),mps:100") == (("gpu", "h800", 8), ("mps", None, 100))
    assert parse_gres("(null)") == () and parse_gres("") == ()


def test_device_kind_from_gres_type_then_a_feature_naming_a_kind_then_cpu() -> None:
    g01, g02, c01 = parse_scontrol_nodes(CAPTURED)
    assert device_kind(g01, list(DEVICE_PRESETS)) == "H800"   # GRES type h800 -> the preset H800
    assert device_kind(g02, list(DEVICE_PRESETS)) == "H20"    # untyped GPUs: the feature H20 (not "ib")
    assert device_kind(c01, list(DEVICE_PRESETS)) == "cpu"
    two = parse_scontrol_nodes("NodeName=x CPUTot=8 RealMemory=1 Gres=gpu:a100:4,gpu:v100:2 State=IDLE\n")[0]
    with pytest.raises(PlanValidationError, match=r"nodes\.x\.gres: GPUs of 2 types \(a100, v100\)"):
        device_kind(two, list(DEVICE_PRESETS))
    l40 = parse_scontrol_nodes("NodeName=y CPUTot=8 RealMemory=1 Gres=gpu:l40s:4 State=IDLE\n")[0]
    assert device_kind(l40, list(DEVICE_PRESETS)) == "l40s"   # no preset: kept as written (needs devices=)


def test_srun_status_maps_signal_exits() -> None:
    from hspmd_sdk.runtime.transports.slurm import srun_status

    assert (srun_status(0), srun_status(3), srun_status(137), srun_status(143)) == (0, 3, -9, -15)


def test_parse_scontrol_nodes_bad_text_names_the_line() -> None:
    with pytest.raises(PlanValidationError, match=r"line 1 \(n1\)\.CPUTot"):
        parse_scontrol_nodes("NodeName=n1 CPUTot=many RealMemory=1\n")
    with pytest.raises(PlanValidationError, match="line 2: no NodeName"):
        parse_scontrol_nodes("NodeName=n1 CPUTot=1 RealMemory=1\nState=IDLE\n")


NODES = [SlurmNode("n1", "H800", gpus=2, cpus=4, memory_mb=1000), SlurmNode("n2", "H20", gpus=1, cpus=2,
                                                                                memory_mb=700),
         SlurmNode("n3", "cpu", cpus=3, memory_mb=500)]


# What Slurm 22.05's scontrol prints (stderr, exit status 1) where it finds no configuration (it falls back to DNS SRV
# records), and where its controller does not answer.
NO_CONFIG = ("scontrol: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host\n"
             "scontrol: error: fetch_config: DNS SRV lookup failed\n"
             "scontrol: error: _establish_config_source: failed to fetch config\n"
             "scontrol: fatal: Could not establish a configuration source\n")
DOWN = "slurm_load_node error: Unable to contact slurm controller (connect failure)\n"


@pytest.mark.parametrize("said", [NO_CONFIG, DOWN], ids=["no configuration", "controller down"])
def test_from_slurm_without_a_controller_says_so(said: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 48 item 4: a stand-in scontrol on PATH that fails as the real one does without a reachable Slurm."""
    from hspmd_sdk.core.slurm_nodes import SlurmError

    (tmp_path / "said").write_text(said)
    exe = tmp_path / "scontrol"
    exe.write_text(f"#!/bin/sh\ncat {tmp_path / 'said'} >&2\nexit 1\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    with pytest.raises(SlurmError) as info:
        Cluster.from_slurm()
    text = str(info.value)
    assert text.startswith("no Slurm controller found (is SLURM_CONF set / is slurmctld running?)"), text
    assert "res_nsearch" not in text and text.count("\n") == 0, text


@pytest.fixture(scope="module")
def slurm():  # type: ignore[no-untyped-def]
    skip_or_fail(slurm_unavailable(), "the Slurm tests (a local Slurm: root, slurm-wlm, munge)")
    with LocalSlurm(NODES) as lab:
        yield lab


@pytest.fixture
def slurm_env(slurm: LocalSlurm, monkeypatch: pytest.MonkeyPatch) -> LocalSlurm:
    for k, v in slurm.env.items():
        monkeypatch.setenv(k, v)
    return slurm


@pytest.mark.timeout(60)
def test_from_slurm_matches_the_configured_nodes(slurm_env: LocalSlurm) -> None:
    cluster = Cluster.from_slurm()
    assert [(n.host, n.kind, len(n.ranks)) for n in cluster.nodes] == [("n1", "H800", 2), ("n2", "H20", 1),
                                                                      ("n3", "cpu", 1)]
    assert cluster.num_ranks == 4 and cluster.kinds() == {"H800": 2, "H20": 1, "cpu": 1}
    assert [(n.cpus, n.memory_mb) for n in cluster.nodes] == [(n.cpus, n.memory_mb) for n in NODES]
    infos = {i.name: i for i in read_slurm_nodes(partition=slurm_env.partition)}
    for n in NODES:
        assert (infos[n.name].cpus, infos[n.name].memory_mb) == (n.cpus, n.memory_mb)
        assert infos[n.name].address == slurm_env.address(n.name)
    picked = Cluster.from_slurm(nodes="n[2-3]")
    assert [(n.host, n.kind, n.ranks) for n in picked.nodes] == [("n2", "H20", [0]), ("n3", "cpu", [1])]
    with pytest.raises(PlanValidationError, match="no usable Slurm node in partition 'nope'"):
        Cluster.from_slurm(partition="nope")


@pytest.mark.timeout(90)
def test_a_killed_node_is_left_out_and_comes_back(slurm_env: LocalSlurm) -> None:
    slurm_env.kill_node("n3")
    assert slurm_env.node_pids("n3") == []
    slurm_env.scontrol("update", "nodename=n3", "state=down", "reason=killed by the test")
    try:
        assert [n.host for n in Cluster.from_slurm().nodes] == ["n1", "n2"]
        with pytest.raises(PlanValidationError, match=r"nodes\.n3: cannot run a job now: state DOWN \(killed by"):
            Cluster.from_slurm(nodes=["n3"])
    finally:
        slurm_env.restart_node("n3")
    assert [n.host for n in Cluster.from_slurm().nodes] == ["n1", "n2", "n3"]


@pytest.mark.timeout(60)
def test_nodes_are_hosts_of_their_own(slurm_env: LocalSlurm) -> None:
    """Each node runs its tasks in its own network namespace, at its own address, with its GPUs as GRES."""
    r = subprocess.run(["srun", "-w", "n1", "-N1", "-n1", "--gres=gpu:h800:2", "sh", "-c",
                        "hostname; echo $CUDA_VISIBLE_DEVICES; ip -4 -o addr show eth0"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    host, cuda, addr = r.stdout.splitlines()
    assert (host, cuda) == ("n1", "0,1") and f"{slurm_env.address('n1')}/24" in addr
    addr = (slurm_env.address("n2"), 6818)  # its slurmd
    socket.create_connection(addr, timeout=2).close()
    slurm_env.cut_node("n2")
    try:
        with pytest.raises(OSError):
            socket.create_connection(addr, timeout=1).close()
    finally:
        slurm_env.restore_node("n2")
    socket.create_connection(addr, timeout=5).close()
