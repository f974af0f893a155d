"""The service's rules over its records: jobs, attempts, commits, marks, goodness and last good.

Invariants: every write path locks its job row first, so per-job decisions (attempt numbers,
fencing, a position's goodness) never race; `positions.good` and the job's cached last-good and
resume position change only through `_judge_position`, right where a commit or mark lands.
"""

from __future__ import annotations

import time

from sqlalchemy import delete, func, select, tuple_
from sqlalchemy.orm import Session

from ckptstore.layout import checkpoint_location
from ckptstore.names import attempt_sort_key
from ckptstore.position import Position
from ckptstore.retention import Candidate, plan_deletions
from ckptstore.schema import (
    AttemptInfo,
    CheckpointRecord,
    CommitRequest,
    GcDeletion,
    GcPlan,
    JobInfo,
    JobSpec,
    LastGood,
    MarkRequest,
    NodeLocation,
    NotGood,
    PositionBody,
    RetentionSpec,
)
from server.errors import ApiError
from server.models import END_OF_EPOCH, Attempt, Checkpoint, Job, NodeSet, PositionRow, batch_key, batch_of
from server.settings import root_is_allowed

__all__ = [
    "find_job",
    "lock_job",
    "put_job",
    "job_info",
    "expected_nodes",
    "start_attempt",
    "list_attempts",
    "commit_checkpoint",
    "mark_checkpoint",
    "list_checkpoints",
    "last_good",
    "gc_plan",
    "delete_job",
    "attempt_info",
    "NOT_GOOD_LIMIT",
]

NOT_GOOD_LIMIT = 20


def find_job(session: Session, name: str) -> Job:
    job = session.scalar(select(Job).where(Job.name == name))
    if job is None:
        raise ApiError.not_found(f"job {name!r} is not declared")
    return job


def lock_job(session: Session, name: str) -> Job:
    """The job row, locked for the rest of the transaction (SQLite: the whole DB is already locked)."""
    job = session.scalar(select(Job).where(Job.name == name).with_for_update())
    if job is None:
        raise ApiError.not_found(f"job {name!r} is not declared")
    return job


def expected_nodes(session: Session, job: Job, version: int | None = None) -> list[str]:
    return session.get(NodeSet, (job.id, version or job.nodes_version)).nodes


def resume_position(job: Job) -> Position | None:
    if job.resume_epoch is None:
        return None
    return Position(job.resume_epoch, batch_of(job.resume_batch_key))


def job_info(session: Session, job: Job) -> JobInfo:
    return JobInfo(
        job=job.name,
        nodes=expected_nodes(session, job),
        storage_root=job.storage_root,
        retention=RetentionSpec.model_validate(job.retention),
        last_good_epoch=job.last_good_epoch,
        resume=PositionBody.of(resume_position(job)),
        created_at=job.created_at,
        updated_at=job.updated_at,
    )


def put_job(
    session: Session, name: str, spec: JobSpec, *, default_root: str, allowed_roots: list[str]
) -> tuple[Job, bool]:
    """Declare or update a job; a changed node set applies to positions first written after it."""
    root = (spec.storage_root or default_root).rstrip("/") or "/"
    if not root_is_allowed(root, allowed_roots):
        raise ApiError(403, "forbidden", f"storage root {root!r} is not under an allowed root")
    now = time.time()
    job = session.scalar(select(Job).where(Job.name == name).with_for_update())
    created = job is None
    if created:
        job = Job(
            name=name,
            storage_root=root,
            retention=spec.retention.model_dump(),
            nodes_version=1,
            version=1,
            created_at=now,
            updated_at=now,
        )
        session.add(job)
        session.flush()
        session.add(NodeSet(job_id=job.id, version=1, nodes=list(spec.nodes)))
        return job, True
    if root != job.storage_root and session.scalar(select(Checkpoint.id).where(Checkpoint.job_id == job.id).limit(1)):
        raise ApiError(409, "conflict", f"job {name!r} already has checkpoints under {job.storage_root!r}")
    job.storage_root = root
    job.retention = spec.retention.model_dump()
    if sorted(expected_nodes(session, job)) != sorted(spec.nodes):
        job.nodes_version += 1
        session.add(NodeSet(job_id=job.id, version=job.nodes_version, nodes=list(spec.nodes)))
    job.updated_at = now
    job.version += 1
    return job, False


