"""A checkpoint root belongs to one job at a time: the lock file ``ROOT/checkpoint.lock``.

The launcher takes it (:func:`launch_holding_locks`, from :func:`~.runs.start_runs`, the one place every
training launch goes through) before any worker starts, for every ``checkpoint_dir`` of the job, and releases it
when the job ends — succeeded, failed or cancelled (:meth:`~.job.Job.on_finish`) — or when Python exits with the
job running (its workers stopped first).  Workers never touch it: they
write into a root their launcher holds.  A second job given the same root is refused before any worker starts
with :class:`CheckpointLocked`, naming the owner.

The file is JSON (:class:`LockOwner`): the owner's ``job_id`` (``null`` for the moment between taking the lock
and the job getting its id), ``host`` (``socket.gethostname()`` of the launcher), ``pid`` and ``process_start``
(the launcher process and, on Linux, its start time in clock ticks, so that a reused pid does not pass for the
owner), ``started`` (UTC, ISO 8601), ``token`` (this holding of the lock: only it releases the file).  It is
created atomically (written under a temporary name, then ``os.link``-ed to its name, which fails if it exists:
also on NFS).

A lock left by a launcher that died (its process gone: the kernel killed the notebook, a power cut) stays until
someone takes it over explicitly with :func:`break_checkpoint_lock`: it removes a lock whose owner is gone from
this host, and with ``force=True`` any lock (an owner on another host, whose process cannot be checked from here).
"""
from __future__ import annotations

import atexit
import json
import os
import secrets
import socket
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from pydantic import BaseModel, ConfigDict, ValidationError

from .checkpoint_io import CheckpointError

__all__ = ["LOCK_FILE", "LockOwner", "CheckpointLocked", "CheckpointLock", "acquire_checkpoint_lock",
           "read_checkpoint_lock", "owner_alive", "break_checkpoint_lock", "launch_holding_locks"]

LOCK_FILE = "checkpoint.lock"
_TAKE_TRIES = 5


class LockOwner(BaseModel):
    """Who holds a checkpoint root (the content of ``checkpoint.lock``)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    job_id: str | None = None
    host: str
    pid: int
    process_start: str | None = None
    started: str = ""
    token: str | None = None

    def describe(self) -> str:
        """``job J (host H, pid P, since T)`` for messages."""
        job = f"job {self.job_id}" if self.job_id else "a job being started"
        since = f", since {self.started}" if self.started else ""
        return f"{job} (host {self.host}, pid {self.pid}{since})"


class CheckpointLocked(CheckpointError):
    """The checkpoint root is held by another job (``owner``: its :class:`LockOwner`, ``None`` when unreadable);
    ``alive``: ``True``/``False`` where this host can tell, ``None`` where it cannot (another host)."""

    def __init__(self, message: str, *, root: Path, owner: LockOwner | None, alive: bool | None) -> None:
        super().__init__(message)
        self.root, self.owner, self.alive = root, owner, alive


# ---- the owner ------------------------------------------------------------------------------------------------
def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux ``/proc/<pid>/stat`` field 22); ``None``
    where there is no ``/proc``."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # after "pid (comm) ": state is field 3
    return fields[19] if len(fields) > 19 else None


def _me(job_id: str | None, token: str) -> LockOwner:
    return LockOwner(job_id=job_id, host=socket.gethostname(), pid=os.getpid(),
                     process_start=_process_start(os.getpid()),
                     started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), token=token)


def owner_alive(owner: LockOwner) -> bool | None:
    """Whether the process holding a lock still runs: ``True``/``False`` when it ran on this host, ``None`` when
    it ran on another (its process cannot be checked from here)."""
    if owner.host != socket.gethostname():
        return None
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        pass
    if owner.process_start is not None:
        now = _process_start(owner.pid)
        if now is not None and now != owner.process_start:
            return False  # the pid was reused by a later process
    return True


def read_checkpoint_lock(root: str | Path) -> LockOwner | None:
    """The owner of the checkpoint root ``root`` (``None``: not locked).  :class:`CheckpointError` for a lock file
    that is not one."""
    path = Path(root) / LOCK_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the checkpoint lock: {e.strerror or e}") from None
    try:
        return LockOwner.model_validate(json.loads(text))
    except (ValueError, ValidationError):
        raise CheckpointError(f"{path}: not a checkpoint lock (expected JSON with job_id, host, pid); if no job "
                              "uses this directory, remove the file") from None


# ---- taking and releasing ---------------------------------------------------------------------------------------
class CheckpointLock:
    """This process's hold on a checkpoint root (from :func:`acquire_checkpoint_lock`)."""

    def __init__(self, root: Path, owner: LockOwner) -> None:
        self.root, self.owner = root, owner
        self.released = False

    @property
    def path(self) -> Path:
        return self.root / LOCK_FILE

    def _still_mine(self) -> bool:
        try:
            now = read_checkpoint_lock(self.root)
        except CheckpointError:
            return False
        return now is not None and now.token == self.owner.token

    def stamp(self, job_id: str) -> None:
        """Record the job's id in the lock (known once the job is built)."""
        if self.released or not self._still_mine():
            return
        self.owner = self.owner.model_copy(update={"job_id": job_id})
        tmp = self.root / f".{LOCK_FILE}.{self.owner.token}"
        tmp.write_text(self.owner.model_dump_json(indent=1))
        os.replace(tmp, self.path)

    def release(self) -> None:
        """Remove the lock if it is still this holding's (idempotent; a lock broken and taken by another job in
        the meantime is left alone)."""
        if self.released:
            return
        self.released = True
        if self._still_mine():
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def __repr__(self) -> str:
        return f"CheckpointLock({str(self.root)!r}, {self.owner.describe()}{', released' if self.released else ''})"


