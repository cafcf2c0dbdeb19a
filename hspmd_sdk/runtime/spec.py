"""The launch spec: everything one worker process needs, in one JSON-serializable value.

The spec travels *with* the launch (a worker reads it as the first line of its stdin), so nothing has to exist on a
remote host beforehand.  Every worker of a job receives the same spec, but for its payload where the launcher set a
per-rank payload (:meth:`LaunchSpec.with_rank_payload`: each worker's own part of the Program, SPEC §16); its own
rank comes from its command line.
"""
from __future__ import annotations

import importlib
import re
import secrets
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_serializer, field_validator, model_validator

Backend = Literal["gloo", "nccl"]

#: A worker, an agent or a launcher that has not been heard for this many heartbeat periods is lost (stopped,
#: frozen, cut off): ``LaunchSpec.silent_s``.
SILENT_BEATS = 10

#: What an entry looks like: ``package.module:function``.
ENTRY_PATTERN = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")

#: Device kinds that run on the host CPU (gloo); every other kind is a CUDA device (nccl).
CPU_KINDS = frozenset({"cpu"})

#: ``precision=`` choices (SPEC §8); the executor's :data:`~.executor.PRECISIONS` maps them to dtypes.
PRECISIONS = ("fp32", "bf16")


class LaunchSpec(BaseModel):
    """What each worker of a job needs: rendezvous, entry point, run length and a free payload.

    ``entry`` is ``"package.module:function"``; the worker calls ``function(state, spec) -> dict`` where ``state``
    is its :class:`~hspmd_sdk.runtime.workers.worker.WorkerState`.  ``payload`` is free JSON for the entry (later the
    serialized Program / AnnotationPlan and model config).  ``slowdown`` maps a rank to a factor ``k >= 1``: that
    rank emulates a device ``k`` times slower (CPU demos only; always labelled as emulation in the metrics).

    Fault detection: every worker (and every SSH agent) beats every ``heartbeat_s`` seconds and the launcher (or
    the agent) pings back as often; a side not heard for :attr:`silent_s` (``SILENT_BEATS`` beats) is lost.  A
    rank that has not entered communication while a peer has waited in communication for ``stall_s`` seconds is
    hung (``None``: only silence is detected).  Both are far below ``timeout_s``, the collective timeout that
    would otherwise end the job, and they name the culprit instead of a waiting peer.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str = Field(min_length=1)
    world_size: int = Field(ge=1)
    ranks: list[int] = Field(description="all ranks of the job, 0..world_size-1")
    hosts: list[str] = Field(description="host of each rank (index = rank)")
    devices: list[str] = Field(description="device kind of each rank (index = rank)")
    master_addr: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    backend: Backend
    timeout_s: float = Field(default=120.0, gt=0, description="collective and rendezvous timeout")
    seed: int = 0
    steps: int = Field(default=1, ge=0)
    entry: str = Field(pattern=rf"^{ENTRY_PATTERN.pattern}$", description="'module:function'")
    payload: dict[str, Any] = Field(default_factory=dict)
    loss_rank: int | None = Field(default=None, description="rank whose reported losses are the job's losses; "
                                                             "None: the lowest rank that reports a loss")
    slowdown: dict[int, float | list[tuple[int, float]]] = Field(
        default_factory=dict, description="rank -> emulated slowdown factor >= 1, or a schedule [(step, factor), ...]")
    num_threads: int = Field(default=1, ge=1, description="torch intra-op threads per worker (CPU)")
    heartbeat_s: float = Field(default=1.0, gt=0, le=60, description="heartbeat and ping period")
    stall_s: float | None = Field(default=30.0, gt=0, description="a rank not in communication while a peer "
                                                                  "waited this long for it is hung")
    secret: str = Field(default_factory=lambda: secrets.token_hex(32), pattern=r"^[0-9a-f]{64}$", repr=False,
                        description="the job's secret (fresh per job): only a process that holds it is let into "
                                    "the job's rendezvous store (store.py); it travels inside the spec, over the "
                                    "launcher's own channel, and is never printed")
    joining: bool = Field(default=False, description="a worker started to grow a running job (Job.grow): it "
                                                     "joins the job's world where the launcher tells it, at a "
                                                     "step boundary, instead of forming the world of this spec")

    # ---- the per-rank lists on the wire: runs, so that a launch line does not grow with the world --------------
    @field_serializer("hosts", "devices", when_used="json")
    def _write_runs(self, values: list[str]) -> Any:
        """``[[value, count], ...]`` of equal neighbours (a host's ranks, a kind's devices) under ``"runs"``."""
        runs: list[list[Any]] = []
        for v in values:
            if runs and runs[-1][0] == v:
                runs[-1][1] += 1
            else:
                runs.append([v, 1])
        return {"runs": runs}

    @field_serializer("ranks", when_used="json")
    def _write_ranks(self, ranks: list[int]) -> Any:
        """``{"count": n}``: a job's ranks are ``0..n-1`` (checked when the spec is made and read)."""
        return {"count": len(ranks)}

    @field_validator("hosts", "devices", "ranks", mode="before")
    @classmethod
    def _read_runs(cls, value: Any) -> Any:
        """The lists :meth:`_write_runs` and :meth:`_write_ranks` wrote, expanded (a plain list as it is)."""
        if isinstance(value, dict) and set(value) == {"runs"}:
            return [v for v, n in value["runs"] for _ in range(int(n))]
        if isinstance(value, dict) and set(value) == {"count"}:
            return list(range(int(value["count"])))
        return value

    # rank -> that rank's payload (the launcher's side only: never serialized, see with_rank_payload)
    _rank_payload: Callable[[int], dict[str, Any]] | None = PrivateAttr(default=None)

    @property
    def silent_s(self) -> float:
        """Seconds without a word after which a worker, an agent or the launcher counts as lost."""
        return SILENT_BEATS * self.heartbeat_s

    @model_validator(mode="after")
    def _check(self) -> "LaunchSpec":
        n = self.world_size
        if self.ranks != list(range(n)):
            raise ValueError(f"ranks: must be 0..{n - 1} in order, got {self.ranks}")
        for name in ("hosts", "devices"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name}: needs one entry per rank ({n}), got {len(getattr(self, name))}")
        for r, k in self.slowdown.items():
            if not 0 <= r < n:
                raise ValueError(f"slowdown: rank {r} is not in the job (0..{n - 1})")
            for step, factor in ([(0, k)] if isinstance(k, (int, float)) else k):
                if factor < 1 or step < 0:
                    raise ValueError(f"slowdown[{r}]: factor {factor} (from step {step}) must be >= 1 (1 = real "
                                     "speed) from a step >= 0")
        if self.loss_rank is not None and not 0 <= self.loss_rank < n:
            raise ValueError(f"loss_rank: rank {self.loss_rank} is not in the job (0..{n - 1})")
        if self.stall_s is not None and self.stall_s < 2 * self.heartbeat_s:
            raise ValueError(f"stall_s: {self.stall_s:g} s must be at least two heartbeats "
                             f"(heartbeat_s={self.heartbeat_s:g})")
        return self

    def to_line(self) -> str:
        """The spec as one line of JSON (what a worker reads from stdin)."""
        return self.model_dump_json() + "\n"

    def with_rank_payload(self, payload_of: Callable[[int], dict[str, Any]] | None) -> "LaunchSpec":
        """This spec, whose worker ``r`` receives ``payload_of(r)`` instead of :attr:`payload` (:meth:`line_for`);
        :attr:`payload` stays what the launcher reads (e.g. the whole Program, while each worker gets its part)."""
        out = self.model_copy()
        out._rank_payload = payload_of
        return out

    def line_for(self, rank: int) -> str:
        """The line worker ``rank`` reads from stdin: :meth:`to_line` with that rank's payload where one is set
        (:meth:`with_rank_payload`)."""
        if self._rank_payload is None:
            return self.to_line()
        if not 0 <= rank < self.world_size:
            raise ValueError(f"line_for: rank {rank} is not in the job (0..{self.world_size - 1})")
        return self.model_copy(update={"payload": self._rank_payload(rank)}).model_dump_json() + "\n"

    @classmethod
    def from_line(cls, line: str) -> "LaunchSpec":
        return cls.model_validate_json(line)

    def local_rank(self, rank: int) -> int:
        """Index of ``rank`` among the ranks on its host (the CUDA device index)."""
        host = self.hosts[rank]
        return sum(1 for r in range(rank) if self.hosts[r] == host)


def backend_for(kinds: list[str] | set[str]) -> Backend:
    """``gloo`` when every device is a CPU, ``nccl`` when every device is a GPU; a mix is an error."""
    cpu = {k in CPU_KINDS for k in kinds}
    if cpu == {True}:
        return "gloo"
    if cpu == {False}:
        return "nccl"
    raise ValueError(f"cannot run one job on both CPU and GPU devices (kinds: {sorted(set(kinds))}); "
                     "launch on a cluster of one sort")


def resolve_entry(entry: str) -> Callable[..., Any]:
    """Import ``"module:function"``; the error says which part failed."""
    module_name, _, fn_name = entry.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"entry {entry!r}: cannot import module {module_name!r} ({e}); the module must be "
                          "importable by the worker's Python (installed, or on PYTHONPATH)") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise AttributeError(f"entry {entry!r}: module {module_name!r} has no function {fn_name!r}")
    return fn
