"""The two channels between a worker and its launcher: one JSON message a line each way.

Worker -> launcher (the worker's stdout): a message line is ``@hspmd {"t": KIND, "rank": R, "time": T, ...}``.
Kinds:

- ``hello``: the worker started (``pid``, ``host``);
- ``ready``: the worker joined the job's process group (its entry starts now);
- ``beat``: a heartbeat, sent by a thread of its own every ``spec.heartbeat_s`` seconds, so a long kernel still
  beats; ``comm_s``: how long the main thread has been waiting in communication (a ``torch.distributed`` call or a
  ``wait()`` on its work), ``null`` when it is not -- the launcher tells a rank that hangs from the peers that wait
  for it by this marker (see :mod:`.job`);
- ``log``: one line of text the worker printed (``stream``: ``stdout``/``stderr``, ``text``);
- ``metric``: one step's metrics (see :class:`~hspmd_sdk.runtime.metrics.StepMetrics`);
- ``result``: the entry function's returned dict (``value``);
- ``error``: the entry failed (``type``, ``message``, ``traceback``, ``collateral``: whether it looks like a
  consequence of another rank's death, e.g. a closed connection).

Any other line the launcher receives (C-level output, a crash dump) is kept as a raw log line.  Each message is
written with one ``os.write`` under a lock, so lines never interleave mid-line.

Launcher -> worker (the worker's stdin): the first line is the :class:`~.spec.LaunchSpec`; every later line is a
control message, plain JSON (:func:`control_line`):

- ``{"t": "ping"}``: the launcher (or the host's agent) is alive; a worker that hears nothing at all for
  ``spec.silent_s`` seconds exits (``EXIT_ORPHANED``), as it does when its stdin closes;
- ``{"t": "control", "msg": {...}}``: a message for the entry, delivered by ``WorkerState.poll_control()``;
- ``{"t": "dump"}``: write the stacks of every thread (faulthandler) to stderr.

The values inside control messages: a Program (or a switch plan) travels as its JSON (:func:`pack_payload`,
:func:`unpack_payload`); a ``reconfigure`` message decodes to :class:`Reconfigure`; a run (the dict a launcher
sends each worker) carries its Program as JSON, or that worker's part of it (SPEC §16: :class:`PartPayloads`,
:func:`program_of_run`).
"""
from __future__ import annotations

import io
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from ..models.registry import model_from_class

if TYPE_CHECKING:
    from ..core.program_part import PlanParts
    from ..core.specialize import Program
    from ..core.switch import SwitchPlan
    from .train_config import TrainConfig

PREFIX = "@hspmd "

#: Exit status of a worker whose entry raised (it sent an ``error`` message first).
EXIT_FAILED = 1
#: Exit status of a worker whose stdin closed or whose launcher fell silent: the job was stopped or its launcher
#: went away.
EXIT_ORPHANED = 3

#: Substrings of errors that a surviving rank raises when a peer died (gloo, NCCL, the rendezvous store).
_COLLATERAL_MARKERS = ("connection closed by peer", "connection reset", "broken pipe", "socket closed",
                       "remote process exited", "nccl communicator was aborted", "connection refused",
                       "recvbytes", "sendbytes", "read error", "write error", "timed out", "timeout",
                       "broken promise", "end of file")


def encode(kind: str, rank: int, **fields: Any) -> str:
    """One protocol line (with the trailing newline)."""
    msg = {"t": kind, "rank": rank, "time": time.time(), **fields}
    return PREFIX + json.dumps(msg, default=_json_default, separators=(",", ":")) + "\n"


def control_line(kind: str, **fields: Any) -> str:
    """One launcher -> worker line (with the trailing newline)."""
    return json.dumps({"t": kind, **fields}, separators=(",", ":")) + "\n"


def message_text(msg: Mapping[str, Any]) -> str:
    """A control message as the compact JSON text lines carry it: encoded once by the job, written as it is by
    every transport (:func:`control_text_line`); ``TypeError`` / ``ValueError`` for what JSON cannot carry."""
    return json.dumps(msg, separators=(",", ":"))


def control_text_line(text: str) -> str:
    """``control_line("control", msg=msg)`` of a message already encoded by :func:`message_text` (the same bytes,
    without encoding the message again: a switch's part of a rank is ~200 KB)."""
    return '{"t":"control","msg":' + text + "}\n"


