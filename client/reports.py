"""Reports to the service, sent in the background: training never waits for the service.

Commit records, marks, timings, cp_accessible reports and the retention step after a durable commit
all go through one queue, in order, on one thread; an outage keeps them and retries with backoff
(client/background.py). Commits that piled up (with the retention steps between them) are re-posted
in one batch request, the retention step run once after them. Health is reported when a save fails, and after successful saves — at once
after a failure, else at most every HEALTH_EVERY_S — so the service can tell ok, failing and stale.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckptstore import AccessReport, CheckpointRef, Position, tracing
from ckptstore.errors import CheckpointNotFoundError, FencedError, ServiceUnavailableError
from ckptstore.names import Tier
from ckptstore.schema import MarkState, StatsAction
from client.background import RetryingQueue
from client.service import ServiceClient
from client.wire import Commit

__all__ = ["Reports", "HEALTH_EVERY_S"]

log = logging.getLogger("ckptstore.client")
HEALTH_EVERY_S = 60.0


@dataclass(frozen=True)
class _Report:
    """One call to the service."""

    kind: str  # "commit", "mark", "stats", "health" or "retention"
    send: Callable[[], object]  # how it is sent alone (commits and retention steps go by `_send_run`)
    commit: Commit | None = None  # what a "commit" records


_BATCHED = frozenset({"commit", "retention"})


class Reports:
    """One node's queue of reports to `client` (None: no service; every report is dropped)."""

    def __init__(
        self,
        client: ServiceClient | None,
        job: str,
        node: str,
        *,
        on_fenced: Callable[[], None],
        retention: Callable[[], None],
    ):
        self.client, self.job, self.node = client, job, node
        self._on_fenced, self._retention = on_fenced, retention
        self._queue: RetryingQueue[_Report] = RetryingQueue(
            "ckptstore-reports",
            lambda r: r.send(),
            transient=(ServiceUnavailableError,),
            on_dropped=self._dropped,
            handle_run=self._send_run,
            joins=lambda r: r.kind in _BATCHED,
        )
        self._health_failing, self._health_reported = False, -HEALTH_EVERY_S

    def _put(self, kind: str, send: Callable[[ServiceClient], object], commit: Commit | None = None) -> None:
        client = self.client
        if client is not None:
            self._queue.put(_Report(kind, lambda: send(client), commit))

    def commit(self, ref: CheckpointRef, tier: Tier, metrics: dict[str, float]) -> None:
        """Record a copy; after a durable one, run this node's part of the retention plan."""
        self._put("commit", lambda c: None, Commit(ref, tier, metrics))
        if tier == "durable":
            self._put("retention", lambda c: None)

    def _send_run(self, run: list[_Report]) -> list[Exception | None]:
        """Commits and retention steps in a row: the commits in one batch, then one retention step."""
        assert self.client is not None  # nothing is queued without a client
        commits = [r.commit for r in run if r.commit is not None]
        with tracing.span("ckptstore.commit", job=self.job, node=self.node, commits=len(commits)):
            answers = iter(self.client.commit_many(self.job, commits) if commits else [])
        failures: list[Exception | None] = [
            _failure(next(answers)) if report.commit is not None else None for report in run
        ]
        if any(report.kind == "retention" for report in run):
            try:
                self._retention()
            except ServiceUnavailableError:
                raise
            except Exception as exc:
                failures = [exc if r.kind == "retention" else f for r, f in zip(run, failures, strict=True)]
        return failures

    def mark(self, position: Position, state: MarkState, *, attempt: str | None, tier: Tier, reason: str) -> None:
        self._put(
            "mark", lambda c: c.mark(self.job, self.node, position, state, attempt=attempt, tier=tier, reason=reason)
        )

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

    def drain(self) -> bool:
        """Until every report is sent (True), or the service failed a try made since (False)."""
        return self._queue.drain()

    def close(self) -> None:
        self._queue.close()

    def _dropped(self, report: _Report, error: Exception) -> None:
        if isinstance(error, FencedError):
            self._on_fenced()
        elif isinstance(error, CheckpointNotFoundError) and report.kind == "mark":
            log.debug("nothing recorded to mark: %s", error)  # a leftover the service never knew
        else:
            log.warning("the service refused a %s report: %s", report.kind, error)


def _failure(answer: object) -> Exception | None:
    return answer if isinstance(answer, Exception) else None
