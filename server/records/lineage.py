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
from ckptstore.server.db.models import Job, batch_key, position_of
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
    parent already recorded, 404 when the parent job is not declared, 422 when it would make a cycle."""
    if parent is None:
        return
    known = parent_of(job)
    if known is not None:
        if known != parent:
            raise ApiError(409, "conflict", f"job {job.name!r} was forked from {known}, not {parent}")
        return
    if parent.job == job.name:
        raise ApiError.invalid(f"job {job.name!r} cannot be forked from itself")
    if session.scalar(select(Job.id).where(Job.name == parent.job)) is None:
        raise ApiError(404, "not_found", f"parent job {parent.job!r} is not declared")
    if job.name in {a.job for a in _ancestors(session, parent)}:
        raise ApiError.invalid(f"forking {job.name!r} from {parent} would make a cycle")
    job.parent_job = parent.job
    job.parent_epoch = parent.position.epoch
    job.parent_batch_key = batch_key(parent.position.batch)


def _ancestors(session: Session, start: ForkPoint) -> list[ForkPoint]:
    """`start`, its job's parent, and so on (bounded, in case the records hold a cycle)."""
    chain = [start]
    while len(chain) < _DEPTH_LIMIT:
        row = session.scalar(select(Job).where(Job.name == chain[-1].job))
        parent = None if row is None else parent_of(row)
        if parent is None or parent in chain:
            break
        chain.append(parent)
    return chain


def lineage(session: Session, job: Job) -> Lineage:
    parent = parent_of(job)
    children = session.scalars(select(Job).where(Job.parent_job == job.name).order_by(Job.name))
    return Lineage(
        job=job.name,
        parent=parent,
        ancestors=[] if parent is None else _ancestors(session, parent),
        children=[ForkPoint(job=c.name, position=PositionBody.of(c.parent_position)) for c in children],
    )


def fork_points(session: Session, job: Job) -> set[Position]:
    """The positions of `job` that a declared child was forked from."""
    rows = session.execute(select(Job.parent_epoch, Job.parent_batch_key).where(Job.parent_job == job.name)).all()
    return {p for epoch, key in rows if (p := position_of(epoch, key)) is not None}