def decode(line: str) -> dict[str, Any] | None:
    """The message of a protocol line, or ``None`` for a raw text line."""
    if not line.startswith(PREFIX):
        return None
    try:
        msg = json.loads(line[len(PREFIX):])
    except (ValueError, RecursionError):  # not JSON, a number too long, nested too deeply: a raw line
        return None
    return msg if isinstance(msg, dict) and "t" in msg else None


def is_collateral(message: str) -> bool:
    """Whether an error message looks like the consequence of *another* rank failing."""
    low = message.lower()
    return any(m in low for m in _COLLATERAL_MARKERS)


def jsonable(value: Any) -> Any:
    """``value`` with tensors and numpy values turned into lists and numbers (for results and metrics)."""
    return json.loads(json.dumps(value, default=_json_default))


def _json_default(obj: Any) -> Any:
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):  # torch.Tensor, numpy arrays and scalars
        return tolist()
    if isinstance(obj, (set, frozenset)):  # tuples never get here: json writes them as lists itself
        return list(obj)
    return repr(obj)


class Channel:
    """The worker's end: writes protocol lines to a file descriptor, one ``os.write`` per line, under a lock."""

    def __init__(self, fd: int, rank: int) -> None:
        self.fd = fd
        self.rank = rank
        self._lock = threading.Lock()

    def send(self, kind: str, **fields: Any) -> None:
        data = encode(kind, self.rank, **fields).encode("utf-8")  # ASCII: json.dumps escapes the rest
        with self._lock:
            view = memoryview(data)
            while view:
                n = os.write(self.fd, view)
                view = view[n:]

    def log(self, text: str, stream: str = "stdout") -> None:
        self.send("log", stream=stream, text=text)


class LineWriter(io.TextIOBase):
    """A text stream (for ``sys.stdout``/``sys.stderr``) that sends each complete line as a ``log`` message."""

    def __init__(self, channel: Channel, stream: str) -> None:
        super().__init__()
        self._channel = channel
        self._stream = stream
        self._buf = ""
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        with self._lock:
            self._buf += s
            *lines, self._buf = self._buf.split("\n")
        for line in lines:
            self._channel.log(line, self._stream)
        return len(s)

    def flush(self) -> None:
        with self._lock:
            rest, self._buf = self._buf, ""
        if rest:
            self._channel.log(rest, self._stream)

    def isatty(self) -> bool:
        return False


class LineReader:
    """Reads lines from a file descriptor with ``os.read`` (no buffering surprises with threads); the bytes after
    a line stay for the next call, so the spec and the control lines after it share one reader."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buf = bytearray()

    def readline(self) -> bytes:
        """The next line with its ``\\n``; at end of file what is left (``b""`` when nothing)."""
        while b"\n" not in self._buf:
            try:
                chunk = os.read(self.fd, 1 << 20)
            except OSError:
                chunk = b""
            if not chunk:
                rest, self._buf = bytes(self._buf), bytearray()
                return rest
            self._buf += chunk
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf = bytearray(rest)
        return line + b"\n"


def pack_payload(obj: Any, *, compact: bool = False) -> str:
    """Core values (a Program, a SwitchPlan, a tuple of them) as JSON text for a control message: the Program's
    own JSON form (:mod:`hspmd_sdk.core.program_json`; no pickle: reading it constructs only core value types),
    per-process caches left out.  Text, so that the message around it is encoded in one pass.  ``compact``: its
    lists' runs written compactly (:func:`~hspmd_sdk.core.program_part.pack_json`, as a Program part's are): a
    rank's part of a switch plan then does not grow with the world."""
    import json

    # lazy: core; agents, workers and the launcher import this module without loading core
    from ..core.program_json import FORMAT, to_json_value
    from ..core.program_part import pack_json

    value = to_json_value(obj)
    if compact:
        value = {"packed": pack_json(value)}
    return json.dumps({"format": FORMAT, **value}, separators=(",", ":"))


def unpack_payload(text: str) -> Any:
    """The values :func:`pack_payload` wrote."""
    import json

    # lazy: core; agents, workers and the launcher import this module without loading core
    from ..core.program_json import FORMAT, ProgramJSONError, from_json_value
    from ..core.program_part import unpack_json

    data = json.loads(text)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProgramJSONError(f"a control message's payload is not of format {FORMAT!r}")
    return from_json_value(unpack_json(data["packed"]) if "packed" in data else data)