def _require_node(session: Session, job: Job, node: str) -> None:
    if node not in expected_nodes(session, job):
        raise ApiError.invalid(f"node {node!r} is not one of job {job.name!r}'s expected nodes")


def start_attempt(session: Session, job: Job, node: str, resumed_from: Position | None) -> Attempt:
    """Number a new process start of `node`: above every attempt seen so far, registered or committed."""
    _require_node(session, job, node)
    registered = session.scalar(select(func.max(Attempt.number)).where(Attempt.job_id == job.id, Attempt.node == node))
    committed = session.scalar(
        select(func.max(Checkpoint.attempt_number)).where(Checkpoint.job_id == job.id, Checkpoint.node == node)
    )
    attempt = Attempt(
        job_id=job.id,
        node=node,
        number=max(registered or 0, committed or 0) + 1,
        resumed_epoch=None if resumed_from is None else resumed_from.epoch,
        resumed_batch_key=None if resumed_from is None else batch_key(resumed_from.batch),
        started_at=time.time(),
    )
    session.add(attempt)
    session.flush()
    return attempt


def attempt_info(job: Job, attempt: Attempt) -> AttemptInfo:
    resumed = None
    if attempt.resumed_epoch is not None:
        resumed = PositionBody(epoch=attempt.resumed_epoch, batch=batch_of(attempt.resumed_batch_key))
    return AttemptInfo(
        job=job.name, node=attempt.node, attempt=attempt.number, resumed_from=resumed, started_at=attempt.started_at
    )


def list_attempts(session: Session, job: Job, *, node: str | None = None) -> list[AttemptInfo]:
    query = select(Attempt).where(Attempt.job_id == job.id)
    if node is not None:
        query = query.where(Attempt.node == node)
    return [attempt_info(job, a) for a in session.scalars(query.order_by(Attempt.started_at, Attempt.number))]


def _record(job: Job, row: Checkpoint) -> CheckpointRecord:
    return CheckpointRecord(
        job=job.name,
        node=row.node,
        epoch=row.epoch,
        batch=batch_of(row.batch_key),
        attempt=row.attempt,
        step=row.step,
        location=row.location,
        bytes=row.bytes,
        checksums=row.checksums,
        metrics=row.metrics,
        state=row.state,
        created_at=row.created_at,
    )


def commit_checkpoint(session: Session, job: Job, node: str, body: CommitRequest) -> tuple[CheckpointRecord, bool]:
    """Record a committed checkpoint; returns (record, created). Identical re-posts are no-ops."""
    _require_node(session, job, node)
    position = body.position
    attempt = str(body.attempt)
    expected = checkpoint_location(job.storage_root, job.name, node, position, attempt)
    if body.location != expected:
        raise ApiError.invalid(f"location must be {expected!r}, the key built from root, job, node, position, attempt")
    number, suffix = attempt_sort_key(attempt)
    newest_registered = session.scalar(
        select(func.max(Attempt.number)).where(Attempt.job_id == job.id, Attempt.node == node)
    )
    if newest_registered is not None and (number, suffix) < (newest_registered, ""):
        raise ApiError(
            409, "fenced", f"attempt {attempt} of {node} is fenced: attempt {newest_registered} started since"
        )
    key = batch_key(position.batch)
    existing = session.scalar(
        select(Checkpoint).where(
            Checkpoint.job_id == job.id,
            Checkpoint.node == node,
            Checkpoint.epoch == position.epoch,
            Checkpoint.batch_key == key,
            Checkpoint.attempt == attempt,
        )
    )
    if existing is not None:
        same = (existing.location, existing.bytes, existing.checksums, existing.step) == (
            body.location,
            body.bytes,
            body.checksums,
            body.step,
        )
        if not same:
            raise ApiError(
                409, "conflict", f"attempt {attempt} of {node} already committed {position} with other content"
            )
        return _record(job, existing), False
    row = Checkpoint(
        job_id=job.id,
        node=node,
        epoch=position.epoch,
        batch_key=key,
        attempt=attempt,
        attempt_number=number,
        attempt_suffix=suffix,
        step=body.step,
        location=body.location,
        bytes=body.bytes,
        checksums=body.checksums,
        metrics=body.metrics,
        state="committed",
        created_at=time.time(),
    )
    session.add(row)
    if session.get(PositionRow, (job.id, position.epoch, key)) is None:
        session.add(
            PositionRow(job_id=job.id, epoch=position.epoch, batch_key=key, nodes_version=job.nodes_version, good=False)
        )
    session.flush()
    _judge_position(session, job, position.epoch, key)
    job.version += 1
    return _record(job, row), True


