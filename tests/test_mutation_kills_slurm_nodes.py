"""Tests that kill the surviving mutants of :mod:`hspmd_sdk.core.slurm_nodes` (issue 49, mutation testing): the
parser of ``scontrol show node -o``, the node filter of ``read_slurm_nodes`` and the nodes of
``Cluster.from_slurm``, with ``scontrol`` replaced by a stand-in (no Slurm needed)."""
from __future__ import annotations

import subprocess

import pytest

from hspmd_sdk.core import slurm_nodes as sn
from hspmd_sdk.core.slurm_nodes import (SlurmError, SlurmNodeInfo, device_kind, parse_gres, parse_scontrol_nodes,
                                        read_slurm_nodes, slurm_cluster_nodes, split_fields)
from hspmd_sdk.errors import PlanValidationError

NODES = ("NodeName=a1 NodeAddr=10.0.0.1 CPUTot=16 RealMemory=64000 State=IDLE Partitions=gpu,all "
         "AvailableFeatures=ib Gres=gpu:h800:2\n"
         "NodeName=a2 CPUTot=8 RealMemory=0 State=MIXED Partitions=all Gres=(null)\n"
         "NodeName=a3 CPUTot=0 RealMemory=32000 State=DOWN* Partitions=gpu Gres=gpu:1 Reason=dead [x@1]\n"
         "NodeName=a4 CPUTot=4 RealMemory=1000 State=IDLE+DRAIN Partitions=gpu Gres=gpu:h20:4 Reason=maint\n"
         "NodeName=a5 CPUTot=4 RealMemory=1000 State=ALLOCATED Partitions=gpu AvailableFeatures=H20 Gres=gpu:3\n")


def _fake_scontrol(monkeypatch: pytest.MonkeyPatch, nodes: str = NODES, hostnames: str = "") -> list:
    calls: list = []

    def fake(*args: str, timeout_s: float = 30.0) -> str:
        calls.append(args)
        if args[:2] == ("show", "hostnames"):
            return hostnames
        assert args == ("show", "node", "-o")
        return nodes

    monkeypatch.setattr(sn, "scontrol", fake)
    return calls


def _info(**kw: object) -> SlurmNodeInfo:
    base = dict(name="n", address="n", cpus=1, memory_mb=1, state="IDLE")
    base.update(kw)
    return SlurmNodeInfo(**base)  # type: ignore[arg-type]


# ---- the records --------------------------------------------------------------------------------------------------
def test_gpus_count_only_gpu_gres_of_every_type() -> None:
    """``gpus`` sums the GPU GRES of every type and no other GRES."""
    n = _info(gres=(("gpu", "a", 2), ("nic", None, 5), ("gpu", None, 3)))
    assert n.gpus == 5 and _info().gpus == 0


def test_gpu_types_in_order_once_each_untyped_and_other_gres_skipped() -> None:
    n = _info(gres=(("nic", "x", 1), ("gpu", "b", 1), ("gpu", None, 2), ("gpu", "a", 1), ("gpu", "b", 3)))
    assert n.gpu_types == ["b", "a"]


@pytest.mark.parametrize("state, usable", [
    ("IDLE", True), ("MIXED", True), ("ALLOCATED+COMPLETING", True), ("idle", True), ("", False),
    ("IDLE*", False), ("DOWN", False), ("IDLE+DRAIN", False), ("MIXED-FAIL", False), ("FUTURE", False),
    ("IDLE~POWERED_DOWN", False), ("IDLE#POWER_DOWN", False), ("INVAL", False), ("idle+drain", False),
    ("IDLE+NOT_RESPONDING", False), ("IDLE!DOWN", False), ("IDLE%DOWN", False), ("IDLE$DOWN", False),
    ("IDLE@DOWN", False), ("IDLE^DOWN", False), ("DRAINED", True)])
def test_usable_reads_every_state_word(state: str, usable: bool) -> None:
    """Unusable: empty, ``*`` (not responding), or any of the unusable words among those the separators give."""
    assert _info(state=state).usable is usable


# ---- parsing ------------------------------------------------------------------------------------------------------
def test_split_fields_keeps_spaced_values_and_skips_leading_words() -> None:
    """Words before the first ``Key=`` are dropped; a value's later words (not empty ones) join with one space;
    a key may hold ``:/.`` and digits after its first letter; ``=`` after the first stays in the value."""
    got = split_fields("junk here NodeName=n1 OS=Linux 6.1  #1 SMP a.b/c:d2=x=y 9k=v")
    assert got == {"NodeName": "n1", "OS": "Linux 6.1 #1 SMP", "a.b/c:d2": "x=y 9k=v"}
    assert split_fields("") == {}
    # fields are separated by single spaces only: a tab or newline inside a value is kept as written
    assert split_fields("Reason=disk\tfail\nnow NodeName=x") == {"Reason": "disk\tfail\nnow", "NodeName": "x"}