def program_fields(program: "Program", plan: "SwitchPlan | None", rank: int | None = None,
                   plan_rank: int | None = None, *, version: int = 0, plan_parts: PlanParts | None = None) -> dict[str, Any]:
    """The fields of a control message that carry a new Program and the switch plan to it (a ``switch``, a grow's
    ``switch``, a ``reconfigure``): ``payload``, the whole of both; or, for a run whose workers hold their parts
    (SPEC §16; ``rank``: the worker's rank in the new Program, ``plan_rank``: its rank in the plan's numbering,
    default ``rank``), ``program_part`` and ``plan_part``, that worker's part of each -- their size does not grow
    with the world.  A rank outside the new Program, and a change without a plan (a reload from a checkpoint), get
    the whole.  ``plan_parts``: the :class:`~hspmd_sdk.core.program_part.PlanParts` of ``plan`` that writes its
    part, for a launcher that writes every worker's (what the parts share is written once); one for this call
    alone when not given.  :func:`switch_of` reads either."""
    if rank is not None and plan is not None:
        from ..core.program_part import PlanParts, ProgramPartError, part_json  # lazy: core

        parts = plan_parts if plan_parts is not None else PlanParts(plan)
        try:
            return {"program_part": part_json(program, rank, version=version),
                    "plan_part": parts.json(rank if plan_rank is None else plan_rank)}
        except ProgramPartError:
            pass
    return {"payload": pack_payload((program, plan))}


def switch_message(ident: int, program: "Program", plan: "SwitchPlan | None", rank: int | None = None
                   ) -> dict[str, Any]:
    """The ``switch`` control message to the new ``program`` by ``plan``: the whole of both, or that rank's part of
    each (``rank``: the worker's rank in the plan's numbering, which a switch keeps; :func:`program_fields`)."""
    return {"type": "switch", "id": ident, **program_fields(program, plan, rank, version=ident)}


def switch_of(msg: Mapping[str, Any]) -> tuple["Program", "SwitchPlan | None"]:
    """``(program, plan)`` of a ``switch`` message (:func:`switch_message`): parts or the whole."""
    if msg.get("program_part") is not None:
        from ..core.specialize import ProgramPart  # lazy: core

        return ProgramPart.from_json(msg["program_part"]), unpack_payload(msg["plan_part"])
    return unpack_payload(msg["payload"])


@dataclass
class Reconfigure:
    """A ``reconfigure`` message, decoded: the new world and what to switch to."""

    id: int
    world: int
    ranks: dict[int, int]          # launch rank -> new process rank (survivors only)
    src_ranks: dict[int, int]      # launch rank -> its rank in the switch's source numbering
    master_addr: str
    master_port: int
    resume_step: int
    program: "Program"
    plan: "SwitchPlan | None"
    source: str                    # "memory": switch from the state the survivors hold (``offer``);
                                   # "checkpoint": read the new Program's shards from ``checkpoint``
    offer: dict[int, str]          # launch rank -> what it switches from: "live" (its running state), "previous"
                                   # (the state it kept from before a switch), "nothing" (it only receives)
    finish: list[int]              # launch ranks that apply the step whose commit others completed
    checkpoint: dict[str, Any] | None = None  # :func:`~.checkpoint.resume_payload` of the checkpoint to reload
    switch_floor: int = 0          # switches up to this id are cancelled (requested before the failure)
    retake_checkpoint: bool = False  # the failure interrupted a checkpoint's write: save after the next step

    @classmethod
    def decode(cls, msg: Mapping[str, Any]) -> "Reconfigure":
        program, plan = switch_of(msg)  # parts, or the whole (:func:`program_fields`)
        return cls(int(msg["id"]), int(msg["world"]), {int(k): int(v) for k, v in msg["ranks"].items()},
                   {int(k): int(v) for k, v in msg["src_ranks"].items()}, str(msg["master_addr"]),
                   int(msg["master_port"]), int(msg["resume_step"]), program, plan, str(msg["source"]),
                   {int(k): str(v) for k, v in (msg.get("offer") or {}).items()}, [int(r) for r in msg.get("finish", ())], msg.get("checkpoint"), int(msg.get("switch_floor", 0)),
                   bool(msg.get("retake_checkpoint", False)))