def mark_checkpoint(session: Session, job: Job, node: str, body: MarkRequest) -> list[CheckpointRecord]:
    """Mark one attempt (default: the newest) of a node's position corrupt or deleted; demotes the position."""
    key = batch_key(body.batch)
    rows = list(
        session.scalars(
            select(Checkpoint).where(
                Checkpoint.job_id == job.id,
                Checkpoint.node == node,
                Checkpoint.epoch == body.epoch,
                Checkpoint.batch_key == key,
            )
        )
    )
    if body.attempt is not None:
        rows = [r for r in rows if r.attempt == str(body.attempt)]
    elif rows:
        rows = [max(rows, key=lambda r: (r.attempt_number, r.attempt_suffix))]
    if not rows:
        raise ApiError.not_found(f"no checkpoint of {node} at {Position(body.epoch, body.batch)} in job {job.name!r}")
    for row in rows:
        row.state = body.state
        row.reason = body.reason
    session.flush()
    _judge_position(session, job, body.epoch, key)
    job.version += 1
    return [_record(job, r) for r in rows]


def _heads_at(
    session: Session, job: Job, positions: list[tuple[int, int]]
) -> dict[tuple[int, int], dict[str, Checkpoint]]:
    """Each node's newest attempt (the one that counts) at each of `positions` (epoch, batch_key), in one query."""
    heads: dict[tuple[int, int], dict[str, Checkpoint]] = {p: {} for p in positions}
    if not positions:
        return heads
    rows = session.scalars(
        select(Checkpoint).where(
            Checkpoint.job_id == job.id, tuple_(Checkpoint.epoch, Checkpoint.batch_key).in_(positions)
        )
    )
    for row in rows:
        at = heads[(row.epoch, row.batch_key)]
        current = at.get(row.node)
        if current is None or (row.attempt_number, row.attempt_suffix) > (
            current.attempt_number,
            current.attempt_suffix,
        ):
            at[row.node] = row
    return heads


def _heads(session: Session, job: Job, epoch: int, key: int) -> dict[str, Checkpoint]:
    return _heads_at(session, job, [(epoch, key)])[(epoch, key)]


def _judge_position(session: Session, job: Job, epoch: int, key: int) -> None:
    position = session.get(PositionRow, (job.id, epoch, key))
    heads = _heads(session, job, epoch, key)
    good = all(
        n in heads and heads[n].state == "committed" for n in expected_nodes(session, job, position.nodes_version)
    )
    if good == position.good:
        return
    position.good = good
    session.flush()
    _refresh_last_good(session, job)


def _newest_good(session: Session, job: Job, *, end_of_epoch: bool, max_epoch: int | None = None) -> Position | None:
    query = select(PositionRow.epoch, PositionRow.batch_key).where(
        PositionRow.job_id == job.id, PositionRow.good.is_(True)
    )
    if end_of_epoch:
        query = query.where(PositionRow.batch_key == END_OF_EPOCH)
    if max_epoch is not None:
        query = query.where(PositionRow.epoch <= max_epoch)
    row = session.execute(query.order_by(PositionRow.epoch.desc(), PositionRow.batch_key.desc()).limit(1)).first()
    return None if row is None else Position(row.epoch, batch_of(row.batch_key))


def _refresh_last_good(session: Session, job: Job) -> None:
    last = _newest_good(session, job, end_of_epoch=True)
    resume = _newest_good(session, job, end_of_epoch=False)
    job.last_good_epoch = None if last is None else last.epoch
    job.resume_epoch = None if resume is None else resume.epoch
    job.resume_batch_key = None if resume is None else batch_key(resume.batch)


