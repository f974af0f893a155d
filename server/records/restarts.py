"""Attempts: each process start gets a number above every attempt seen (fencing the older ones),
reports where it resumed and what it skipped, and waits for the restore agreement.

Restore agreement (docs/design.md, "Restore"): every node verifies its part of the resume position
before assigning anything, reports it here, and starts training only when every expected node's
newest attempt reported the same position, after that position first existed (a report older than
the position is from the run that wrote it). A node that finds its part unreadable marks it, which
demotes the position; the judge then answers an older one and everyone moves there.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ckptstore.names import ATTEMPT_LIMIT
from ckptstore.position import Position
from ckptstore.server.db import queries
from ckptstore.server.db.models import Attempt, Checkpoint, Job, PositionRow, batch_key
from ckptstore.server.errors import ApiError
from ckptstore.server.events.log import emit
from ckptstore.server.http.paging import Page
from ckptstore.server.records import held
from ckptstore.server.records.last_good import expected_nodes
from ckptstore.server.records.rules import require_node
from ckptstore.wire.schema import (
    AttemptInfo,
    PositionBody,
    ResumeAgreement,
    ResumeAudit,
    ResumeReport,
    SkippedCopy,
    StartRequest,
    StoredCopy,
)

__all__ = [
    "start_refusal",
    "start_attempt",
    "read_attempt_numbers",
    "attempt_info",
    "list_attempts",
    "report_resume",
    "resume_agreement",
]


def start_attempt(
    session: Session,
    job: Job,
    node: str,
    resumed_from: Position | None,
    *,
    at_least: int | None = None,
    request_key: str | None = None,
) -> Attempt:
    """Number a new process start of `node`: above every attempt seen so far, registered or committed
    (and at least `at_least`). A request re-sent with the `request_key` of one already answered (a
    client retrying after a lost answer) gets that attempt again instead of fencing it."""
    require_node(session, job, node)
    numbers = held.stored_attempt_numbers(session, job.id, node, request_key)
    if numbers is None:
        mine = {"job_id": job.id, "node": node, "key": request_key}
        # On the connection: attempts and copies go in with Core, so nothing pending needs a flush first.
        numbers = tuple(session.connection().execute(queries.ATTEMPT_NUMBERS, mine).one())
    registered, committed, answered = numbers
    registered = held.newest_attempt(session, job.id, node, registered)
    committed = held.newest_committed(session, job.id, node, committed)
    asked = _asked(resumed_from, at_least)
    if request_key is not None:
        again = held.keyed_attempt(session, job.id, node, request_key)
        if again is None and answered is not None:
            again = session.get(Attempt, (job.id, node, answered))
            assert again is not None, "the attempt the key named was read in this transaction"
        if again is not None:
            if again.request_body not in (None, asked):
                raise ApiError.invalid(
                    f"Idempotency-Key {request_key!r} was used for attempt {again.number} with another body: a retry "
                    "sends the same body; a new start sends a new key"
                )
            return again
    now = time.time()
    if max(registered or 0, committed or 0) + 1 >= ATTEMPT_LIMIT:
        raise ApiError(409, "conflict", f"{node}'s attempt counter is exhausted (numbers stop below {ATTEMPT_LIMIT})")
    attempt = Attempt(
        job_id=job.id,
        node=node,
        number=max(registered or 0, committed or 0, (at_least or 1) - 1) + 1,
        skipped=[],
        started_at=now,
        request_key=request_key,
        request_body=asked,
    )
    _set_resumed(attempt, resumed_from, now)
    held.hold(session, attempt)
    emit(session, "attempt.started", job.name, node=node, attempt=str(attempt.number), **_resumed(resumed_from))
    if registered:
        emit(session, "node.fenced", job.name, node=node, attempt=str(registered), by=str(attempt.number))
    return attempt


def start_refusal(session: Session, job: Job, node: str, start: StartRequest) -> tuple[str | None, list[StoredCopy]]:
    """Why a one-request start must not register a new attempt (None: it may), and the copies it listed
    that have no record: the job was declared again since the node checked its declaration, or its
    storage holds copies the service never recorded (they must be recorded before a new attempt
    fences theirs)."""
    if job.updated_at != start.declared_at:
        return "the job's declaration changed since this node read it", []
    if not start.stored:
        return None, []
    columns = select(Checkpoint.epoch, Checkpoint.batch_key, Checkpoint.attempt, Checkpoint.tier)
    rows = session.execute(columns.where(Checkpoint.job_id == job.id, Checkpoint.node == node))
    recorded = {tuple(row) for row in rows}
    unknown = [c for c in start.stored if (c.epoch, batch_key(c.batch), c.attempt, c.tier) not in recorded]
    return ("this node holds copies the service has no record of" if unknown else None), unknown


def _asked(resumed_from: Position | None, at_least: int | None) -> str:
    """What a registration asked, in a few characters: where it resumed from and `at_least`."""
    where = "-" if resumed_from is None else f"{resumed_from.epoch}.{resumed_from.batch}"
    return f"{where}|{at_least or '-'}"


def read_attempt_numbers(session: Session, registrations: list[tuple[Job, str, str | None]]) -> None:
    """Read, for a batch whose new rows are held, what its `registrations` (job, node, Idempotency-Key)
    will ask `start_attempt` for, in one or two round trips instead of one each."""
    rows = held.held_rows(session)
    if rows is None or not registrations:
        return
    job_ids = sorted({job.id for job, _, _ in registrations})
    nodes = sorted({node for _, node, _ in registrations})
    found: dict[tuple[str, int, str], int] = {}
    for kind, job_id, node, number in session.connection().execute(
        queries.NEWEST_ATTEMPTS_OF_NODES, {"job_ids": job_ids, "nodes": nodes}
    ):
        found[(kind, job_id, node)] = number
    for job, node, _ in registrations:
        rows.stored_numbers[(job.id, node)] = (found.get(("a", job.id, node)), found.get(("c", job.id, node)))
    keys = sorted({key for _, _, key in registrations if key is not None})
    if keys:
        rows.stored_keys.update(((job.id, node, key), None) for job, node, key in registrations if key is not None)
        for job_id, node, key, number in session.connection().execute(
            queries.KEYED_ATTEMPTS, {"job_ids": job_ids, "keys": keys}
        ):
            where = (job_id, node, key)
            if key is not None and where in rows.stored_keys:  # the highest, as queries.ATTEMPT_NUMBERS reads it
                rows.stored_keys[where] = max(number, rows.stored_keys[where] or 0)


def _resumed(position: Position | None) -> dict[str, Any]:
    body = PositionBody.of(position)
    return {"resumed_from": None if body is None else body.model_dump()}


def _set_resumed(attempt: Attempt, position: Position | None, now: float) -> None:
    attempt.resumed_epoch = None if position is None else position.epoch
    attempt.resumed_batch_key = None if position is None else batch_key(position.batch)
    attempt.resumed_at = None if position is None else now


def attempt_info(job: Job, attempt: Attempt) -> AttemptInfo:
    return AttemptInfo(
        job=job.name,
        node=attempt.node,
        attempt=str(attempt.number),
        resumed_from=PositionBody.of(attempt.resumed_from),
        skipped=[SkippedCopy.model_validate(s) for s in attempt.skipped or []],
        started_at=attempt.started_at,
        resumed_at=attempt.resumed_at,
        audit=None if attempt.audit is None else ResumeAudit.model_validate(attempt.audit),
    )


def list_attempts(session: Session, job: Job, *, node: str | None, page: Page) -> list[AttemptInfo]:
    query = select(Attempt).where(Attempt.job_id == job.id)
    if node is not None:
        query = query.where(Attempt.node == node)
    query = query.order_by(Attempt.started_at, Attempt.node, Attempt.number).limit(page.limit).offset(page.offset)
    return [attempt_info(job, a) for a in session.scalars(query)]


def _newest_attempt(session: Session, job: Job, node: str, number: int) -> Attempt:
    """Attempt `number` of `node`, if it is the node's newest (404 if unknown, 409 `fenced` if not)."""
    attempt = session.get(Attempt, (job.id, node, number))
    if attempt is None:
        raise ApiError.not_found(f"{node} has no attempt {number} in job {job.name!r}")
    newest = session.scalar(select(func.max(Attempt.number)).where(Attempt.job_id == job.id, Attempt.node == node))
    if newest is not None and newest > number:
        raise ApiError(409, "fenced", f"attempt {number} of {node} is fenced: attempt {newest} started since")
    return attempt