def program_of_run(run: Mapping[str, Any]) -> "Program":
    """The run's Program as this worker runs it: its own part (``run["program_part"]``, a
    :class:`~hspmd_sdk.core.specialize.ProgramPart`'s JSON, how a launcher sends it where it can), the whole
    Program (``run["program"]``), or specialized from the run's model, plan and cluster (a run built without
    either)."""
    # lazy: core; agents, workers and the launcher import this module without loading core
    from ..core.cluster import Cluster
    from ..core.plan import AnnotationPlan
    from ..core.specialize import Program, specialize

    if run.get("program_part") is not None:
        from ..core.specialize import ProgramPart

        return ProgramPart.from_json(run["program_part"])
    if run.get("program") is not None:
        return Program.from_json(run["program"])

    config = model_from_class(run.get("model_class"), run["config"])
    plan = AnnotationPlan.model_validate(run["plan"])
    cluster = Cluster.model_validate(run["cluster"])
    return specialize(config, plan, cluster, bindings=run.get("bindings"))


#: Run keys whose features need the whole Program on every worker (checkpoints write and read by the whole
#: Program's layouts; a mixed-length run switches candidates).  An elastic run's recovery, grow and straggler
#: switches send each worker its parts (the launcher re-plans from the versions it keeps).
WHOLE_PROGRAM_FEATURES = ("checkpoint", "resume", "mixed")


def sends_parts(run: Mapping[str, Any]) -> bool:
    """Whether a worker of ``run`` can be launched with its own part of the Program (SPEC §16) instead of the
    whole: a training run with a Program and none of :data:`WHOLE_PROGRAM_FEATURES`."""
    return run.get("program") is not None and not any(run.get(k) for k in WHOLE_PROGRAM_FEATURES)


#: Run keys that a worker holding its part never reads, each as large as the world (the whole plan's annotations,
#: the cluster's nodes, the launcher's memory estimate of every rank): left out of the part's launch line.
LAUNCHER_ONLY = ("plan", "cluster", "memory_estimate")


class PartPayloads:
    """``payload`` (``{"runs": [...]}``, as the launcher sends it) for each rank: in every run that
    :func:`sends_parts`, ``"program"`` replaced by ``"program_part"``, that rank's part's JSON, and the keys of
    :data:`LAUNCHER_ONLY` left out, so that the line does not grow with the world (a rank that takes part in no
    operator of the Program gets the whole run).  Each run's Program is read from its JSON once, on the
    first call.  The callable :meth:`~.spec.LaunchSpec.with_rank_payload` takes."""

    def __init__(self, payload: Mapping[str, Any]) -> None:
        self.payload = payload
        self._programs: dict[int, Any] = {}

    @classmethod
    def of(cls, payload: Mapping[str, Any]) -> "PartPayloads | None":
        """The per-rank payloads of ``payload``, or ``None`` when no run of it can send parts."""
        runs = payload.get("runs") or ()
        return cls(payload) if any(isinstance(r, Mapping) and sends_parts(r) for r in runs) else None

    def __call__(self, rank: int) -> dict[str, Any]:
        from ..core.program_part import ProgramPartError, part_json  # lazy: core
        from ..core.specialize import Program

        runs = []
        for i, run in enumerate(self.payload["runs"]):
            if not sends_parts(run):
                runs.append(run)
                continue
            program = self._programs.get(i)
            if program is None:
                program = self._programs[i] = Program.from_json(run["program"])
                program.digest_is_that_of(run["program"])  # the launcher's Program.to_json(), read back equal
            try:
                part = part_json(program, rank)  # what every part holds alike is written once
            except ProgramPartError:  # a rank outside the Program: the whole (it only sits the run out)
                runs.append(run)
                continue
            runs.append({**{k: v for k, v in run.items() if k not in LAUNCHER_ONLY}, "program": None,
                         "program_part": part})
        return {**self.payload, "runs": runs}


def training_of(run: Mapping[str, Any]) -> "TrainConfig":
    """The run's training settings as the worker reads them: its :class:`~.train_config.TrainConfig` from the
    JSON the launcher sent (``run["train"]``), validated again here (a bad or foreign value fails in the worker
    with the field named, not deep in a step)."""
    from .train_config import TrainConfig  # lazy: pydantic models, not needed by every reader of this module

    return TrainConfig.from_json(run["train"])


def adam_json(train: "TrainConfig") -> dict[str, Any]:
    """A :class:`~.train_config.TrainConfig`'s optimizer section as a checkpoint's manifest records it."""
    o = train.optimizer
    return {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay, "decay": o.decay,
            "kind": o.kind}

