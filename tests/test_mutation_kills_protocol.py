"""Kills for the mutants of hspmd_sdk/runtime/protocol.py (issue 49): the worker <-> launcher wire format, exactly.

Every test here is in-process and fast (no worker is launched); each name starts with ``test_protocol_`` so that
the module's mutation config can select them with ``-k protocol``.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from hspmd_sdk import Cluster, LlamaConfig, Strategy, specialize
from hspmd_sdk.core.program_json import ProgramJSONError
from hspmd_sdk.core.strategy_plan import plan_from_strategy
from hspmd_sdk.errors import PlanValidationError
from hspmd_sdk.runtime import protocol
from hspmd_sdk.runtime.protocol import (Channel, LineReader, LineWriter, Reconfigure, adam_json, control_line,
                                        decode, encode, is_collateral, jsonable, pack_payload, program_of_run,
                                        training_of, unpack_payload)
from hspmd_sdk.runtime.train_config import TrainConfig


def _read_all(fd: int) -> bytes:
    out = b""
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return out
        out += chunk


# ---- encode / control_line / decode ---------------------------------------------------------------------------
def test_protocol_encode_writes_the_exact_line() -> None:
    """The prefix, compact JSON with ``t``, ``rank``, ``time`` first, then the fields, one trailing newline."""
    before = time.time()
    line = encode("metric", 3, step=2, loss=1.5)
    after = time.time()
    assert line.startswith('@hspmd {"t":"metric","rank":3,"time":')
    assert line.endswith(',"step":2,"loss":1.5}\n')
    msg = json.loads(line[len("@hspmd "):])
    assert list(msg) == ["t", "rank", "time", "step", "loss"]
    assert before <= msg["time"] <= after
    assert " " not in line[len("@hspmd "):]  # compact separators


def test_protocol_encode_turns_arrays_and_sets_into_lists() -> None:
    """Fields that JSON cannot hold go through the same default as :func:`jsonable`."""
    line = encode("result", 0, value=np.arange(3), tags=("a", "b"))
    msg = decode(line)
    assert msg["value"] == [0, 1, 2] and msg["tags"] == ["a", "b"]


def test_protocol_control_line_is_compact_json_with_its_kind_first() -> None:
    """A launcher -> worker line: ``t`` first, compact, one newline."""
    assert control_line("ping") == '{"t":"ping"}\n'
    assert control_line("control", msg={"a": 1, "b": [1, 2]}) == '{"t":"control","msg":{"a":1,"b":[1,2]}}\n'


def test_a_message_encoded_once_gives_the_same_line() -> None:
    """The job encodes a control message once (``message_text``) and every transport writes that text as it is:
    byte for byte the line ``control_line`` writes of the message; what JSON cannot carry is refused there."""
    from hspmd_sdk.runtime.protocol import control_text_line, message_text

    for msg in ({"type": "switch", "id": 3, "grow": None}, {"s": "caf\u00e9 \"q\"", "x": [1.5, -0.0, {"k": []}]}, {}):
        assert message_text(msg) == json.dumps(msg, separators=(",", ":"))
        assert control_text_line(message_text(msg)) == control_line("control", msg=msg)
    with pytest.raises(TypeError):
        message_text({"n": object()})


def test_protocol_decode_reads_messages_and_refuses_everything_else() -> None:
    """Only a prefixed JSON object with a ``t`` is a message; anything else is a raw line (``None``)."""
    assert decode('@hspmd {"t":"beat","rank":1}') == {"t": "beat", "rank": 1}
    assert decode('@hspmd {"t":"beat"}\n') == {"t": "beat"}
    assert decode('{"t":"beat"}') is None                  # no prefix
    assert decode('x@hspmd {"t":"beat"}') is None          # the prefix not at the start
    assert decode('@hspmd{"t":"beat"}') is None            # the prefix without its space
    assert decode('@hspmd {"rank":1}') is None             # an object without a kind
    assert decode('@hspmd ["t"]') is None                  # not an object
    assert decode('@hspmd "t"') is None                    # a string containing t
    assert decode("@hspmd {not json") is None              # ValueError
    assert decode("@hspmd " + "[" * 100000 + "]" * 100000) is None  # RecursionError: nested too deeply


def test_protocol_decode_of_a_number_too_long_is_a_raw_line() -> None:
    """A number of more digits than int() converts raises ValueError inside json: a raw line, not a crash."""
    assert decode('@hspmd {"t":1' + "1" * 5000 + "}") is None


# ---- is_collateral --------------------------------------------------------------------------------------------
def test_protocol_collateral_markers_match_in_any_case() -> None:
    """The markers are matched case-insensitively, any one of them is enough."""
    assert is_collateral("RuntimeError: Connection Reset by peer")
    assert is_collateral("BROKEN PIPE")
    assert is_collateral("the op TIMED OUT after 30 s")
    assert not is_collateral("ValueError: shapes (3,) and (4,) differ")
    assert not is_collateral("")


# ---- jsonable / the JSON default ------------------------------------------------------------------------------
class _Odd:
    tolist = 5  # an attribute named tolist that is not callable: not an array

    def __repr__(self) -> str:
        return "<odd>"


def test_protocol_jsonable_converts_arrays_scalars_sets_and_the_rest_by_repr() -> None:
    """numpy arrays/scalars by ``tolist()``, sets and tuples as lists, anything else as its ``repr``."""
    assert jsonable({"a": np.array([[1, 2], [3, 4]]), "b": np.float32(0.5), "c": (1, 2)}) == \
        {"a": [[1, 2], [3, 4]], "b": 0.5, "c": [1, 2]}
    assert jsonable({"s": {3}, "f": frozenset({4})}) == {"s": [3], "f": [4]}
    assert jsonable([_Odd()]) == ["<odd>"]
    assert jsonable({"x": object.__new__(_Odd)}) == {"x": "<odd>"}


# ---- Channel / LineWriter -------------------------------------------------------------------------------------
def test_protocol_channel_writes_every_byte_even_when_os_write_is_partial(monkeypatch) -> None:
    """``send`` loops until the whole line is written; a write that takes 3 bytes at a time loses none."""
    r, w = os.pipe()
    real = os.write
    calls = []

    def short_write(fd, data):
        calls.append(len(data))
        return real(fd, bytes(data[:3]))

    monkeypatch.setattr(protocol.os, "write", short_write)
    ch = Channel(w, rank=7)
    ch.send("result", value={"k": "v"})
    monkeypatch.setattr(protocol.os, "write", real)
    os.close(w)
    data = _read_all(r)
    os.close(r)
    msg = decode(data.decode())
    assert msg["t"] == "result" and msg["rank"] == 7 and msg["value"] == {"k": "v"}
    assert data.endswith(b"}\n") and data.count(b"\n") == 1
    assert calls[0] == len(data) and calls[1] == len(data) - 3  # each call gets what is left


def test_protocol_channel_sends_any_text_and_logs_to_stdout_by_default() -> None:
    """A lone surrogate (from a badly decoded byte) travels escaped and comes back as it was; ``log``'s default
    stream is ``stdout``."""
    r, w = os.pipe()
    ch = Channel(w, rank=2)
    ch.log("bad \udc80 byte")
    ch.log("to err", "stderr")
    os.close(w)
    lines = _read_all(r).decode().splitlines()
    os.close(r)
    first, second = (decode(x) for x in lines)
    assert first["t"] == "log" and first["stream"] == "stdout" and first["rank"] == 2
    assert first["text"] == "bad \udc80 byte"
    assert second["stream"] == "stderr" and second["text"] == "to err"


def test_protocol_line_writer_is_a_writable_non_tty_stream() -> None:
    """It says it is writable and no terminal, returns the length written, and a flush with nothing pending sends
    nothing; the stream name travels in each message."""
    r, w = os.pipe()
    writer = LineWriter(Channel(w, rank=1), "stderr")
    assert writer.writable() is True and writer.isatty() is False
    assert writer.write("ab\ncd") == 5
    assert writer.write("") == 0
    writer.flush()
    writer.flush()  # nothing left: no empty message
    assert writer.write("\n") == 1  # an empty line is still a line
    os.close(w)
    msgs = [decode(x) for x in _read_all(r).decode().splitlines()]
    os.close(r)
    assert [(m["stream"], m["text"]) for m in msgs] == [("stderr", "ab"), ("stderr", "cd"), ("stderr", "")]


# ---- LineReader -----------------------------------------------------------------------------------------------
def test_protocol_line_reader_keeps_the_rest_for_the_next_line() -> None:
    """Several lines in one read come back one a call; what follows the last newline is returned at end of file,
    then ``b""``."""
    r, w = os.pipe()
    os.write(w, b"spec\nctl1\nctl2\ntail")
    os.close(w)
    reader = LineReader(r)
    assert reader.readline() == b"spec\n"
    assert reader.readline() == b"ctl1\n"
    assert reader.readline() == b"ctl2\n"
    assert reader.readline() == b"tail"
    assert reader.readline() == b""
    os.close(r)


def test_protocol_line_reader_joins_a_line_split_across_reads() -> None:
    """A line that arrives in two writes is returned whole."""
    r, w = os.pipe()
    reader = LineReader(r)
    os.write(w, b"hal")
    import threading

    t = threading.Timer(0.05, lambda: (os.write(w, b"f\nnext"), os.close(w)))
    t.start()
    assert reader.readline() == b"half\n"
    t.join()
    assert reader.readline() == b"next"
    os.close(r)


def test_protocol_line_reader_treats_a_read_error_as_end_of_file() -> None:
    """An ``os.read`` that fails (a closed descriptor) ends the stream with what was buffered."""
    r, w = os.pipe()
    os.close(w)
    os.close(r)
    assert LineReader(r).readline() == b""


# ---- payloads, Reconfigure, runs ------------------------------------------------------------------------------
def _tiny():
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(2)
    strategy = Strategy.load({"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, 3]}],
                                             "micro_batch_size": 2, "num_micro_batches": 1}]})
    plan = plan_from_strategy(model, strategy, cluster)
    return model, plan, cluster, specialize(model, plan, cluster, bindings={"B": 2, "S": 16})


@pytest.fixture(scope="module")
def tiny():
    return _tiny()


def test_protocol_payload_round_trips_and_names_its_format(tiny) -> None:
    """pack_payload writes compact JSON tagged with the Program format; unpack_payload reads it back equal."""
    _, _, _, program = tiny
    text = pack_payload((program, None))
    data = json.loads(text)
    assert data["format"] == "hspmd-program/1" and list(data)[0] == "format"
    assert ": " not in text and ", " not in text
    back, none = unpack_payload(text)
    assert back == program and none is None


def test_protocol_unpack_refuses_another_format_with_its_message(tiny) -> None:
    """A payload of another format, or not an object, is refused with a message naming the expected format."""
    msg = "a control message's payload is not of format 'hspmd-program/1'"
    text = pack_payload((tiny[3], None))
    other = json.dumps({**json.loads(text), "format": "hspmd-program/0"})
    with pytest.raises(ProgramJSONError) as e:
        unpack_payload(other)
    assert str(e.value) == msg
    with pytest.raises(ProgramJSONError) as e:
        unpack_payload("[1, 2]")
    assert str(e.value) == msg
    with pytest.raises(ProgramJSONError) as e:
        unpack_payload(json.dumps({k: v for k, v in json.loads(text).items() if k != "format"}))
    assert str(e.value) == msg


def test_protocol_reconfigure_decodes_every_field(tiny) -> None:
    """Every field with its type: string keys to ints, numbers from strings, the payload unpacked."""
    program = tiny[3]
    msg = {"id": "4", "world": "3", "ranks": {"0": "1", "2": 0}, "src_ranks": {"0": 2, "2": "1"},
           "master_addr": 5, "master_port": "2900", "resume_step": "11",
           "payload": pack_payload((program, program.plan)),
           "source": "memory", "offer": {"0": "live", "2": "previous"}, "finish": ["2", 0],
           "checkpoint": {"dir": "/x"}, "switch_floor": "3", "retake_checkpoint": 1}
    rc = Reconfigure.decode(msg)
    assert rc.plan == program.plan and rc.plan is not None
    assert rc == Reconfigure(4, 3, {0: 1, 2: 0}, {0: 2, 2: 1}, "5", 2900, 11, program, program.plan, "memory",
                             {0: "live", 2: "previous"}, [2, 0], {"dir": "/x"}, 3, True)
    assert type(rc.master_addr) is str and rc.retake_checkpoint is True


def test_protocol_reconfigure_defaults_of_its_optional_fields(tiny) -> None:
    """``offer``, ``finish``, ``checkpoint``, ``switch_floor`` and ``retake_checkpoint`` may be absent (or
    ``offer`` null)."""
    msg = {"id": 1, "world": 2, "ranks": {}, "src_ranks": {}, "master_addr": "h", "master_port": 1,
           "resume_step": 0, "payload": pack_payload((tiny[3], None)), "source": "checkpoint"}
    for extra in ({}, {"offer": None}):
        rc = Reconfigure.decode({**msg, **extra})
        assert rc.offer == {} and rc.finish == [] and rc.checkpoint is None
        assert rc.switch_floor == 0 and rc.retake_checkpoint is False
        assert type(rc.retake_checkpoint) is bool and type(rc.switch_floor) is int


def test_protocol_program_of_run_reads_the_json_or_specializes(tiny) -> None:
    """With ``run["program"]`` the Program is read from it; without (or null), it is specialized from the run's
    model (by its class path, or by its family tag without one), plan, cluster and bindings."""
    from hspmd_sdk.core.model_spec import model_json
    from hspmd_sdk.models.registry import class_path

    model, plan, cluster, program = tiny
    assert program_of_run({"program": program.to_json()}) == program
    run = {"config": model_json(model), "model_class": class_path(model), "plan": plan.model_dump(mode="json"),
           "cluster": cluster.model_dump(mode="json"), "bindings": {"B": 2, "S": 16}}
    assert program_of_run(run) == program
    assert program_of_run({**run, "program": None}) == program
    assert program_of_run({k: v for k, v in run.items() if k != "model_class"}) == program
    unbound = program_of_run({k: v for k, v in run.items() if k != "bindings"})
    assert unbound.bindings != program.bindings
    # the class path is what reads the config when given: one that does not import is an error naming it
    with pytest.raises(PlanValidationError, match="cannot import the model config class 'no_such_mod:Cfg'"):
        program_of_run({**run, "model_class": "no_such_mod:Cfg"})


def test_protocol_training_of_reads_and_validates_the_train_json() -> None:
    """The worker's TrainConfig comes from ``run["train"]``; a bad value fails naming the field."""
    cfg = TrainConfig.from_launch_kwargs(steps=5, lr=0.25, weight_decay=0.5)
    got = training_of({"train": cfg.to_json()})
    assert got == cfg and got.optimizer.lr == 0.25
    bad = json.loads(cfg.to_json())
    bad["optimizer"]["lr"] = "fast"
    with pytest.raises(PlanValidationError, match="lr"):
        training_of({"train": json.dumps(bad)})


