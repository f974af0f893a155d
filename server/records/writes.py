"""The hot writes, as the group commit runs them: recording commits — one entry point for a single
commit and a batch — and registering attempts. The routes and the fast path (server/http/fastpath.py)
both call these, so a request gets the same answer whichever of them takes it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ckptstore.position import Position
from ckptstore.server.errors import ApiError, error_model
from ckptstore.server.metrics import METRICS
from ckptstore.server.records import restarts, rules
from ckptstore.server.records.answers import last_good_part
from ckptstore.server.records.batching import WriteBatcher
from ckptstore.wire.schema import (
    AttemptInfo,
    AttemptRequest,
    CheckpointRecord,
    CommitOutcome,
    CommitRequest,
    NodeStart,
    StartRequest,
    StoredCopy,
)

__all__ = [
    "IDEMPOTENCY_KEY",
    "Recorded",
    "record_commits",
    "outcome",
    "commit_status",
    "register_attempt",
    "answer_start",
]

IDEMPOTENCY_KEY = r"^[A-Za-z0-9._:-]{1,64}$"  # a registration's Idempotency-Key header
Recorded = tuple[CheckpointRecord, bool]  # the record, and whether this request created it
CONCURRENT_CHANGE = "a concurrent request changed the same record; retry"


def _recording(job: str, node: str, body: CommitRequest) -> Callable[[Session], Recorded]:
    return lambda session: rules.commit_checkpoint(session, rules.lock_job(session, job), node, body)


async def record_commits(
    writes: WriteBatcher, job: str, commits: Sequence[tuple[str, CommitRequest]]
) -> list[Recorded | BaseException]:
    """Record (node, commit) pairs of `job`, in order, in the next group transaction: for each, its record
    or the refusal it got alone (an ApiError, or an IntegrityError from a concurrent change). Raises only
    when nothing could be recorded (the database away)."""
    futures = [
        asyncio.wrap_future(writes.submit(job, _recording(job, node, body), defers_inserts=True))
        for node, body in commits
    ]
    answers = await asyncio.gather(*futures, return_exceptions=True)
    for answer in answers:
        if isinstance(answer, BaseException) and not isinstance(answer, (ApiError, IntegrityError)):
            raise answer
    return answers


def commit_status(created: bool) -> int:
    """Count a recorded commit; its status: 201 new, 200 an identical re-post."""
    METRICS.commits.labels("created" if created else "repeated").inc()
    return 201 if created else 200


def outcome(answer: Recorded | BaseException) -> CommitOutcome:
    """One commit's answer within a batch: the status it would have had alone, and its record or error."""
    if isinstance(answer, ApiError):
        return CommitOutcome(status=answer.status, error=error_model(answer.code, answer.detail))
    if isinstance(answer, BaseException):  # an IntegrityError: a concurrent request inserted the same copy
        return CommitOutcome(status=409, error=error_model("conflict", CONCURRENT_CHANGE))
    record, created = answer
    return CommitOutcome(status=commit_status(created), record=record)


async def register_attempt(
    writes: WriteBatcher, job: str, node: str, body: AttemptRequest | None, key: str | None
) -> AttemptInfo:
    """Number a new start of `node` in `job` in the next group transaction (see `restarts.start_attempt`)."""
    resumed: Position | None = body.resumed_from.to_position() if body and body.resumed_from else None
    at_least = body.at_least if body else None

    def register(session: Session) -> AttemptInfo:
        row = rules.lock_job(session, job)
        attempt = restarts.start_attempt(session, row, node, resumed, at_least=at_least, request_key=key)
        return restarts.attempt_info(row, attempt)

    return await writes.run(job, register, defers_inserts=True, attempts_of=(node, key))


async def answer_start(state: Any, job: str, node: str, start: StartRequest, key: str | None) -> NodeStart:
    """A node's start in one request (`POST …/nodes/{node}/start`): a new attempt registered in the next
    group transaction, fencing every older one, and the node's part of the last-good answer — while the
    job's declaration is the one the node checked and every copy it lists is recorded; otherwise
    nothing changes and the answer says why (`restarts.start_refusal`)."""

    def register(session: Session) -> tuple[AttemptInfo | None, str | None, list[StoredCopy]]:
        row = rules.lock_job(session, job)
        refused, unknown = restarts.start_refusal(session, row, node, start)
        if refused is not None:
            return None, refused, unknown
        return restarts.attempt_info(row, restarts.start_attempt(session, row, node, None, request_key=key)), None, []

    attempt, refused, unknown = await state.writes.run(job, register, defers_inserts=True, attempts_of=(node, key))
    resume = None if attempt is None else (await last_good_part(state, job, None, node))[1]
    return NodeStart(attempt=attempt, refused=refused, unknown=unknown, resume=resume)