def report_resume(session: Session, job: Job, node: str, number: int, body: ResumeReport) -> Attempt:
    """Record where attempt `number` of `node` resumed (after verifying its part there) and what it skipped."""
    attempt = _newest_attempt(session, job, node, number)
    _set_resumed(attempt, None if body.resumed_from is None else body.resumed_from.to_position(), time.time())
    attempt.skipped = [s.model_dump(mode="json") for s in body.skipped]
    resumed = None if body.resumed_from is None else body.resumed_from.to_position()
    emit(
        session,
        "attempt.started",
        job.name,
        node=node,
        attempt=str(number),
        reported=True,
        skipped=attempt.skipped,
        **_resumed(resumed),
    )
    return attempt


def record_audit(session: Session, job: Job, node: str, number: int, body: ResumeAudit) -> Attempt:
    """Keep attempt `number`'s resume audit and say it: `resume.audited`. Only the node's newest attempt
    reports one (an older one is fenced), once (the same audit again changes nothing; another is a
    conflict: a verdict is not rewritten), about a position the node has a checkpoint at."""
    attempt = _newest_attempt(session, job, node, number)
    audit = body.model_dump(mode="json")
    if attempt.audit is not None:
        if attempt.audit != audit:
            raise ApiError(409, "conflict", f"attempt {number} of {node} already reported its resume audit")
        return attempt
    if body.position is not None:
        position = body.position.to_position()
        held = select(Checkpoint.id).where(
            Checkpoint.job_id == job.id,
            Checkpoint.node == node,
            Checkpoint.epoch == position.epoch,
            Checkpoint.batch_key == batch_key(position.batch),
        )
        forked_at = job.parent_epoch == position.epoch and job.parent_batch_key == batch_key(position.batch)
        if not forked_at and session.scalar(held.limit(1)) is None:
            raise ApiError.invalid(f"{node} has no checkpoint at {position} in job {job.name!r}: nothing to audit")
    attempt.audit = audit
    emit(
        session,
        "resume.audited",
        job.name,
        node=node,
        position=None if body.position is None else body.position.to_position(),
        attempt=str(number),
        verdict=body.verdict,
        differences=body.differences,
    )
    return attempt


