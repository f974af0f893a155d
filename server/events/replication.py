"""Events about the local tier's replication, decided when a copy is committed: `replication.done`
when a durable copy joins a local one, `replication.lagging` when a node's local copies waiting
for their durable copy reach LAGGING_COPIES."""

from __future__ import annotations

from sqlalchemy import and_, exists, func, select
from sqlalchemy.orm import Session, aliased

from ckptstore.names import Tier
from ckptstore.position import Position
from ckptstore.server.db.models import Checkpoint, Job, batch_key
from ckptstore.server.events.log import emit
from ckptstore.server.records import held

__all__ = ["replication_events", "LAGGING_COPIES"]

LAGGING_COPIES = 2


def replication_events(session: Session, job: Job, node: str, position: Position, attempt: str, tier: Tier) -> None:
    if job.local_root is None:
        return
    held.flush(session)  # the copies read below include this batch's
    if tier == "durable":
        local = session.scalar(
            select(Checkpoint.location).where(
                Checkpoint.job_id == job.id,
                Checkpoint.node == node,
                Checkpoint.epoch == position.epoch,
                Checkpoint.batch_key == batch_key(position.batch),
                Checkpoint.attempt == attempt,
                Checkpoint.tier == "local",
            )
        )
        if local is not None:
            emit(session, "replication.done", job.name, node=node, position=position, attempt=attempt)
        return
    durable = aliased(Checkpoint)
    waiting = session.execute(
        select(func.count(), func.min(Checkpoint.created_at)).where(
            Checkpoint.job_id == job.id,
            Checkpoint.node == node,
            Checkpoint.tier == "local",
            Checkpoint.state == "committed",
            ~exists().where(
                and_(
                    durable.job_id == Checkpoint.job_id,
                    durable.node == Checkpoint.node,
                    durable.epoch == Checkpoint.epoch,
                    durable.batch_key == Checkpoint.batch_key,
                    durable.attempt == Checkpoint.attempt,
                    durable.tier == "durable",
                    durable.state == "committed",
                )
            ),
        )
    ).one()
    pending, oldest = waiting
    if pending >= LAGGING_COPIES:
        emit(
            session,
            "replication.lagging",
            job.name,
            node=node,
            position=position,
            pending=pending,
            oldest_pending_since=oldest,
        )
