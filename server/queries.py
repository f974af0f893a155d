"""The hot write path's SQL statements, built once with bind parameters.

Building a SQLAlchemy expression costs more than running it: a 4,096-node job registering or
committing at once would spend most of the writer's time building the same queries again. Each
statement here takes its values as parameters (`session.execute(STATEMENT, {...})`).
"""

from __future__ import annotations

from sqlalchemy import bindparam, distinct, func, literal, select

from server.models import Attempt, Checkpoint, Job

__all__ = ["LOCK_JOB", "LOCK_JOBS", "COPIES_AND_NEWEST", "ATTEMPT_NUMBERS", "NODES_WITH_INTACT_COPY"]

LOCK_JOB = select(Job).where(Job.name == bindparam("name")).with_for_update()
LOCK_JOBS = select(Job).where(Job.name.in_(bindparam("names", expanding=True))).order_by(Job.name).with_for_update()

_NEWEST_REGISTERED = (
    select(func.max(Attempt.number))
    .where(Attempt.job_id == bindparam("job_id"), Attempt.node == bindparam("node"))
    .scalar_subquery()
)
_ONE_ROW = select(literal(1).label("one")).subquery()
# An attempt's copies of a position and the node's newest registered attempt, in one round trip:
# one row of the newest attempt, outer-joined to each copy (None where there is none).
COPIES_AND_NEWEST = (
    select(_NEWEST_REGISTERED, Checkpoint)
    .select_from(_ONE_ROW)
    .outerjoin(
        Checkpoint,
        (Checkpoint.job_id == bindparam("job_id"))
        & (Checkpoint.node == bindparam("node"))
        & (Checkpoint.epoch == bindparam("epoch"))
        & (Checkpoint.batch_key == bindparam("key"))
        & (Checkpoint.attempt == bindparam("attempt")),
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

# How many nodes have a committed copy at a position (the judge's first, cheap test).
NODES_WITH_INTACT_COPY = select(func.count(distinct(Checkpoint.node))).where(
    Checkpoint.job_id == bindparam("job_id"),
    Checkpoint.epoch == bindparam("epoch"),
    Checkpoint.batch_key == bindparam("key"),
    Checkpoint.state == "committed",
)
