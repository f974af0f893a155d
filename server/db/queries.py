"""The hot write path's SQL statements, built once with bind parameters.

Building a SQLAlchemy expression costs more than running it: a 4,096-node job registering or
committing at once would spend most of the writer's time building the same queries again. Each
statement here takes its values as parameters (`session.execute(STATEMENT, {...})`).
"""

from __future__ import annotations

from sqlalchemy import bindparam, distinct, exists, func, literal, select, union_all

from ckptstore.server.db.models import Attempt, Checkpoint, Job, PositionRow

__all__ = [
    "LOCK_JOB",
    "LOCK_JOBS",
    "COPIES_AND_NEWEST",
    "ATTEMPT_NUMBERS",
    "NODES_WITH_INTACT_COPY",
    "NEWEST_ATTEMPTS_OF_NODES",
    "KEYED_ATTEMPTS",
]

LOCK_JOB = select(Job).where(Job.name == bindparam("name")).with_for_update()
LOCK_JOBS = select(Job).where(Job.name.in_(bindparam("names", expanding=True))).order_by(Job.name).with_for_update()

_NEWEST_REGISTERED = (
    select(func.max(Attempt.number))
    .where(Attempt.job_id == bindparam("job_id"), Attempt.node == bindparam("node"))
    .scalar_subquery()
)
_POSITION_KNOWN = exists().where(
    PositionRow.job_id == bindparam("job_id"),
    PositionRow.epoch == bindparam("epoch"),
    PositionRow.batch_key == bindparam("key"),
)
_ONE_ROW = select(literal(1).label("one")).subquery()
_CHECKPOINTS = Checkpoint.__table__
# An attempt's copies of a position, the node's newest registered attempt and whether the position
# has its row yet, in one round trip: one row of the last two, outer-joined to each copy (the copy's
# columns None where there is none). Plain rows, run on the connection: no ORM loading, and no
# autoflush of the batch's pending job versions, which this does not read.
COPIES_AND_NEWEST = (
    select(_NEWEST_REGISTERED.label("newest_registered"), _POSITION_KNOWN.label("position_known"), *_CHECKPOINTS.c)
    .select_from(_ONE_ROW)
    .outerjoin(
        _CHECKPOINTS,
        (_CHECKPOINTS.c.job_id == bindparam("job_id"))
        & (_CHECKPOINTS.c.node == bindparam("node"))
        & (_CHECKPOINTS.c.epoch == bindparam("epoch"))
        & (_CHECKPOINTS.c.batch_key == bindparam("key"))
        & (_CHECKPOINTS.c.attempt == bindparam("attempt")),
    )
)

_MINE = (Attempt.job_id == bindparam("job_id")) & (Attempt.node == bindparam("node"))
# A node's newest registered attempt, newest committed one, and the one registered with a request key.
ATTEMPT_NUMBERS = select(
    select(func.max(Attempt.number)).where(_MINE).scalar_subquery(),
    select(func.max(Checkpoint.attempt_number))
    .where(Checkpoint.job_id == bindparam("job_id"), Checkpoint.node == bindparam("node"))
    .scalar_subquery(),
    select(func.max(Attempt.number)).where(_MINE, Attempt.request_key == bindparam("key")).scalar_subquery(),
)

# Several nodes' newest registered (kind "a") and newest committed (kind "c") attempts, in one round
# trip: a group commit's registrations read them once for the batch.
NEWEST_ATTEMPTS_OF_NODES = union_all(
    select(literal("a").label("kind"), Attempt.job_id, Attempt.node, func.max(Attempt.number).label("number"))
    .where(
        Attempt.job_id.in_(bindparam("job_ids", expanding=True)), Attempt.node.in_(bindparam("nodes", expanding=True))
    )
    .group_by(Attempt.job_id, Attempt.node),
    select(literal("c"), Checkpoint.job_id, Checkpoint.node, func.max(Checkpoint.attempt_number))
    .where(
        Checkpoint.job_id.in_(bindparam("job_ids", expanding=True)),
        Checkpoint.node.in_(bindparam("nodes", expanding=True)),
    )
    .group_by(Checkpoint.job_id, Checkpoint.node),
)
# The attempts registered with some Idempotency-Keys.
KEYED_ATTEMPTS = select(Attempt.job_id, Attempt.node, Attempt.request_key, Attempt.number).where(
    Attempt.job_id.in_(bindparam("job_ids", expanding=True)), Attempt.request_key.in_(bindparam("keys", expanding=True))
)

# How many nodes have a committed copy at a position (the judge's first, cheap test).
NODES_WITH_INTACT_COPY = select(func.count(distinct(Checkpoint.node))).where(
    Checkpoint.job_id == bindparam("job_id"),
    Checkpoint.epoch == bindparam("epoch"),
    Checkpoint.batch_key == bindparam("key"),
    Checkpoint.state == "committed",
)