def last_good(session: Session, job: Job, *, max_epoch: int | None = None) -> LastGood:
    """The last good epoch, the resume position, where each node's part of it is, and why newer is not good."""
    if max_epoch is None:
        epoch, resume = job.last_good_epoch, resume_position(job)
    else:
        last = _newest_good(session, job, end_of_epoch=True, max_epoch=max_epoch)
        epoch, resume = (
            (None if last is None else last.epoch),
            _newest_good(session, job, end_of_epoch=False, max_epoch=max_epoch),
        )
    nodes = {}
    if resume is not None:
        for node, head in sorted(_heads(session, job, resume.epoch, batch_key(resume.batch)).items()):
            nodes[node] = NodeLocation(location=head.location, attempt=head.attempt)
    newer = select(PositionRow).where(PositionRow.job_id == job.id, PositionRow.good.is_(False))
    if resume is not None:
        newer = newer.where(tuple_(PositionRow.epoch, PositionRow.batch_key) > (resume.epoch, batch_key(resume.batch)))
    if max_epoch is not None:
        newer = newer.where(PositionRow.epoch <= max_epoch)
    not_good = []
    rows = list(
        session.scalars(newer.order_by(PositionRow.epoch.desc(), PositionRow.batch_key.desc()).limit(NOT_GOOD_LIMIT))
    )
    heads_by_position = _heads_at(session, job, [(row.epoch, row.batch_key) for row in rows])
    for row in rows:
        heads = heads_by_position[(row.epoch, row.batch_key)]
        expected = expected_nodes(session, job, row.nodes_version)
        not_good.append(
            NotGood(
                epoch=row.epoch,
                batch=batch_of(row.batch_key),
                missing=[n for n in expected if n not in heads or heads[n].state == "deleted"],
                corrupt=[n for n in expected if n in heads and heads[n].state == "corrupt"],
            )
        )
    return LastGood(job=job.name, epoch=epoch, resume=PositionBody.of(resume), nodes=nodes, not_good=not_good)


def list_checkpoints(
    session: Session, job: Job, *, node: str | None, epoch: int | None, state: str | None, limit: int, offset: int
) -> list[CheckpointRecord]:
    query = select(Checkpoint).where(Checkpoint.job_id == job.id)
    for column, value in ((Checkpoint.node, node), (Checkpoint.epoch, epoch), (Checkpoint.state, state)):
        if value is not None:
            query = query.where(column == value)
    query = (
        query.order_by(
            Checkpoint.epoch,
            Checkpoint.batch_key,
            Checkpoint.node,
            Checkpoint.attempt_number,
            Checkpoint.attempt_suffix,
        )
        .limit(limit)
        .offset(offset)
    )
    return [_record(job, row) for row in session.scalars(query)]


def gc_plan(session: Session, job: Job, *, now: float) -> GcPlan:
    """Apply the job's retention policy to its live records and the DB's knowledge of good positions."""
    policy = RetentionSpec.model_validate(job.retention).to_policy()
    rows = list(session.scalars(select(Checkpoint).where(Checkpoint.job_id == job.id, Checkpoint.state != "deleted")))
    good = {
        Position(r.epoch, batch_of(r.batch_key))
        for r in session.execute(
            select(PositionRow.epoch, PositionRow.batch_key).where(
                PositionRow.job_id == job.id, PositionRow.good.is_(True)
            )
        )
    }
    candidates = [
        Candidate(
            node=r.node,
            position=Position(r.epoch, batch_of(r.batch_key)),
            attempt=r.attempt,
            committed=r.state == "committed",
            modified=r.created_at,
            metric=r.metrics.get(policy.best_metric) if policy.best_metric else None,
        )
        for r in rows
    ]
    # Corrupt records count as not committed: they go with their position, or after the grace period.
    locations = {(r.node, r.epoch, r.batch_key, r.attempt): r.location for r in rows}
    deletions = [
        GcDeletion(
            node=d.node,
            epoch=d.position.epoch,
            batch=d.position.batch,
            attempt=d.attempt,
            location=locations[(d.node, d.position.epoch, batch_key(d.position.batch), d.attempt)],
            reason=d.reason,
        )
        for d in plan_deletions(candidates, good=good, policy=policy, now=now)
    ]
    return GcPlan(
        job=job.name,
        last_good_epoch=job.last_good_epoch,
        resume=PositionBody.of(resume_position(job)),
        deletions=deletions,
    )


def delete_job(session: Session, job: Job) -> None:
    session.execute(delete(Job).where(Job.id == job.id))
