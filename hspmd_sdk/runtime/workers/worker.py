"""The worker process: ``python -m hspmd_sdk.runtime.workers.worker --rank R`` (spec as the first line of stdin).

The worker joins the job's process group (rendezvous at the spec's master address, rank 0 hosting the store,
which lets in only holders of the job's secret: :mod:`.store`), builds a :class:`WorkerState` and calls the spec's entry ``fn(state, spec) -> dict``.  Everything it says
goes to the launcher as protocol lines on its original stdout (see :mod:`.protocol`); ``print`` becomes ``log``
messages and C-level output goes to stderr, which the launcher keeps as raw log lines.  On an exception the worker
sends its traceback and exits with status 1.  When its stdin closes (the launcher went away) it exits at once, so
no worker outlives its launcher.

After the spec, stdin carries the launcher's control lines (:mod:`.protocol`, :mod:`.liveness`): pings, messages
for the entry (``state.poll_control()``) and stack-dump requests.  A heartbeat thread beats every
``spec.heartbeat_s`` seconds, even during a long kernel; a worker that hears nothing from its launcher for
``spec.silent_s`` seconds exits.  SIGUSR1 writes every thread's stack to stderr (:func:`.liveness.serve_stack_requests`): the launcher asks
for it when it names a hung rank.

There is no module-level state: a worker is entirely its ``WorkerState``, so a later step can re-specialize in
place (graph switching) by replacing ``state.program`` and the process groups it needs.

Writing an entry (e.g. the training executor)::

    def train(state: WorkerState, spec: LaunchSpec) -> dict:
        program = load_program(spec.payload["program"])       # whatever the launcher put in the payload
        state.create_groups(program.comm_groups())              # every rank, same sets
        for step in range(spec.steps):
            state.begin_step()
            t = time.perf_counter(); loss = run_one_step(...); state.emulate(time.perf_counter() - t)
            state.report(step, loss=global_loss_or_None, tokens=tokens_this_rank_processed)
        return {"final_loss": ...}                             # JSON-able; becomes JobResult.results[rank]

``JobResult.losses`` are the ``loss`` values reported by ``spec.loss_rank`` (default: the lowest rank that reports
one), ordered by step: report the loss of the whole global batch there (reduced across pipelines).
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Iterable, NoReturn, Sequence

from .devices import StepClock, worker_device
from .liveness import ControlInbox, Heartbeat, Listener, serve_stack_requests
from ..metrics import StepMetrics, memory_mb
from ..protocol import EXIT_FAILED, Channel, LineReader, LineWriter, is_collateral, jsonable
from ..spec import LaunchSpec, resolve_entry

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from ...core.specialize import Program
    from .store import RendezvousStore


@dataclass
class WorkerState:
    """Everything one worker holds: its rank, the spec, process groups, and (later) parameters and Program.

    Process groups are cached by their sorted rank tuple.  ``create_groups`` must be called by *every* rank with
    the same sets (torch requires all ranks to take part in creating each group); it creates the missing ones in
    sorted order, so the order never depends on how a rank listed them.
    """

    spec: LaunchSpec
    rank: int
    channel: Channel
    device: "torch.device | None" = None
    groups: dict[tuple[int, ...], "dist.ProcessGroup"] = field(default_factory=dict)
    #: a second process group per rank set, for ZeRO-3's parameter gathers (:meth:`create_twin_groups`)
    twins: dict[tuple[int, ...], "dist.ProcessGroup"] = field(default_factory=dict)
    params: dict[str, "torch.Tensor"] = field(default_factory=dict)
    optimizer: "torch.optim.Optimizer | None" = None
    program: "Program | None" = None
    extras: dict[str, Any] = field(default_factory=dict)
    inbox: ControlInbox = field(default_factory=ControlInbox)
    launch_rank: int = -1   #: the rank the launcher started this process as; never changes (``rank`` may)
    world: int | None = None  #: the world size after the survivors re-formed it (``None``: the spec's)
    step: int = 0           #: the training step being run (emulated slowdowns can change with it)
    generation: int = 0     #: the reconfigurations applied (the world this process is in; elastic training)
    clock: StepClock | None = None  # CUDA events on a GPU, the wall clock otherwise
    _step_start: float | None = None
    _emulated: float = 0.0

    def __post_init__(self) -> None:
        if self.launch_rank < 0:
            self.launch_rank = self.rank

    # ---- identity ------------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.world if self.world is not None else self.spec.world_size

    @property
    def slowdown(self) -> float:
        """The emulated slowdown factor of this process at the current step (1.0: real speed)."""
        return slowdown_at(self.spec.slowdown.get(self.launch_rank, 1.0), self.step)

    # ---- re-forming the world (elastic training) ------------------------------------------------------------
    def abandon_groups(self) -> None:
        """Leave a broken world (a peer died): shut down the connections of every process group, then destroy
        them.  Destroying alone does not close gloo's connections while an operation of this process is still
        pending on them (an ``irecv`` from a live peer that will never send, say), and a peer blocked on this
        process would wait for its collective timeout; shutting the sockets down makes every such peer fail at
        once, so all survivors notice within milliseconds.  The rendezvous store's connection is kept (its
        port is the spec's or the last rejoin's).  Never raises."""
        import torch.distributed as dist

        self.groups.clear()
        self.twins.clear()
        _shutdown_sockets(keep_port=int(self.extras.get("store_port", self.spec.master_port)))
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken world may refuse a clean teardown; it is gone either way
            pass

    def leave_world(self) -> None:
        """Leave a healthy world at a step boundary, every rank at once (the job grows): its groups destroyed."""
        import torch.distributed as dist

        self.groups.clear()
        self.twins.clear()
        if dist.is_initialized():
            dist.destroy_process_group()

    def peer_failed(self) -> bool:
        """Whether the launcher said that a peer of this process's current world died (a ``halt`` message): a
        wait for a peer outside a collective (a store poll) stops then instead of waiting for a dead process."""
        return self.inbox.halted(self.generation)

    def rejoin(self, master_addr: str, master_port: int, world_size: int, rank: int) -> None:
        """Join a new world (the survivors, renumbered, or a grown world): rank ``rank`` of ``world_size``,
        rendezvous at ``master_addr:master_port`` (hosted by the new rank 0).

        The rendezvous gives up when the launcher says a peer of this world died (:meth:`peer_failed`, a
        ``halt``) before every rank arrived -- a rank lost while a grow waited for its step boundary, or during a
        recovery -- raising :class:`RendezvousAbandoned` (a peer's failure: the caller halts) instead of waiting
        ``timeout_s`` for a process that will never come: a rank waits for the store's host with plain connects,
        and the ranks meet at a counter in the store, polled, before the process group forms."""
        import torch.distributed as dist

        timeout = timedelta(seconds=self.spec.timeout_s)
        deadline = time.monotonic() + self.spec.timeout_s
        where = f"rank {self.launch_rank}: the rendezvous of a world of {world_size} at {master_addr}:{master_port}"
        # the store's host (rank 0) may come later (a running rank at its step boundary): wait until it listens
        # with plain connects, not the store's own (it retries with growing back-off and logs each try)
        while rank != 0 and not _listening(master_addr, int(master_port)):
            if self.peer_failed():
                raise RendezvousAbandoned(f"{where}: given up, a peer of it died")
            if time.monotonic() > deadline:
                raise RendezvousAbandoned(f"{where}: nothing listened there within {self.spec.timeout_s:g} s")
            time.sleep(0.02)
        store = open_store(self.spec, master_addr, int(master_port), rank == 0, timeout, self.peer_failed)
        store.add("hspmd/arrived", 1)
        while store.add("hspmd/arrived", 0) < int(world_size):
            if self.peer_failed():
                raise RendezvousAbandoned(f"{where}: given up, a peer of it died before every rank arrived")
            if time.monotonic() > deadline:
                raise RendezvousAbandoned(f"{where}: {store.add('hspmd/arrived', 0)} of {world_size} ranks "
                                          f"arrived within {self.spec.timeout_s:g} s")
            time.sleep(0.01)
        dist.init_process_group(self.spec.backend, store=store, rank=int(rank), world_size=int(world_size),
                                timeout=timeout)
        self.rank, self.world = int(rank), int(world_size)
        old = self.extras.get("store")
        self.extras["store"], self.extras["store_port"] = store, int(master_port)
        if old is not None and old is not store:
            old.close()  # the last world's rendezvous: its server (this rank hosted it) or this rank's connection

    # ---- process groups ------------------------------------------------------------------------------------
    def create_groups(self, rank_sets: Iterable[Sequence[int]]) -> None:
        """Create the process groups for ``rank_sets`` (call on every rank with the same sets)."""
        import torch.distributed as dist

        for key in sorted({_group_key(s) for s in rank_sets}):
            if key in self.groups:
                continue
            if key == tuple(range(self.world_size)):
                self.groups[key] = dist.group.WORLD
            else:
                self.groups[key] = dist.new_group(list(key), timeout=timedelta(seconds=self.spec.timeout_s))

    def create_twin_groups(self, rank_sets: Iterable[Sequence[int]]) -> None:
        """A second process group for each of ``rank_sets`` (call on every rank with the same sets): ZeRO-3 gathers
        a unit's parameters on them while the gradient buckets reduce on the first ones, so that the two streams of
        collectives, each in the same order on every rank, never have to interleave alike (:mod:`.zero3`)."""
        import torch.distributed as dist

        for key in sorted({_group_key(s) for s in rank_sets}):
            if key not in self.twins:
                self.twins[key] = dist.new_group(list(key), timeout=timedelta(seconds=self.spec.timeout_s))

    def twin(self, ranks: Sequence[int]) -> "dist.ProcessGroup":
        """The twin process group of ``ranks`` (:meth:`create_twin_groups`), or its first group when it has none."""
        got = self.twins.get(_group_key(ranks))
        return got if got is not None else self.group(ranks)

    def group(self, ranks: Sequence[int]) -> "dist.ProcessGroup":
        """The process group of ``ranks`` (created earlier by ``create_groups`` on every rank)."""
        key = _group_key(ranks)
        if key not in self.groups:
            if key == tuple(range(self.world_size)):
                import torch.distributed as dist

                return dist.group.WORLD
            raise KeyError(f"rank {self.rank}: no process group for ranks {list(key)}; call "
                           "state.create_groups([...]) on every rank with the same sets before using it")
        return self.groups[key]

    def reset_groups(self) -> None:
        """Forget (and destroy) every sub-group, e.g. before re-specializing for another Program."""
        import torch.distributed as dist

        for key, g in [*self.groups.items(), *self.twins.items()]:
            if g is not dist.group.WORLD and g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(g)
        self.groups.clear()
        self.twins.clear()

    # ---- steps, emulation, metrics -------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Start the step clock (optional: after the first ``report`` the clock restarts by itself)."""
        self._step_start = time.perf_counter()
        self._emulated = 0.0
        if self.clock is not None:
            self.clock.start()

    def emulate(self, compute_seconds: float) -> float:
        """Emulate a slower device: sleep ``(k - 1) * compute_seconds`` when this rank has slowdown ``k``.

        Call it right after the compute it stands for; returns the seconds slept (0 at real speed).  The step's
        metrics label the time as emulated.
        """
        extra = max(0.0, (self.slowdown - 1.0) * compute_seconds)
        if extra > 0:
            time.sleep(extra)
            self._emulated += extra
        return extra

    def report(self, step: int, *, loss: float | None = None, tokens: int | None = None,
               step_time: float | None = None, grad_norm: float | None = None, lr: float | None = None,
               val_loss: float | None = None, **extra: Any) -> StepMetrics:
        """Send one step's metrics to the launcher (loss, tokens, time since ``begin_step``, memory; the gradient's
        global norm before clipping, the learning rate and, on a validation step, the validation loss).

        The job's ``losses`` are the ``loss`` values that the loss rank (``spec.loss_rank``, else the lowest
        rank that reports a loss) reports, ordered by ``step``; report the *global-batch* loss there.
        """
        now = time.perf_counter()
        if step_time is None and self._step_start is not None:
            step_time = self.clock.seconds() if self.clock is not None else now - self._step_start
        m = StepMetrics(rank=self.rank, step=int(step), step_time=step_time,
                        loss=None if loss is None else float(loss), tokens=tokens,
                        grad_norm=None if grad_norm is None else float(grad_norm),
                        lr=None if lr is None else float(lr), val_loss=None if val_loss is None else float(val_loss),
                        tokens_per_s=(tokens / step_time) if tokens and step_time else None,
                        memory_mb=round(memory_mb(self.device), 1),
                        emulated_slowdown=self.slowdown if self.slowdown != 1.0 else None,
                        emulated_s=round(self._emulated, 6) if self.slowdown != 1.0 else None,
                        extra=jsonable(extra))
        self.channel.send("metric", **m.to_message())
        self._step_start, self._emulated = now, 0.0
        if self.clock is not None:
            self.clock.start()
        return m

    def log(self, text: str) -> None:
        """Send a log line (also what ``print`` does in a worker)."""
        for line in str(text).split("\n"):
            self.channel.log(line, "log")

    # ---- control messages from the launcher ----------------------------------------------------------------
    def poll_control(self) -> list[dict[str, Any]]:
        """The control messages the launcher sent since the last call (``Job._send_control``), oldest first;
        never blocks (thread-safe: a reader thread fills the inbox).  Call it, e.g., at each step boundary."""
        return self.inbox.take()

    # ---- lifetime ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the process group."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _shutdown_sockets(keep_port: int) -> None:
    """``shutdown(SHUT_RDWR)`` every connected TCP socket of this process except those of ``keep_port`` (the peers
    see the connection end at once); listening sockets and the descriptors stay as they are, for their owners."""
    import socket

    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                continue
            try:
                ports = {s.getsockname()[1], s.getpeername()[1]}
            except OSError:
                continue  # a listening socket: its owner's accept loop must not see it fail
            if keep_port not in ports:
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.close()  # the duplicate only


def slowdown_at(schedule: float | Sequence[tuple[int, float]], step: int) -> float:
    """The factor of an emulated slowdown at ``step``: a number, or a schedule ``[(from_step, factor), ...]``
    (the last entry whose step is <= ``step``; 1.0 before the first)."""
    if isinstance(schedule, (int, float)):
        return float(schedule)
    factor = 1.0
    for start, k in sorted((int(a), float(b)) for a, b in schedule):
        if start <= step:
            factor = k
    return factor


def _group_key(ranks: Sequence[int]) -> tuple[int, ...]:
    return tuple(sorted({int(r) for r in ranks}))


def _listening(addr: str, port: int) -> bool:
    """Whether something accepts TCP connections at ``addr:port`` (one short connect, closed at once)."""
    try:
        with socket.create_connection((addr, port), timeout=0.5):
            return True
    except OSError:
        return False


class RendezvousAbandoned(RuntimeError):
    """A new world's rendezvous given up: a peer of it died before every rank arrived (:meth:`WorkerState.rejoin`);
    what a peer's failure looks like to the session, which halts."""


def connect(spec: LaunchSpec, rank: int, channel: Channel, inbox: ControlInbox | None = None) -> WorkerState:
    """Join the job's process group and return the worker's state."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(spec.seed)
    timeout = timedelta(seconds=spec.timeout_s)
    device = worker_device(spec, rank)  # cuda:<local rank> under nccl (set_device), else the CPU
    if device.type == "cpu":
        torch.set_num_threads(spec.num_threads)
    state = WorkerState(spec=spec, rank=rank, channel=channel, device=device, inbox=inbox or ControlInbox(),
                        clock=StepClock(device))
    if spec.joining:  # started to grow a running job: it joins the job's world when told where (session.py)
        return state
    store = open_store(spec, spec.master_addr, spec.master_port, rank == 0, timeout, state.peer_failed)
    dist.init_process_group(spec.backend, store=store, rank=rank, world_size=spec.world_size, timeout=timeout)
    state.extras["store"] = store
    return state


def open_store(spec: LaunchSpec, addr: str, port: int, host: bool, timeout: timedelta,
               interrupted: Callable[[], bool] | None = None) -> "RendezvousStore":
    """The rendezvous store of a world at ``addr:port``, authenticated by the job's secret: hosted by this
    process (``host``: rank 0) or reached from it (:mod:`.store`).  ``interrupted``: the store's waits give up
    once it is true (``WorkerState.peer_failed``: a peer of this world died)."""
    from .store import RendezvousStore  # lazy: torch (store)

    if host:
        store = RendezvousStore.host_at(addr, port, spec.secret, timeout)
    else:
        store = RendezvousStore.connect(addr, port, spec.secret, timeout)
    store.interrupted = interrupted
    return store


# ---- process plumbing ---------------------------------------------------------------------------------------
def take_stdout(rank: int) -> Channel:
    """Reserve the original stdout for protocol lines; ``print`` -> log messages, fd 1 -> stderr."""
    sys.stdout.flush()
    channel = Channel(os.dup(1), rank)
    os.dup2(2, 1)
    sys.stdout = LineWriter(channel, "stdout")
    sys.stderr = LineWriter(channel, "stderr")
    return channel


def read_spec(reader: LineReader) -> str:
    """The first line of stdin (the spec); the control lines after it stay in ``reader``."""
    line = reader.readline()
    if not line.strip():
        raise EOFError("no launch spec on stdin: the launcher writes it as the first line")
    return line.decode()


def start_liveness(spec: LaunchSpec, channel: Channel, reader: LineReader | None,
                   inbox: ControlInbox) -> Heartbeat:
    """The control listener (when stdin is the launcher's) and the heartbeat thread."""
    listener = Listener(reader, channel, inbox).start() if reader is not None else None
    return Heartbeat(channel, spec.heartbeat_s, listener=listener,
                     silent_s=spec.silent_s if listener is not None else None).start()


def report_failure(channel: Channel, exc: BaseException) -> None:
    """Send the exception and its traceback as an ``error`` message."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    message = f"{type(exc).__name__}: {exc}"
    channel.send("error", type=type(exc).__name__, message=message, traceback=tb,
                 collateral=is_collateral(message))


def run_worker(spec: LaunchSpec, rank: int, channel: Channel, inbox: ControlInbox | None = None) -> dict[str, Any]:
    """Connect, call the entry, return its (JSON-able) result."""
    channel.send("hello", pid=os.getpid(), pgid=os.getpgid(0), host=socket.gethostname())
    fn = resolve_entry(spec.entry)
    import torch.distributed  # noqa: F401 - the start-up's import phase: torch with the entry's own modules

    channel.send("phase", name="imported")
    state = connect(spec, rank, channel, inbox)
    channel.send("ready")
    if state.slowdown != 1.0:
        state.log(f"EMULATION: rank {rank} emulates a device {state.slowdown:g}x slower "
                  f"(sleeps {state.slowdown - 1:g}x its measured compute time per step)")
    result = fn(state, spec)
    state.close()
    return jsonable(result if result is not None else {})


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hspmd_sdk.runtime.workers.worker", description=__doc__.split("\n")[0])
    p.add_argument("--rank", type=int, default=None, help="this worker's rank (default: $RANK)")
    p.add_argument("--spec", default="-", help="spec JSON file, '-' for the first line of stdin (default)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Run one worker; the process exits with 0 (success), 1 (the entry failed) or 3 (the launcher went away)."""
    args = _parse(argv)
    rank = args.rank if args.rank is not None else int(os.environ.get("RANK", "0"))
    channel = take_stdout(rank)
    faulthandler.enable(file=sys.__stderr__)  # a crash in C code still leaves a Python stack in the rank's log
    serve_stack_requests(signal.SIGUSR1)  # the launcher's stack request
    try:
        reader = LineReader(0) if args.spec == "-" else None
        if reader is not None:
            line = read_spec(reader)
        else:
            with open(args.spec) as f:
                line = f.read()
        spec = LaunchSpec.from_line(line)
        if not 0 <= rank < spec.world_size:
            raise ValueError(f"--rank {rank} is not in the job (0..{spec.world_size - 1})")
        inbox = ControlInbox()
        start_liveness(spec, channel, reader, inbox)
        result = run_worker(spec, rank, channel, inbox)
        _flush_writers()
        channel.send("result", value=result)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the launcher
        _flush_writers()
        try:
            report_failure(channel, exc)
        except OSError:
            pass  # the launcher is gone; nobody to tell
        os._exit(EXIT_FAILED)  # skip atexit / process-group teardown that could hang on dead peers
    _flush_writers()
    os._exit(0)  # everything is sent; skip interpreter teardown (daemon threads, torch atexit hooks)


def _flush_writers() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a broken stream must not hide the real error
            pass


if __name__ == "__main__":
    main()