def test_protocol_adam_json_records_the_optimizer_section() -> None:
    """Exactly the six keys a checkpoint manifest records, betas as a list."""
    cfg = TrainConfig.from_launch_kwargs(steps=1, lr=0.125, betas=(0.5, 0.75), eps=1e-6, weight_decay=0.25,
                                         decay="all", optimizer="adam")
    assert adam_json(cfg) == {"lr": 0.125, "betas": [0.5, 0.75], "eps": 1e-6, "weight_decay": 0.25, "decay": "all",
                              "kind": "adam"}


def test_protocol_part_payloads_give_each_rank_its_part() -> None:
    """``PartPayloads``: each run that can send parts gets ``"program": None`` and that rank's part's JSON
    (``part_json``); a run with a whole-Program feature, and a rank outside the Program, keep the run as it was;
    other keys of the payload and of the run travel unchanged; ``program_of_run`` reads a part back for its rank."""
    from hspmd_sdk import Cluster, GPTConfig, Strategy
    from hspmd_sdk.core.program_part import part_json
    from hspmd_sdk.core.specialize import ProgramPart, specialize
    from hspmd_sdk.core.strategy_plan import plan_from_strategy
    from hspmd_sdk.runtime.protocol import PartPayloads, program_of_run

    model, cluster = GPTConfig.preset("tiny"), Cluster.local(3)
    strategy = Strategy.load({"pipelines": [{"stages": [{"devices": [r], "layers": [0, 3]}], "micro_batch_size": 1,
                                             "num_micro_batches": 1} for r in range(2)]})
    program = specialize(model, plan_from_strategy(model, strategy, cluster), cluster)
    text = program.to_json()
    plain = {"program": text, "steps": 2, "seed": 5}
    whole = {"program": text, "steps": 2, "checkpoint": {"dir": "x"}}
    payload = {"runs": [whole, plain], "extra": [1, 2]}  # a whole run first: the next run still gets its part
    parts = PartPayloads.of(payload)
    assert parts is not None and parts.payload is payload
    for rank in (0, 1):
        got = parts(rank)
        assert got["extra"] == [1, 2] and len(got["runs"]) == 2
        kept, run = got["runs"]
        assert kept is whole
        assert run == {"program": None, "program_part": part_json(program, rank), "steps": 2, "seed": 5}
        part = program_of_run(run)
        assert isinstance(part, ProgramPart) and part.rank == rank and part.digest() == program.digest()
    assert parts(2)["runs"] == [whole, plain]  # rank 2 runs nothing of the Program: the whole run
    assert payload["runs"][1] is plain and plain["program"] == text  # the launcher's payload is untouched