def _refusal(root: Path, owner: LockOwner | None) -> CheckpointLocked:
    fix = f"hspmd_sdk.runtime.break_checkpoint_lock({str(root)!r})"  # its public name
    if owner is None:
        return CheckpointLocked(f"checkpoint_dir {root}: another job is taking it right now (its {LOCK_FILE} is "
                                "being written); pass another checkpoint_dir", root=root, owner=None, alive=None)
    alive = owner_alive(owner)
    head = f"checkpoint_dir {root}: in use by {owner.describe()}"
    if alive:
        what = ("; two jobs writing one checkpoint directory would delete each other's checkpoints: wait for it to "
                "end or cancel it (its lock is released when it ends), or pass another checkpoint_dir")
    elif alive is False:
        what = (f", whose process is gone (pid {owner.pid} no longer runs on this host): it ended without releasing "
                f"the directory; take it over with {fix} and launch again")
    else:
        what = (f"; its process cannot be checked from {socket.gethostname()}: if that job no longer runs, take the "
                f"directory over with {fix[:-1]}, force=True) and launch again, else pass another checkpoint_dir")
    return CheckpointLocked(head + what, root=root, owner=owner, alive=alive)


def acquire_checkpoint_lock(root: str | Path, job_id: str | None = None) -> CheckpointLock:
    """Take the checkpoint root ``root`` for this process (and ``job_id``, if known yet): create its lock file
    atomically.  Raises :class:`CheckpointLocked` naming the owner (job id, host, pid) when another holds it,
    live or dead — a dead owner's lock is taken over only explicitly (:func:`break_checkpoint_lock`)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    owner = _me(job_id, secrets.token_hex(8))
    tmp = root / f".{LOCK_FILE}.{owner.token}"
    try:
        tmp.write_text(owner.model_dump_json(indent=1))
        for _ in range(_TAKE_TRIES):
            try:
                os.link(tmp, root / LOCK_FILE)  # atomic, fails if the lock exists (NFS included)
                return CheckpointLock(root, owner)
            except FileExistsError:
                pass
            try:
                held = read_checkpoint_lock(root)
            except CheckpointError:
                held = None  # being written by its taker (the link is atomic: only a hand-made file is partial)
            if held is not None:
                raise _refusal(root, held)
            time.sleep(0.01)  # released between our link and our read: try again
        raise _refusal(root, None)
    except OSError as e:
        raise CheckpointError(f"checkpoint_dir {root}: cannot create its lock {LOCK_FILE}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def break_checkpoint_lock(directory: str | Path, *, force: bool = False) -> LockOwner | None:
    """Take over a checkpoint root whose job ended without releasing it: remove ``directory/checkpoint.lock``;
    returns the owner it named (``None``: there was no lock).

    Only a lock whose owner process is gone from this host is removed, unless ``force=True`` (an owner on another
    host, which cannot be checked from here — be sure that job no longer runs).  An owner still running is never
    removed without ``force``: :class:`CheckpointLocked` names it."""
    root = Path(directory).expanduser().resolve()
    owner = read_checkpoint_lock(root)
    if owner is None:
        return None
    if not force and owner_alive(owner) is not False:
        raise _refusal(root, owner)
    (root / LOCK_FILE).unlink(missing_ok=True)
    return owner


# ---- the launcher's side --------------------------------------------------------------------------------------
def _roots(runs: Iterable[Mapping[str, Any]]) -> list[Path]:
    """The distinct checkpoint roots of a job's runs (several runs of one job may share one)."""
    out: list[Path] = []
    for run in runs:
        d = (run.get("checkpoint") or {}).get("dir")
        if d is not None and Path(d) not in out:
            out.append(Path(d))
    return out


def launch_holding_locks(runs: Iterable[Mapping[str, Any]], start: Callable[[], Any]) -> Any:
    """Take the lock of every checkpoint root of ``runs``, then ``start()`` the job (the workers start in it);
    the job's id is written into each lock and the locks are released when the job ends
    (:meth:`~.job.Job.on_finish`), or at once if it cannot start.  :class:`CheckpointLocked` (nothing started)
    when a root is another job's."""
    held: list[CheckpointLock] = []
    try:
        for root in _roots(runs):
            held.append(acquire_checkpoint_lock(root))
        job = start()
    except BaseException:
        for lock in held:
            lock.release()
        raise
    if not held:
        return job
    for lock in held:
        try:
            lock.stamp(job.job_id)
        except OSError as e:  # the lock still holds the root, only without the id
            warnings.warn(f"could not write job {job.job_id}'s id into {lock.path}: {e}", stacklevel=2)

    def release(_: Any = None) -> None:
        atexit.unregister(at_exit)
        for lock in held:
            try:
                lock.release()
            except OSError as e:  # noqa: PERF203 - a failed release must not keep the job open
                warnings.warn(f"could not release the checkpoint lock {lock.path}: {e}", stacklevel=1)

    def at_exit() -> None:  # Python exits with the job running: stop its workers, then free the roots
        job.cancel()
        release()

    atexit.register(at_exit)
    job.on_finish(release)
    return job
