"""The service's rules over its records: jobs, attempts, commits, marks and the retention plan.

Invariant: every write path locks its job row first, so per-job decisions (attempt numbers,
fencing, a position's goodness) never race. Whether a position is good is `ckptstore.server.records.last_good`'s
to decide, right where a commit or mark lands.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import Row, delete, func, select
from sqlalchemy.orm import Session

from ckptstore.copykey import CopyKey
from ckptstore.format.layout import checkpoint_location, normalize_root
from ckptstore.names import ACCEPTED_ATTEMPT_LIMIT, attempt_sort_key
from ckptstore.position import Position
from ckptstore.retention import Candidate, plan_deletions
from ckptstore.server.db import queries
from ckptstore.server.db.models import Checkpoint, Job, NodeSet, PositionRow, batch_key, batch_of
from ckptstore.server.db.transaction import state_of
from ckptstore.server.errors import ApiError
from ckptstore.server.events.log import emit
from ckptstore.server.events.replication import replication_events
from ckptstore.server.http.paging import Page
from ckptstore.server.records import held, lineage
from ckptstore.server.records.last_good import bump, expected_nodes, is_expected, judge_position, read_node_sets
from ckptstore.server.settings import is_local_path, root_is_allowed
from ckptstore.wire.events import EventType
from ckptstore.wire.schema import (
    PEER_SCHEME,
    RETENTION_CAUSES,
    CheckpointRecord,
    CommitRequest,
    JobInfo,
    JobSpec,
    MarkRequest,
    PlannedDeletion,
    PositionBody,
    RetentionPlan,
    RetentionSpec,
    peer_holder,
)

__all__ = [
    "find_job",
    "lock_job",
    "lock_jobs",
    "put_job",
    "job_info",
    "commit_checkpoint",
    "mark_checkpoint",
    "list_checkpoints",
    "retention_plan",
    "delete_job",
    "require_node",
]


def find_job(session: Session, name: str) -> Job:
    job = session.scalar(select(Job).where(Job.name == name))
    if job is None:
        raise ApiError.not_found(f"job {name!r} is not declared")
    return job


def lock_job(session: Session, name: str) -> Job:
    """The job row, locked for the rest of the transaction (SQLite: the whole DB is already locked);
    locked once per transaction however many writes of a group commit need it."""
    locked = state_of(session).locked_jobs
    job = locked.get(name)
    if job is None:
        job = session.scalar(queries.LOCK_JOB, {"name": name})
        if job is None:
            raise ApiError.not_found(f"job {name!r} is not declared")
        locked[name] = job
    return job


def lock_jobs(session: Session, names: list[str]) -> None:
    """Lock the jobs of a group commit's writes in one statement, in name order (the order one-by-one
    locking takes), and read their node sets: `lock_job` and the node checks then find them held."""
    jobs = list(session.scalars(queries.LOCK_JOBS, {"names": names}))
    state_of(session).locked_jobs.update((job.name, job) for job in jobs)
    read_node_sets(session, jobs)


def job_info(session: Session, job: Job) -> JobInfo:
    return JobInfo(
        job=job.name,
        nodes=expected_nodes(session, job),
        storage_root=job.storage_root,
        local_root=job.local_root,
        retention=RetentionSpec.model_validate(job.retention),
        last_good_epoch=job.last_good_epoch,
        durable_epoch=job.durable_epoch,
        resume=PositionBody.of(job.resume),
        created_at=job.created_at,
        updated_at=job.updated_at,
        parent=lineage.parent_of(job),
    )


def put_job(
    session: Session, name: str, spec: JobSpec, *, default_root: str, allowed_roots: list[str]
) -> tuple[Job, bool]:
    """Declare or update a job; a changed node set applies to positions first written after it."""
    root = (spec.storage_root or default_root).rstrip("/") or "/"
    if not root_is_allowed(root, allowed_roots):
        raise ApiError(403, "forbidden", f"storage root {root!r} is not under an allowed root")
    local_root = None if spec.local_root is None else normalize_root(spec.local_root)
    if local_root is not None and not is_local_path(local_root):
        raise ApiError.invalid(f"local_root {local_root!r} must be an absolute path on the nodes, without '..'")
    now = time.time()
    job = session.scalar(select(Job).where(Job.name == name).with_for_update())
    if job is None:
        twin = session.scalar(select(Job.name).where(func.lower(Job.name) == name.lower()))
        if twin is not None:
            raise ApiError(
                409, "conflict", f"job {name!r} differs from job {twin!r} only by case (they would share storage)"
            )
        job = Job(
            name=name,
            storage_root=root,
            local_root=local_root,
            retention=spec.retention.model_dump(),
            nodes_version=1,
            version=1,
            created_at=now,
            updated_at=now,
        )
        lineage.set_parent(session, job, spec.parent)
        session.add(job)
        session.flush()
        session.add(NodeSet(job_id=job.id, version=1, nodes=list(spec.nodes)))
        emit(session, "job.declared", name, **_job_data(job, spec.nodes))
        return job, True
    if root != job.storage_root and session.scalar(select(Checkpoint.id).where(Checkpoint.job_id == job.id).limit(1)):
        raise ApiError(409, "conflict", f"job {name!r} already has checkpoints under {job.storage_root!r}")
    lineage.set_parent(session, job, spec.parent)
    job.storage_root = root
    job.local_root = local_root
    job.retention = spec.retention.model_dump()
    nodes_changed = sorted(expected_nodes(session, job)) != sorted(spec.nodes)
    if nodes_changed:
        _switch_node_set(session, job, spec.nodes)
    job.updated_at = now
    bump(session, job)
    emit(session, "job.updated", name, nodes_changed=nodes_changed, **_job_data(job, spec.nodes))
    return job, False


def _job_data(job: Job, nodes: list[str]) -> dict[str, Any]:
    return {"nodes": len(nodes), "storage_root": job.storage_root, "local_root": job.local_root}


def _switch_node_set(session: Session, job: Job, nodes: list[str]) -> None:
    """Make `nodes` the job's node set: a set it had before is reused, so re-declaring adds no rows."""
    for known in session.scalars(select(NodeSet).where(NodeSet.job_id == job.id)):
        if sorted(known.nodes) == sorted(nodes):
            job.nodes_version = known.version
            return
    newest = session.scalar(select(func.max(NodeSet.version)).where(NodeSet.job_id == job.id)) or 0
    job.nodes_version = newest + 1
    session.add(NodeSet(job_id=job.id, version=job.nodes_version, nodes=list(nodes)))