# ---- the Program and switch plan in control messages (issue 47: the controller's one send path) ----------------
def _switch_pair():
    """A 2-rank Program, another of the same model (pipelines of one rank each), and the plan between them."""
    from hspmd_sdk.core.reconfigure import plan_program_switch

    model, plan, cluster, program = _tiny()
    other_strategy = Strategy.load({"pipelines": [{"stages": [{"devices": [r], "layers": [0, 3]}],
                                                   "micro_batch_size": 1, "num_micro_batches": 1} for r in range(2)]})
    other = specialize(model, plan_from_strategy(model, other_strategy, cluster), cluster, bindings={"B": 2, "S": 16})
    return program, other, plan_program_switch(program, other, cluster)


def test_protocol_compact_payloads_pack_their_runs_and_read_back_equal(tiny) -> None:
    """``compact=True`` wraps the value as ``{"format", "packed": <pack_json text>}``; the default writes the value's
    own keys beside the format.  Both read back equal (the packed one through ``unpack_json``)."""
    from hspmd_sdk.core.program_part import pack_json
    from hspmd_sdk.core.program_json import to_json_value

    program = tiny[3]
    plain, packed = pack_payload((program, None)), pack_payload((program, None), compact=True)
    assert "packed" not in json.loads(plain)
    data = json.loads(packed)
    assert list(data) == ["format", "packed"] and data["packed"] == pack_json(to_json_value((program, None)))
    for text in (plain, packed):
        back, none = unpack_payload(text)
        assert back == program and none is None