WAITING_SHOWN = 100  # an agreement names this many of the nodes it waits for (all are counted)


def resume_agreement(session: Session, job: Job) -> ResumeAgreement:
    """Whether every expected node's newest attempt reported the job's resume position since it first
    existed. Every node of a restarting job polls this: it is two aggregate queries, whatever the job's
    size (bench/storm.py), and names at most WAITING_SHOWN of the nodes still waited for."""
    resume = job.resume
    if resume is None:
        return ResumeAgreement(job=job.name, resume=None, agreed=True, waiting=[], waiting_count=0)
    key = batch_key(resume.batch)
    born = session.scalar(
        select(func.min(Checkpoint.created_at)).where(
            Checkpoint.job_id == job.id, Checkpoint.epoch == resume.epoch, Checkpoint.batch_key == key
        )
    )
    newest = (
        select(Attempt.node, func.max(Attempt.number).label("number"))
        .where(Attempt.job_id == job.id)
        .group_by(Attempt.node)
        .subquery()
    )
    agreed = set(
        session.scalars(
            select(Attempt.node)
            .join(newest, (Attempt.node == newest.c.node) & (Attempt.number == newest.c.number))
            .where(
                Attempt.job_id == job.id,
                Attempt.resumed_epoch == resume.epoch,
                Attempt.resumed_batch_key == key,
                Attempt.resumed_at >= (born or 0.0),
            )
        )
    )
    # The nodes the position was judged with: a node set changed since applies to later positions only.
    row = session.get(PositionRow, (job.id, resume.epoch, key))
    nodes = expected_nodes(session, job, None if row is None else row.nodes_version)
    waiting = [node for node in nodes if node not in agreed]
    return ResumeAgreement(
        job=job.name,
        resume=PositionBody.of(resume),
        agreed=not waiting,
        waiting=waiting[:WAITING_SHOWN],
        waiting_count=len(waiting),
    )