@pytest.mark.parametrize("text, want", [
    ("gpu:2K", (("gpu", None, 2048),)),
    ("gpu:h:3M", (("gpu", "h", 3 * 1024**2),)),
    ("mps:1G", (("mps", None, 1024**3),)),
    ("gpu", (("gpu", None, 1),)),
    ("gpu:tesla", (("gpu", "tesla", 1),)),
    ("gpu:a:2(S:0,1),nic:1", (("gpu", "a", 2), ("nic", None, 1))),
    (" gpu:a:1 , N/A ,(null)", (("gpu", "a", 1),)),
    ("gpu:a:x2", (("gpu", "a", 1),)),
    ("N/A,gpu:a:2,,nic", (("gpu", "a", 2), ("nic", None, 1))),
    ("(null),gpu:1", (("gpu", None, 1),)),
    ("7", (("7", None, 1),)),
])
def test_parse_gres_counts_with_suffixes_and_bindings(text: str, want: tuple) -> None:
    """Counts with K/M/G suffixes (powers of 1024), a default of one, bindings in brackets (with commas) cut."""
    assert parse_gres(text) == want


def test_parse_gres_keeps_a_type_only_from_the_second_part() -> None:
    assert parse_gres("gpu:a:b:4") == (("gpu", "a", 4),)


def test_parse_records_defaults_and_lists() -> None:
    """Address falls back to the name, partitions and features drop ``(null)`` and empty items, reason and state
    default to empty."""
    (n,) = parse_scontrol_nodes("\n  \nNodeName=z CPUTot=3 RealMemory=7 Partitions=p,,q AvailableFeatures=(null)\n")
    assert n == SlurmNodeInfo(name="z", address="z", cpus=3, memory_mb=7, state="", partitions=("p", "q"),
                              features=(), gres=(), reason="")
    (m,) = parse_scontrol_nodes("NodeName=y NodeAddr= CPUTot=1 RealMemory=2 State=IDLE Reason=a b")
    assert m.address == "y" and m.reason == "a b" and m.state == "IDLE"
    assert (m.partitions, m.features) == ((), ())   # fields absent: no partition, no feature


def test_parse_error_texts_name_the_line_and_the_field() -> None:
    """The messages a user reads: the line number, the node, the field and the bad text (cut to 40 characters);
    a line without NodeName= quoted (cut to 80)."""
    with pytest.raises(PlanValidationError) as e:
        parse_scontrol_nodes("\nNodeName=n7 CPUTot=1 RealMemory=" + "x" * 50)
    assert e.value.problems == [("line 2 (n7).RealMemory", f"{'x' * 40!r} is not a whole number")]
    assert e.value.what == "scontrol output"
    with pytest.raises(PlanValidationError) as e:
        parse_scontrol_nodes("NodeName=n1 CPUTot=1 RealMemory=1\n" + "State=IDLE " + "y" * 100)
    assert e.value.problems == [("line 2", f"no NodeName= in {('State=IDLE ' + 'y' * 100)[:80]!r}")]
    assert e.value.what == "scontrol output"
    with pytest.raises(PlanValidationError) as e:
        parse_scontrol_nodes("NodeName=n1 RealMemory=1")
    assert e.value.problems == [("line 1 (n1).CPUTot", "'' is not a whole number")]


def test_device_kind_case_and_features() -> None:
    """A GRES type matches a known kind case-insensitively; a feature naming ``cpu`` is no device kind; the
    first feature naming a kind wins."""
    known = ["cpu", "H800", "H20"]
    assert device_kind(_info(gres=(("gpu", "H20", 1),)), known) == "H20"
    assert device_kind(_info(gres=(("gpu", "h800", 1),)), known) == "H800"
    assert device_kind(_info(features=("CPU", "ib")), known) == "cpu"
    assert device_kind(_info(features=("cpu", "h20", "H800")), known) == "H20"
    with pytest.raises(PlanValidationError) as e:
        device_kind(_info(name="q", gres=(("gpu", "a", 1), ("gpu", "b", 1), ("gpu", "c", 1))), known)
    assert e.value.problems == [("nodes.q.gres", "GPUs of 3 types (a, b, c) on one node; a node holds devices of "
                                                 "one kind: leave it out with nodes=")]
    assert e.value.what == "cluster from Slurm"