def require_node(session: Session, job: Job, node: str) -> None:
    if not is_expected(session, job, node):
        nodes = expected_nodes(session, job)
        shown = ", ".join(nodes[:8]) + (f", … ({len(nodes)} nodes)" if len(nodes) > 8 else "")
        raise ApiError.invalid(
            f"node {node!r} is not one of job {job.name!r}'s expected nodes [{shown}]: name each process after one "
            "of them (a count N declares node-0 … node-N-1, the names RANK=i gives), or declare the job's nodes again"
        )


_RECORDED = (
    "node",
    "epoch",
    "attempt",
    "step",
    "location",
    "bytes",
    "checksums",
    "metrics",
    "tier",
    "state",
    "reason",
    "cause",
)
_COMMITTED = ("tier", "step", "location", "bytes", "checksums", "metrics")  # a commit's fields a record keeps as sent


def _record(job: Job, row: Checkpoint | Row[Any]) -> CheckpointRecord:
    """The answer for a record: a loaded row, or a plain one of `queries.COPIES_AND_NEWEST`."""
    shown = {name: getattr(row, name) for name in _RECORDED}
    return CheckpointRecord(job=job.name, batch=batch_of(row.batch_key), created_at=row.created_at, **shown)


def _tier_root(session: Session, job: Job, body: CommitRequest) -> str:
    """The root a copy's location must start with: the job's storage root, its local root, or for a peer
    copy `peer://<holding node>` (the node whose local tier holds it, one of the job's nodes)."""
    if body.tier == "durable":
        return job.storage_root
    if body.tier == "peer":
        holder = peer_holder(body.location)
        if holder is None or not is_expected(session, job, holder):
            raise ApiError.invalid(f"a peer copy's location is {PEER_SCHEME}<one of the job's nodes>/…")
        return PEER_SCHEME + holder
    if job.local_root is None:
        raise ApiError.invalid(f"job {job.name!r} has no local tier: declare its local_root first")
    return job.local_root


def commit_checkpoint(session: Session, job: Job, node: str, body: CommitRequest) -> tuple[CheckpointRecord, bool]:
    """Record a committed checkpoint; returns (record, created). Identical re-posts are no-ops."""
    require_node(session, job, node)
    position = body.position
    attempt = body.attempt
    root = _tier_root(session, job, body)
    expected = checkpoint_location(root, job.name, node, position, attempt)
    if body.location != expected:
        raise ApiError.invalid(f"location must be {expected!r}, the key built from root, job, node, position, attempt")
    number, suffix = attempt_sort_key(attempt)
    if number >= ACCEPTED_ATTEMPT_LIMIT:
        raise ApiError.invalid(
            f"attempt {attempt}: attempts from outside are accepted below {ACCEPTED_ATTEMPT_LIMIT}, so that the "
            "node's counter can always go on"
        )
    key = batch_key(position.batch)
    found = (
        session.connection()
        .execute(
            queries.COPIES_AND_NEWEST,
            {"job_id": job.id, "node": node, "epoch": position.epoch, "key": key, "attempt": attempt},
        )
        .all()
    )
    newest_registered = held.newest_attempt(session, job.id, node, found[0].newest_registered)
    held_copies = held.copies_of(session, (job.id, node, position.epoch, key, attempt))
    copies: dict[str, Checkpoint | Row[Any]] = {row.tier: row for row in found if row.tier is not None}
    copies.update((row.tier, row) for row in held_copies)
    # An older attempt may add a copy of a checkpoint it already recorded (replication finishing after
    # a restart); a new checkpoint from it is a zombie's.
    another_copy = any((c.bytes, c.checksums) == (body.bytes, body.checksums) for c in copies.values())
    if newest_registered is not None and (number, suffix) < (newest_registered, "") and not another_copy:
        raise ApiError(
            409, "fenced", f"attempt {attempt} of {node} is fenced: attempt {newest_registered} started since"
        )
    existing = copies.get(body.tier)
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
        state="committed",
        created_at=time.time(),
        **{name: getattr(body, name) for name in _COMMITTED},
    )
    held.hold(session, row)
    held.hold_position(session, job, position.epoch, key, known=found[0].position_known, node=node)
    judge_position(session, job, position)
    bump(session, job)
    emit(
        session,
        "checkpoint.committed",
        job.name,
        node=node,
        position=position,
        attempt=attempt,
        **{name: getattr(body, name) for name in ("tier", "location", "bytes", "step")},
    )
    replication_events(session, job, node, position, attempt, body.tier)
    return _record(job, row), True


