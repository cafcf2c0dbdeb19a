"""A job's failures (:class:`JobFailures`, a part of :class:`~.job.Job`): an error a worker reported, a worker that
exited early, a host whose connection went quiet, a rank the watchdog found hung, a failure the launcher's own
machinery reports (:meth:`JobFailures.report_failure`).  Each goes to the job's policy (:mod:`.faults`); the
default stops every worker at once, and the job's error names the *first* failing rank: a genuine error wins over
the connection errors its peers raise afterwards, then the earliest."""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ...errors import RuntimeFailure
from .faults import Failure, FailurePolicy, Reaction, describe_returncode
from ..transports.transport import WorkerGroup

if TYPE_CHECKING:
    from pathlib import Path

    from .job_stream import RankRecord
    from .job_logs import JobLogs

__all__ = ["JobFailures"]


class JobFailures:
    """The job's failure handling and stopping; the state it keeps is the job's own (:class:`~.job.Job` sets every
    attribute below)."""

    policy: FailurePolicy
    log_dir: "Path"
    _lock: threading.RLock
    _done: threading.Event
    _ranks: dict[int, "RankRecord"]
    _groups: list[WorkerGroup]
    _groups_by_rank: Callable[[], dict[int, WorkerGroup]]  #: the job's launch rank -> group index
    _logs: "JobLogs"
    _failures: list[Failure]
    _absorbed: list[Failure]
    _lost_hosts: set[str]
    _stopping: bool
    _cancelled: bool

    def report_failure(self, failure: Failure) -> None:
        """A failure found by the launcher's own machinery (the mixed-length dispatch, an elastic recovery): it
        goes to the job's policy as one the job detected itself."""
        self._fail(failure)

    def stop_ranks(self, ranks: Sequence[int], grace_s: float = 0.5) -> None:
        """Stop the workers of ``ranks`` only (for a policy that lets the others go on); their exits are not
        failures."""
        wanted = {int(r) for r in ranks}
        for g in list(self._groups):
            mine = [r for r in g.ranks if r in wanted]
            if mine:
                g.kill(grace_s, ranks=mine)

    def _on_error(self, rank: int, msg: dict[str, Any]) -> None:
        tb = str(msg.get("traceback", ""))
        self._append(rank, tb.rstrip("\n") or str(msg.get("message")), stderr=True)
        self._fail(Failure(rank, str(msg.get("message", "error")), tb, bool(msg.get("collateral", False)),
                           float(msg.get("time", time.time())), host=self._ranks[rank].host))

    def _on_exit(self, rank: int, returncode: int) -> None:
        if self._done.is_set():
            return  # a late report (e.g. of a host whose start failed): the outcome is already decided
        group = self._group_of(rank)
        lost = group.lost(rank) if group is not None else None
        with self._lock:
            rec = self._ranks[rank]
            rec.returncode = returncode
            reported = rec.suspect or any(rank in f.ranks for f in self.failures)  # suspect: being reported
            killed = group is not None and group.stopped_by_kill(rank, returncode)
        if lost is not None:
            self._append(rank, f"exit status unknown: {lost}")
            if group is not None:
                self._host_lost(group, lost)
        else:
            self._append(rank, f"exited with status {describe_returncode(returncode)}"
                         + (" (stopped by the launcher)" if killed else ""))
            if not reported and not killed and (returncode != 0 or rec.result is None):
                why = (f"exited with status {describe_returncode(returncode)}" if returncode != 0
                       else "exited without reporting a result")
                self._fail(Failure(rank, f"rank {rank} {why}", "\n".join(rec.stderr_tail), False, time.time(),
                                   kind="exited", host=rec.host, returncode=returncode))
        self._maybe_finish()

    # ---- failures and the policy ---------------------------------------------------------------------------
    def _fail(self, failure: Failure) -> None:
        with self._lock:
            if self._done.is_set() or (self._cancelled and not self._failures):
                return  # a consequence of cancel(): a peer saw a stopped rank's connection close
            if self._stopping:  # already stopping: a consequence, recorded for the report
                self._failures.append(failure)
                return
        try:
            reaction = self.policy.on_failure(self, failure)
        except Exception as e:  # noqa: BLE001 - a broken policy must not leave the job running unnoticed
            failure.message += f" (and the failure policy raised {type(e).__name__}: {e})"
            reaction = Reaction.STOP
        with self._lock:
            if reaction is Reaction.CONTINUE and not self._stopping:
                self._absorbed.append(failure)
                return
            self._failures.append(failure)
        threading.Thread(target=self._stop_all, name="hspmd-stop", daemon=True).start()

    def _stop_all(self) -> None:
        with self._lock:
            self._stopping = True
            groups = list(self._groups)
        threads = [threading.Thread(target=g.kill, name=f"hspmd-kill-{g.host}", daemon=True) for g in groups]
        for t in threads:  # in parallel: a host that does not answer must not delay stopping the others
            t.start()
        for t in threads:
            t.join()

    def _group_of(self, rank: int) -> WorkerGroup | None:
        return self._groups_by_rank().get(rank)

    def _host_lost(self, group: WorkerGroup, why: str) -> None:
        """One ``connection lost`` failure per host, naming the ranks it carried."""
        with self._lock:
            if group.host in self._lost_hosts:
                return
            self._lost_hosts.add(group.host)
            ranks = [r for r in group.ranks if self._ranks[r].returncode is None or group.lost(r) is not None]
        ranks = ranks or list(group.ranks)
        self._fail(Failure(min(ranks), f"host {group.host}: connection lost: {why}; it carried ranks {ranks}",
                           kind="connection lost", ranks=tuple(ranks), host=group.host))

    # ---- what the watchdog reports (:mod:`.watchdog`) ------------------------------------------------------
    def _hung(self, rank: int, why: str, stack: str) -> None:
        """A rank the watchdog found hung, with its stack (or why there is none)."""
        self._append(rank, why)
        self._fail(Failure(rank, why, stack, False, time.time(), kind="hung", host=self._ranks[rank].host))

    def first_failure(self) -> Failure | None:
        """The failure that caused the others: a genuine error before connection errors, then the earliest."""
        with self._lock:
            return min(self._failures, key=Failure.sort_key, default=None)

    def _failure_error(self) -> RuntimeFailure:
        f = self.first_failure()
        assert f is not None
        others = sorted({r for g in self._failures for r in g.ranks} - set(f.ranks))
        host = f.host or self._ranks[f.rank].host
        where = (f"rank {f.rank}" + (f" on {host}" if host else "")) if f.kind != "connection lost" \
            else f"ranks {list(f.ranks)}"
        logs = "" if self._logs.broken is None else f" (log files incomplete: {self._logs.broken})"
        text = (f"job {self.job_id} failed: {where}: {f.message}"
                + (f"\n(ranks {others} failed afterwards, most likely as a consequence)" if others else "")
                + f"\nAll workers were stopped. Full logs: {self.log_dir}/rank{f.rank}.log{logs}"
                + (f"\n--- {f.evidence_title()} of rank {f.rank} ---\n{f.traceback.rstrip()}" if f.traceback
                   else ""))
        return RuntimeFailure(text, rank=f.rank, traceback=f.traceback)

    def _kill_at_exit(self) -> None:
        if not self._done.is_set():
            self._stop_all()
