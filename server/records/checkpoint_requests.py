"""Checkpoints on request: "save now" for every running node of a job (before a drain, a maintenance, an
upgrade), without a cadence of their own and without polling the service per step.

A request is an event, `checkpoint.requested`, in the durable log: nodes follow their job's requests on
the event stream and save at their next step. The event carries each expected node's newest committed
position when it was made; the request is pending while some node has not committed a newer one.
Requests coalesce: asking while one is pending answers that one, so a retried or repeated "checkpoint
now" never makes a node save twice for one need.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ckptstore.server.db.models import Checkpoint, EventRow, Job, position_of
from ckptstore.server.events.log import emit
from ckptstore.server.records.last_good import expected_nodes
from ckptstore.wire.events import EventType
from ckptstore.wire.schema import CheckpointRequestInfo, PositionBody

__all__ = ["REQUESTED", "newest_request", "request_checkpoint"]

REQUESTED: EventType = "checkpoint.requested"
Key = tuple[int, int]  # (epoch, batch_key): positions in their stored order


def _newest_positions(session: Session, job: Job, nodes: list[str]) -> dict[str, Key | None]:
    """Each node's newest committed position, as (epoch, batch_key)."""
    committed = (Checkpoint.job_id == job.id, Checkpoint.state == "committed", Checkpoint.node.in_(nodes))
    epochs = (
        select(Checkpoint.node, func.max(Checkpoint.epoch).label("epoch")).where(*committed).group_by(Checkpoint.node)
    ).subquery()
    rows = session.execute(
        select(Checkpoint.node, Checkpoint.epoch, func.max(Checkpoint.batch_key))
        .join(epochs, (epochs.c.node == Checkpoint.node) & (epochs.c.epoch == Checkpoint.epoch))
        .where(*committed)
        .group_by(Checkpoint.node, Checkpoint.epoch)
    )
    newest: dict[str, Key | None] = dict.fromkeys(nodes)
    for node, epoch, key in rows:
        newest[node] = (int(epoch), int(key))
    return newest


def _committed_since(newest: Key | None, then: list[int] | None) -> bool:
    """Whether a node whose newest position is `newest` committed one after `then` (None: it had none)."""
    return newest is not None and (then is None or newest > (then[0], then[1]))


def _body(key: Key | None) -> PositionBody | None:
    return None if key is None else PositionBody.of(position_of(*key))


def _info(session: Session, job: Job, row: EventRow, *, coalesced: bool = False) -> CheckpointRequestInfo:
    baseline: dict[str, list[int] | None] = row.data.get("nodes", {})
    now = _newest_positions(session, job, list(baseline))
    pending = [node for node, then in baseline.items() if not _committed_since(now[node], then)]
    return CheckpointRequestInfo(
        id=row.id,
        job=job.name,
        requested_at=row.time,
        reason=row.data.get("reason"),
        nodes={node: _body(None if then is None else (then[0], then[1])) for node, then in baseline.items()},
        pending=pending,
        coalesced=coalesced,
    )


def newest_request(session: Session, job: Job, *, coalesced: bool = False) -> CheckpointRequestInfo | None:
    """The job's newest checkpoint request and which nodes it still waits for; None if it has none (a
    request to an earlier job of the same name, forgotten since, is not this job's)."""
    row = session.scalars(
        select(EventRow)
        .where(EventRow.job == job.name, EventRow.type == REQUESTED, EventRow.time >= job.created_at)
        .order_by(EventRow.id.desc())
        .limit(1)
    ).first()
    return None if row is None else _info(session, job, row, coalesced=coalesced)


def request_checkpoint(session: Session, job: Job, reason: str | None) -> CheckpointRequestInfo | None:
    """Ask the job's nodes to save at their next step (the caller holds the job's lock): the pending
    request when there is one (coalesced), else None — a new request is emitted with this transaction,
    and its event id is known once it commits (`newest_request` then)."""
    pending = newest_request(session, job, coalesced=True)
    if pending is not None and pending.pending:
        return pending
    baseline = _newest_positions(session, job, expected_nodes(session, job))
    emit(
        session,
        REQUESTED,
        job.name,
        nodes={n: None if k is None else list(k) for n, k in baseline.items()},
        reason=reason,
    )
    return None