# ---- scontrol ------------------------------------------------------------------------------------------------------
def _fake_run(monkeypatch: pytest.MonkeyPatch, result: object) -> list:
    calls: list = []

    def run(cmd: list, **kw: object) -> object:
        calls.append((cmd, kw))
        if isinstance(result, BaseException):
            raise result
        return result

    monkeypatch.setattr(sn.shutil, "which", lambda name: f"/opt/slurm/bin/{name}")
    monkeypatch.setattr(sn.subprocess, "run", run)
    return calls


def test_scontrol_runs_the_command_found_on_path_and_returns_stdout(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_run(monkeypatch, subprocess.CompletedProcess([], 0, "out\n", "noise"))
    assert sn.scontrol("show", "node", timeout_s=7.0) == "out\n"
    assert calls == [(["/opt/slurm/bin/scontrol", "show", "node"],
                      {"capture_output": True, "text": True, "timeout": 7.0})]
    assert sn.scontrol("x") == "out\n" and calls[-1][1]["timeout"] == 30.0


def test_scontrol_not_on_path_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sn.shutil, "which", lambda name: None)
    with pytest.raises(SlurmError) as e:
        sn.scontrol("show", "node")
    assert str(e.value) == ("Slurm's scontrol is not on PATH: install Slurm's clients (Debian: slurm-client) or run "
                            "where Slurm is")


def test_scontrol_timeout_names_the_command_and_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_run(monkeypatch, subprocess.TimeoutExpired("scontrol", 2.5))
    with pytest.raises(SlurmError) as e:
        sn.scontrol("show", "node", "-o", timeout_s=2.5)
    assert str(e.value) == "scontrol show node -o: no answer from slurmctld in 2.5 s"


