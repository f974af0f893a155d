"""Forks: which checkpoint a job started from, its ancestry and its children.

A job declared with `parent` (a job and a position) is a fork of that checkpoint: its nodes start
from the parent's copies there and their first saves point at the parent's blobs. The parent is set
once (a later declaration without it keeps it; another one is refused), must exist, and may not make
a cycle. A parent's position that a child was forked from is never planned for deletion while the
child is declared (`fork_points`).
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from ckptstore.position import Position
from ckptstore.server.db.models import Job, PositionRow, batch_key, position_of
from ckptstore.server.errors import ApiError
from ckptstore.wire.schema import ForkPoint, Lineage, PositionBody

__all__ = ["set_parent", "parent_of", "lineage", "fork_points"]

_DEPTH_LIMIT = 1000


def parent_of(job: Job) -> ForkPoint | None:
    position = job.parent_position
    if job.parent_job is None or position is None:
        return None
    return ForkPoint(job=job.parent_job, position=PositionBody(epoch=position.epoch, batch=position.batch))


def set_parent(session: Session, job: Job, parent: ForkPoint | None) -> None:
    """Record that `job` was forked from `parent` (nothing when None); 409 when it differs from the
    parent already recorded, 404 when the parent job is not declared, 422 when it would make a cycle or
    its position is not a good position of the parent."""
    if parent is None:
        return
    known = parent_of(job)
    if known is not None:
        if known != parent:
            raise ApiError(409, "conflict", f"job {job.name!r} was forked from {known}, not {parent}")
        return
    if parent.job == job.name:
        raise ApiError.invalid(f"job {job.name!r} cannot be forked from itself")
    parent_row = session.scalar(select(Job).where(Job.name == parent.job))
    if parent_row is None:
        raise ApiError(404, "not_found", f"parent job {parent.job!r} is not declared")
    if job.name in {a.job for a in _ancestors(session, parent_row)}:
        raise ApiError.invalid(f"forking {job.name!r} from {parent} would make a cycle")
    point = parent.position.to_position()
    good = session.scalar(
        select(PositionRow.good).where(
            PositionRow.job_id == parent_row.id,
            PositionRow.epoch == point.epoch,
            PositionRow.batch_key == batch_key(point.batch),
        )
    )
    if not good:
        raise ApiError.invalid(f"{parent} is not a good position of {parent.job!r}: a fork starts from one")
    job.parent_job, job.parent_id = parent.job, parent_row.id
    job.parent_epoch = parent.position.epoch
    job.parent_batch_key = batch_key(parent.position.batch)


def _ancestors(session: Session, job: Job) -> list[ForkPoint]:
    """The checkpoints `job` descends from: its parent's, that job's parent's, and so on — each while
    the job it names is the one that was forked (by identity: a job declared anew under a forgotten
    parent's name is not it). Bounded, in case the records hold a cycle."""
    chain: list[ForkPoint] = []
    row: Job | None = job
    while row is not None and len(chain) < _DEPTH_LIMIT:
        point = parent_of(row)
        parent = None if point is None or row.parent_id is None else session.get(Job, row.parent_id)
        if point is None or parent is None or parent.name != point.job or point in chain:
            break
        chain.append(point)
        row = parent
    return chain


def lineage(session: Session, job: Job) -> Lineage:
    """The job's parent as declared, its ancestors still declared, and the jobs forked from it."""
    children = session.scalars(select(Job).where(Job.parent_id == job.id).order_by(Job.name))
    return Lineage(
        job=job.name,
        parent=parent_of(job),
        ancestors=_ancestors(session, job),
        children=[ForkPoint(job=c.name, position=PositionBody.of(c.parent_position)) for c in children],
    )


def fork_points(session: Session, job: Job) -> set[Position]:
    """The positions of `job` that a declared child was forked from (children of this job, not of an
    earlier job of the same name)."""
    rows = session.execute(select(Job.parent_epoch, Job.parent_batch_key).where(Job.parent_id == job.id)).all()
    return {p for epoch, key in rows if (p := position_of(epoch, key)) is not None}