def mark_checkpoint(session: Session, job: Job, node: str, body: MarkRequest) -> list[CheckpointRecord]:
    """Mark one attempt (default: the newest) of a node's position corrupt, missing or deleted — its copy
    on one tier, or on every tier; the judge re-decides the position."""
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
    attempt = body.attempt
    if attempt is None and rows:
        attempt = max((r.attempt for r in rows), key=attempt_sort_key)
    rows = [r for r in rows if r.attempt == attempt and body.tier in (None, r.tier)]
    position = Position(body.epoch, body.batch)
    if not rows:
        raise ApiError.not_found(f"no checkpoint of {node} at {position} in job {job.name!r}")
    for row in rows:
        row.state, row.reason, row.cause = body.state, body.reason, body.cause
    session.flush()
    judge_position(session, job, position)
    bump(session, job)
    if body.state == "deleted" and body.cause in RETENTION_CAUSES:
        kind: EventType = "retention.deleted"
    else:
        kind = "replicas.disagreed" if body.cause == "agreement" else "copy.marked"
    emit(
        session,
        kind,
        job.name,
        node=node,
        position=position,
        attempt=attempt,
        state=body.state,
        tiers=sorted(r.tier for r in rows),
        cause=body.cause,
        reason=body.reason,
    )
    return [_record(job, r) for r in rows]


def list_checkpoints(
    session: Session, job: Job, *, node: str | None, epoch: int | None, state: str | None, page: Page
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
        .limit(page.limit)
        .offset(page.offset)
    )
    return [_record(job, row) for row in session.scalars(query)]


def retention_plan(session: Session, job: Job, *, now: float) -> RetentionPlan:
    """Apply the job's retention policy to its live records and the DB's knowledge of good positions."""
    policy = RetentionSpec.model_validate(job.retention).to_policy()
    rows = list(session.scalars(select(Checkpoint).where(Checkpoint.job_id == job.id, Checkpoint.state != "deleted")))
    good = {
        r.position
        for r in session.scalars(select(PositionRow).where(PositionRow.job_id == job.id, PositionRow.good.is_(True)))
    }
    forked_from = lineage.fork_points(session, job)  # a declared child may still start from these
    copies: dict[CopyKey, list[Checkpoint]] = {}  # an attempt's copies on every tier, by its durable key
    for r in rows:
        copies.setdefault(CopyKey(job.name, r.node, r.position, r.attempt), []).append(r)
    # One candidate per attempt: committed when a copy on any tier is; corrupt and missing copies
    # count as not committed: they go with their position, or after the grace period.
    candidates = [
        Candidate(
            key=key,
            committed=any(r.state == "committed" for r in found),
            modified=min(r.created_at for r in found),
            metric=found[0].metrics.get(policy.best_metric) if policy.best_metric else None,
        )
        for key, found in copies.items()
    ]
    deletions = [
        PlannedDeletion(
            node=d.key.node,
            epoch=d.key.position.epoch,
            batch=d.key.position.batch,
            attempt=d.key.attempt,
            tier=r.tier,
            location=r.location,
            reason=d.reason,
        )
        for d in plan_deletions(candidates, good=good, policy=policy, now=now)
        if d.key.position not in forked_from
        for r in copies[d.key]
    ]
    return RetentionPlan(
        job=job.name,
        last_good_epoch=job.last_good_epoch,
        resume=PositionBody.of(job.resume),
        deletions=deletions,
    )


def delete_job(session: Session, job: Job) -> None:
    session.execute(delete(Job).where(Job.id == job.id))
    emit(session, "job.deleted", job.name)
    state = state_of(session)
    state.locked_jobs.pop(job.name, None)
    state.changed_jobs[job.name] = None  # other processes forget its answers
