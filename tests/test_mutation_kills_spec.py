"""Kills for the mutants of hspmd_sdk/runtime/spec.py (issue 49): the launch spec's checks and their messages,
its JSON line, ``local_rank``, ``backend_for`` and ``resolve_entry``.  All in-process and fast."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from hspmd_sdk.runtime.spec import LaunchSpec, backend_for, resolve_entry


def _spec(**kw) -> LaunchSpec:
    base = dict(job_id="j", world_size=3, ranks=[0, 1, 2], hosts=["a", "b", "a"], devices=["cpu"] * 3,
                master_addr="127.0.0.1", master_port=2900, backend="gloo", entry="m:f")
    return LaunchSpec(**{**base, **kw})


def _error(**kw) -> str:
    with pytest.raises(ValidationError) as e:
        _spec(**kw)
    return str(e.value)


def test_spec_silent_s_is_ten_heartbeats() -> None:
    """A side unheard for SILENT_BEATS (10) heartbeat periods is lost."""
    assert _spec().silent_s == 10.0
    assert _spec(heartbeat_s=0.25, stall_s=None).silent_s == 2.5


def test_spec_ranks_must_be_the_range_in_order() -> None:
    """The rank list is exactly 0..n-1; the message names the range and what was given."""
    assert "ranks: must be 0..2 in order, got [0, 2, 1]" in _error(ranks=[0, 2, 1])
    assert "ranks: must be 0..2 in order, got [1, 2, 3]" in _error(ranks=[1, 2, 3])


def test_spec_hosts_and_devices_need_one_entry_per_rank() -> None:
    """Each of ``hosts`` and ``devices`` is checked, and its message names it and both lengths."""
    assert "hosts: needs one entry per rank (3), got 2" in _error(hosts=["a", "b"])
    assert "devices: needs one entry per rank (3), got 4" in _error(devices=["cpu"] * 4)


def test_spec_slowdown_ranks_factors_and_steps() -> None:
    """A slowdown names a rank of the job (0..n-1 inclusive); its factor is >= 1 (1 allowed) from a step >= 0 (0
    allowed), as a single number (int or float) or a schedule."""
    assert _spec(slowdown={0: 1, 2: 2.5}).slowdown == {0: 1, 2: 2.5}
    assert _spec(slowdown={1: [(0, 1.0), (3, 2.0)]}).slowdown == {1: [(0, 1.0), (3, 2.0)]}
    assert "slowdown: rank 3 is not in the job (0..2)" in _error(slowdown={3: 2.0})
    assert "slowdown: rank -1 is not in the job (0..2)" in _error(slowdown={-1: 2.0})
    assert ("slowdown[1]: factor 0.5 (from step 0) must be >= 1 (1 = real speed) from a step >= 0"
            in _error(slowdown={1: 0.5}))
    assert ("slowdown[2]: factor 0.0 (from step 0) must be >= 1 (1 = real speed) from a step >= 0"
            in _error(slowdown={2: 0}))
    assert ("slowdown[0]: factor 2.0 (from step -1) must be >= 1 (1 = real speed) from a step >= 0"
            in _error(slowdown={0: [(0, 1.0), (-1, 2.0)]}))
    assert "slowdown[0]: factor 0.9 (from step 4)" in _error(slowdown={0: [(0, 1.0), (4, 0.9)]})


def test_spec_loss_rank_must_be_in_the_job() -> None:
    """``loss_rank`` in 0..n-1 (both ends allowed), or None."""
    assert _spec(loss_rank=0).loss_rank == 0 and _spec(loss_rank=2).loss_rank == 2
    assert _spec().loss_rank is None
    assert "loss_rank: rank 3 is not in the job (0..2)" in _error(loss_rank=3)
    assert "loss_rank: rank -1 is not in the job (0..2)" in _error(loss_rank=-1)


def test_spec_stall_needs_two_heartbeats() -> None:
    """``stall_s`` at least 2 heartbeats (exactly 2 allowed), or None; the message prints both with :g."""
    assert _spec(heartbeat_s=2.0, stall_s=4.0).stall_s == 4.0
    assert _spec(heartbeat_s=30.0, stall_s=None).stall_s is None
    assert "stall_s: 3.5 s must be at least two heartbeats (heartbeat_s=2)" in _error(heartbeat_s=2.0, stall_s=3.5)


def test_spec_line_round_trip() -> None:
    """One line of JSON with its newline; read back equal (the secret included)."""
    spec = _spec(slowdown={1: 2.0}, payload={"x": [1, 2]})
    line = spec.to_line()
    assert line.endswith("}\n") and line.count("\n") == 1
    back = LaunchSpec.from_line(line)
    assert back == spec and back.secret == spec.secret


def test_spec_local_rank_counts_earlier_ranks_of_the_same_host() -> None:
    """The CUDA device index: ranks before it on its host."""
    spec = _spec(world_size=5, ranks=list(range(5)), hosts=["a", "b", "a", "a", "b"], devices=["cpu"] * 5)
    assert [spec.local_rank(r) for r in range(5)] == [0, 0, 1, 2, 1]


def test_spec_backend_for_kinds() -> None:
    """gloo for CPUs only, nccl for GPUs only, an error naming the kinds for a mix (or for no device)."""
    assert backend_for(["cpu", "cpu"]) == "gloo"
    assert backend_for({"H800", "A100"}) == "nccl"
    with pytest.raises(ValueError) as e:
        backend_for(["cpu", "H800", "cpu"])
    assert str(e.value) == ("cannot run one job on both CPU and GPU devices (kinds: ['H800', 'cpu']); launch on a "
                            "cluster of one sort")
    with pytest.raises(ValueError, match=r"\(kinds: \[\]\)"):
        backend_for([])


def test_spec_resolve_entry_imports_and_names_what_failed() -> None:
    """The function itself; a module that does not import, a missing name and a name that is no function each get
    their message."""
    assert resolve_entry("os.path:join") is __import__("os").path.join
    with pytest.raises(ImportError) as e:
        resolve_entry("no_such_module_xyz:f")
    assert str(e.value).startswith("entry 'no_such_module_xyz:f': cannot import module 'no_such_module_xyz' (")
    assert str(e.value).endswith("); the module must be importable by the worker's Python (installed, or on "
                                 "PYTHONPATH)")
    assert isinstance(e.value.__cause__, ImportError)
    with pytest.raises(AttributeError) as e:
        resolve_entry("os.path:no_such_fn")
    assert str(e.value) == "entry 'os.path:no_such_fn': module 'os.path' has no function 'no_such_fn'"
    with pytest.raises(AttributeError, match="module 'os' has no function 'sep'"):
        resolve_entry("os:sep")  # an attribute, but not callable


def test_spec_rank_payloads_go_to_their_ranks_only() -> None:
    """``with_rank_payload``: worker ``r``'s line carries ``payload_of(r)``, the spec itself (and its JSON line)
    keeps the launcher's payload, the original spec is not changed; without one every line is ``to_line()``; a rank
    outside the job is refused naming the range."""
    spec = _spec(payload={"runs": ["whole"]})
    assert spec.line_for(1) == spec.to_line()
    parts = spec.with_rank_payload(lambda r: {"runs": [f"part {r}"]})
    assert parts is not spec and parts.payload == {"runs": ["whole"]} and parts.to_line() == spec.to_line()
    for r in range(3):
        line = parts.line_for(r)
        assert line.endswith("\n") and line.count("\n") == 1
        got = LaunchSpec.from_line(line)
        assert got.payload == {"runs": [f"part {r}"]}
        assert got.model_copy(update={"payload": spec.payload}) == spec
    assert spec.line_for(2) == spec.to_line()  # the original keeps no per-rank payload
    for bad in (-1, 3):
        with pytest.raises(ValueError, match=rf"line_for: rank {bad} is not in the job \(0\.\.2\)"):
            parts.line_for(bad)
    assert spec.with_rank_payload(None).line_for(0) == spec.to_line()


def test_spec_line_writes_per_rank_lists_as_runs() -> None:
    """On the wire the per-rank lists do not grow with the world: hosts and devices as runs of equal neighbours,
    ranks as their count; read back, the lists themselves (a plain list is read as it is)."""
    import json

    spec = _spec(world_size=6, ranks=list(range(6)), hosts=["a", "a", "b", "b", "b", "a"],
                 devices=["H800", "H800", "H800", "H20", "H20", "H20"])
    raw = json.loads(spec.to_line())
    assert raw["hosts"] == {"runs": [["a", 2], ["b", 3], ["a", 1]]}
    assert raw["devices"] == {"runs": [["H800", 3], ["H20", 3]]} and raw["ranks"] == {"count": 6}
    back = LaunchSpec.from_line(spec.to_line())
    assert (back.hosts, back.devices, back.ranks) == (spec.hosts, spec.devices, spec.ranks)
    assert spec.model_dump()["hosts"] == spec.hosts  # in Python the lists as they are
    plain = json.dumps({**raw, "hosts": spec.hosts, "devices": spec.devices, "ranks": spec.ranks})
    assert LaunchSpec.from_line(plain) == back
    one = json.loads(_spec(world_size=1, ranks=[0], hosts=["h"], devices=["cpu"]).to_line())
    assert (one["hosts"], one["ranks"]) == ({"runs": [["h", 1]]}, {"count": 1})