def test_protocol_switch_messages_carry_the_whole_or_each_ranks_parts() -> None:
    """``switch_message``: ``type``, ``id`` and the whole of Program and plan (``payload``) without a rank; with a
    rank, that rank's ``program_part`` (the Program's part at ``version=id``) and ``plan_part`` (the plan's part of
    that rank); ``switch_of`` reads both forms back."""
    from hspmd_sdk.core.program_part import PlanParts, part_json
    from hspmd_sdk.core.specialize import ProgramPart

    _, program, plan = _switch_pair()
    whole = protocol.switch_message(7, program, plan)
    assert set(whole) == {"type", "id", "payload"} and (whole["type"], whole["id"]) == ("switch", 7)
    got_program, got_plan = protocol.switch_of(whole)
    assert got_program == program and got_plan == plan
    mine = protocol.switch_message(7, program, plan, rank=1)
    assert set(mine) == {"type", "id", "program_part", "plan_part"} and (mine["type"], mine["id"]) == ("switch", 7)
    assert mine["program_part"] == part_json(program, 1, version=7)
    assert mine["plan_part"] == PlanParts(plan).json(1)
    part, plan_part = protocol.switch_of(mine)
    assert isinstance(part, ProgramPart) and part.rank == 1 and part.version == 7
    assert plan_part == plan.part(1)


