"""Reports to the service, sent in the background: training never waits for the service.

Commit records, marks, timings and cp_accessible reports go through one queue, in order, on one
thread; an outage keeps them and retries with backoff (client/engine/background.py). Commits that piled
up are re-posted in one batch request. Health is reported when a save fails, and after successful
saves — at once after a failure, else at most every HEALTH_EVERY_S — so the service can tell ok,
failing and stale. The queue calls nobody back: a `fenced` answer is kept here for the node to read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckptstore import AccessReport, CopyKey, tracing
from ckptstore.client.engine.background import RetryingQueue
from ckptstore.client.service.rest import ServiceClient
from ckptstore.client.service.wire import Commit
from ckptstore.errors import CheckpointNotFoundError, FencedError, ServiceUnavailableError
from ckptstore.wire.schema import MarkCause, MarkState, ResumeAudit, StatsAction

__all__ = ["Reports", "HEALTH_EVERY_S"]

log = logging.getLogger("ckptstore.client")
HEALTH_EVERY_S = 60.0


@dataclass(frozen=True)
class _Report:
    """One call to the service."""

    kind: str  # "commit", "mark", "audit", "stats" or "health"
    send: Callable[[], object]  # how it is sent alone (commits go by `_send_commits`)
    commit: Commit | None = None  # what a "commit" records


class Reports:
    """One node's queue of reports to `client` (None: no service; every report is dropped)."""

    def __init__(self, client: ServiceClient | None, job: str, node: str):
        self.client, self.job, self.node = client, job, node
        self.fenced: FencedError | None = None  # the service said a newer attempt of this node started
        self._queue: RetryingQueue[_Report] = RetryingQueue(
            "ckptstore-reports",
            lambda r: r.send(),
            transient=(ServiceUnavailableError,),
            on_dropped=self._dropped,
            handle_run=self._send_commits,
            joins=lambda r: r.kind == "commit",
        )
        self._health_failing, self._health_reported = False, -HEALTH_EVERY_S

    def _put(self, kind: str, send: Callable[[ServiceClient], object], commit: Commit | None = None) -> None:
        client = self.client
        if client is not None:
            self._queue.put(_Report(kind, lambda: send(client), commit))

    def commit(self, commit: Commit) -> None:
        """Record a copy (`commit.ref.key` names it, its tier included)."""
        self._put("commit", lambda c: None, commit)

    def _send_commits(self, run: list[_Report]) -> list[Exception | None]:
        """Commits in a row, in one batch request: each one's own refusal, or None."""
        assert self.client is not None  # nothing is queued without a client
        commits = [r.commit for r in run if r.commit is not None]
        with tracing.span("ckptstore.commit", job=self.job, node=self.node, commits=len(commits)):
            answers = self.client.commit_many(self.job, commits)
        return [answer if isinstance(answer, Exception) else None for answer in answers]

    def mark(self, copy: CopyKey, state: MarkState, *, cause: MarkCause, reason: str) -> None:
        self._put("mark", lambda c: c.mark(copy, state, cause=cause, reason=reason))

    def audit(self, attempt: str, audit: ResumeAudit) -> None:
        if "-" not in attempt:  # an offline attempt has no record to keep it with
            self._put("audit", lambda c: c.report_audit(self.job, self.node, attempt, audit))

    def stats(self, action: StatsAction, seconds: float, nbytes: int) -> None:
        self._put("stats", lambda c: c.report_stats(self.job, self.node, action, seconds, nbytes=nbytes))

    def health(self, report: AccessReport) -> None:
        self._health_failing = not report.ok
        self._put("health", lambda c: c.report_health(self.job, self.node, report))

    def saved(self) -> None:
        """A save worked: report cp_accessible (at once after a failure, else at most every HEALTH_EVERY_S)."""
        now = time.monotonic()
        if self._health_failing or now - self._health_reported >= HEALTH_EVERY_S:
            self._health_reported = now
            self.health(AccessReport(ok=True, latency_ms=None))

    @property
    def pending_commits(self) -> int:
        return sum(report.kind == "commit" for report in self._queue.snapshot())

    def drain(self, timeout: float | None = None) -> bool:
        """Until every report is sent (True), or the service failed a try made since, or `timeout` passed (False)."""
        return self._queue.drain(timeout)

    def close(self) -> None:
        self._queue.close()

    def _dropped(self, report: _Report, error: Exception) -> None:
        if isinstance(error, FencedError):
            self.fenced = error
        elif isinstance(error, CheckpointNotFoundError) and report.kind == "mark":
            log.debug("nothing recorded to mark: %s", error)  # a leftover the service never knew
        else:
            log.warning("the service refused a %s report: %s", report.kind, error)