def test_scontrol_failure_says_the_status_and_what_it_said(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another failure: the exit status and stderr (else stdout), stripped and cut to 500 characters."""
    _fake_run(monkeypatch, subprocess.CompletedProcess([], 3, "", "  bad " + "z" * 600 + "\n"))
    with pytest.raises(SlurmError) as e:
        sn.scontrol("show", "node")
    assert str(e.value) == "scontrol show node failed (exit status 3): " + ("bad " + "z" * 600)[:500]
    _fake_run(monkeypatch, subprocess.CompletedProcess([], 1, " from stdout \n", ""))
    with pytest.raises(SlurmError) as e:
        sn.scontrol("a")
    assert str(e.value) == "scontrol a failed (exit status 1): from stdout"


def test_no_controller_quotes_the_last_line_cut_to_200(monkeypatch: pytest.MonkeyPatch) -> None:
    said = "first\nUnable to contact slurm controller  \n   " + "w" * 300 + "  \n"
    _fake_run(monkeypatch, subprocess.CompletedProcess([], 1, "", said))
    with pytest.raises(SlurmError) as e:
        sn.scontrol("show", "node", "-o")
    assert str(e.value) == ("no Slurm controller found (is SLURM_CONF set / is slurmctld running?): "
                            f"scontrol show node -o said {'w' * 200!r}")
    _fake_run(monkeypatch, subprocess.CompletedProcess([], 1, "", "DNS SRV lookup failed"))
    with pytest.raises(SlurmError, match=r"said 'DNS SRV lookup failed'$"):
        sn.scontrol("x")


# ---- read_slurm_nodes ----------------------------------------------------------------------------------------------
def test_read_every_usable_node_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_scontrol(monkeypatch)
    assert [n.name for n in read_slurm_nodes()] == ["a1", "a2", "a5"]
    assert calls == [("show", "node", "-o")]


def test_read_a_partition_leaves_out_the_others_and_the_unusable(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_scontrol(monkeypatch)
    assert [n.name for n in read_slurm_nodes(partition="gpu")] == ["a1", "a5"]
    assert [n.name for n in read_slurm_nodes(partition="all")] == ["a1", "a2"]


def test_read_named_nodes_in_the_order_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Names (a list joined with commas, or a host list) are expanded by scontrol; the nodes come in that order."""
    calls = _fake_scontrol(monkeypatch, hostnames="a5\na1\n")
    assert [n.name for n in read_slurm_nodes(nodes=["a5", "a1"])] == ["a5", "a1"]
    assert calls[0] == ("show", "hostnames", "a5,a1")
    calls.clear()
    assert [n.name for n in read_slurm_nodes(partition="gpu", nodes="a[1,5]")] == ["a5", "a1"]
    assert calls[0] == ("show", "hostnames", "a[1,5]")


def test_read_named_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The messages a user reads when the named nodes cannot all be used."""
    _fake_scontrol(monkeypatch, hostnames="  \n")
    with pytest.raises(PlanValidationError) as e:
        read_slurm_nodes(nodes="b[1-2]")
    assert e.value.problems == [("nodes", "'b[1-2]' names no node")] and e.value.what == "cluster from Slurm"
    _fake_scontrol(monkeypatch, hostnames="a1 zz yy")
    with pytest.raises(PlanValidationError) as e:
        read_slurm_nodes(nodes="x")
    assert e.value.problems == [("nodes", "Slurm has no node zz, yy")] and e.value.what == "cluster from Slurm"
    _fake_scontrol(monkeypatch, hostnames="a1 a2 a5")
    with pytest.raises(PlanValidationError) as e:
        read_slurm_nodes(partition="gpu", nodes="x")
    assert e.value.problems == [("nodes", "a2 not in partition 'gpu'")] and e.value.what == "cluster from Slurm"
    _fake_scontrol(monkeypatch, hostnames="a3 a1 a4")
    with pytest.raises(PlanValidationError) as e:
        read_slurm_nodes(nodes="x")
    assert e.value.problems == [("nodes.a3", "cannot run a job now: state DOWN* (dead [x@1])"),
                                ("nodes.a4", "cannot run a job now: state IDLE+DRAIN (maint)")]
    assert e.value.what == "cluster from Slurm"
    _fake_scontrol(monkeypatch, nodes="NodeName=d1 CPUTot=1 RealMemory=1 State=DOWN\n", hostnames="d1")
    with pytest.raises(PlanValidationError) as e:
        read_slurm_nodes(nodes="d1")
    assert e.value.problems == [("nodes.d1", "cannot run a job now: state DOWN")]


def test_read_no_usable_node_names_where(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_scontrol(monkeypatch)
    with pytest.raises(PlanValidationError) as e:
        read_slurm_nodes(partition="none")
    assert e.value.problems == [("partition", "no usable Slurm node in partition 'none'")]
    assert e.value.what == "cluster from Slurm"
    _fake_scontrol(monkeypatch, nodes="NodeName=d1 CPUTot=1 RealMemory=1 State=DOWN\n")
    with pytest.raises(PlanValidationError) as e:
        read_slurm_nodes()
    assert e.value.problems == [("nodes", "no usable Slurm node in the cluster")]
    assert e.value.what == "cluster from Slurm"


# ---- the nodes of Cluster.from_slurm -------------------------------------------------------------------------------
def test_cluster_nodes_ranks_kinds_cores_and_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks numbered across nodes in order (a node without GPU GRES: one rank), the kind from the GRES or a
    feature, cores and memory only where Slurm gives a positive figure."""
    _fake_scontrol(monkeypatch, NODES + "NodeName=a6 CPUTot=-1 RealMemory=-5 State=IDLE Gres=gpu:1\n"
                   "NodeName=a7 CPUTot=1 RealMemory=1 State=IDLE\nNodeName=a8 CPUTot=0 RealMemory=2 State=IDLE\n")
    got = slurm_cluster_nodes(known=("cpu", "H800", "H20"))
    assert got == [
        {"host": "a1", "kind": "H800", "ranks": [0, 1], "cpus": 16, "memory_mb": 64000},
        {"host": "a2", "kind": "cpu", "ranks": [2], "cpus": 8, "memory_mb": None},
        {"host": "a5", "kind": "H20", "ranks": [3, 4, 5], "cpus": 4, "memory_mb": 1000},
        {"host": "a6", "kind": "cpu", "ranks": [6], "cpus": None, "memory_mb": None},
        {"host": "a7", "kind": "cpu", "ranks": [7], "cpus": 1, "memory_mb": 1},
        {"host": "a8", "kind": "cpu", "ranks": [8], "cpus": None, "memory_mb": 2},
    ]
    assert [n["host"] for n in slurm_cluster_nodes("gpu")] == ["a1", "a5"]  # a6-a8: in no partition
    assert slurm_cluster_nodes()[2]["kind"] == "cpu"  # default known kinds: cpu only, H20 is no kind then


def test_cluster_nodes_of_named_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_scontrol(monkeypatch, hostnames="a5")
    assert slurm_cluster_nodes(nodes=["a5"], known=("H20",)) == [
        {"host": "a5", "kind": "H20", "ranks": [0, 1, 2], "cpus": 4, "memory_mb": 1000}]