def test_protocol_program_fields_choose_parts_only_with_a_rank_a_plan_and_a_rank_inside() -> None:
    """Parts only for a rank with a plan: without a rank, without a plan (a reload from a checkpoint), or for a rank
    outside the new Program, the whole; ``plan_rank`` numbers the plan's part (default: the rank); given
    ``plan_parts`` are the ones used."""
    from hspmd_sdk.core.program_part import PlanParts

    _, program, plan = _switch_pair()
    for rank, p in ((None, plan), (1, None), (5, plan)):
        got = protocol.program_fields(program, p, rank)
        assert set(got) == {"payload"} and protocol.unpack_payload(got["payload"]) == (program, p)
    from hspmd_sdk.core.program_part import part_json

    assert protocol.program_fields(program, plan, 1)["program_part"] == part_json(program, 1, version=0)
    mixed = protocol.program_fields(program, plan, 1, plan_rank=0)
    assert mixed["plan_part"] == PlanParts(plan).json(0) != PlanParts(plan).json(1)

    class Seen(PlanParts):
        asked: list[int] = []

        def json(self, rank: int) -> str:
            Seen.asked.append(rank)
            return "given"

    got = protocol.program_fields(program, plan, 0, plan_parts=Seen(plan))
    assert got["plan_part"] == "given" and Seen.asked == [0]


def test_protocol_part_payloads_go_on_after_a_rank_outside_one_run() -> None:
    """A rank outside the first run's Program keeps that run whole and still gets its part of the next run."""
    from hspmd_sdk import GPTConfig
    from hspmd_sdk.runtime.protocol import PartPayloads

    model = GPTConfig.preset("tiny")
    one, two = Cluster.local(1), Cluster.local(2)
    small = specialize(model, plan_from_strategy(model, Strategy.load({"pipelines": [
        {"stages": [{"devices": [0], "layers": [0, 3]}], "micro_batch_size": 1, "num_micro_batches": 1}]}), one), one)
    big = specialize(model, plan_from_strategy(model, Strategy.load({"pipelines": [
        {"stages": [{"devices": [r], "layers": [0, 3]}], "micro_batch_size": 1, "num_micro_batches": 1}
        for r in range(2)]}), two), two)
    payload = {"runs": [{"program": small.to_json(), "steps": 1}, {"program": big.to_json(), "steps": 1}]}
    runs = PartPayloads(payload)(1)["runs"]
    assert runs[0] == payload["runs"][0]  # rank 1 is outside: the whole run
    assert runs[1]["program"] is None and runs[1]["program_part"]  # and the next run's part all the same
