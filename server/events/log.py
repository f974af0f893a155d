"""The durable event log: every change the service records is also written, in the same
transaction, as an event (ckptstore/wire/events.py) that streams, polls and webhooks read.

Writes call `emit`, which only notes the event on the session; `Database.write` inserts the
transaction's events just before it commits (`write_pending`), after taking a lock that orders
event-writing transactions (PostgreSQL: a transaction-scoped advisory lock; SQLite: its one write
lock), so event ids grow in commit order and a reader that saw id N never later finds an id below N.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import delete, func, insert, select, text
from sqlalchemy.orm import Session

from ckptstore.position import Position
from ckptstore.server.db.models import EventRow, batch_key, position_of
from ckptstore.server.db.transaction import state_of
from ckptstore.wire.events import Event, EventType
from ckptstore.wire.schema import PositionBody

__all__ = [
    "emit",
    "write_pending",
    "events_after",
    "oldest_event_id",
    "newest_event_id",
    "out_of_window",
    "prune",
    "EVENTS_LOCK",
]

EVENTS_LOCK = 0x636B7074  # pg_advisory_xact_lock key ("ckpt")


def emit(
    session: Session,
    type: EventType,
    job: str | None,
    *,
    node: str | None = None,
    position: Position | None = None,
    **data: Any,
) -> None:
    """Record that `type` happened, when (and only if) this transaction commits."""
    state_of(session).events.append(
        {
            "time": time.time(),
            "type": type,
            "job": job,
            "node": node,
            "epoch": None if position is None else position.epoch,
            "batch_key": None if position is None else batch_key(position.batch),
            "data": data,
        }
    )


def write_pending(session: Session, *, postgres: bool) -> int | None:
    """Insert the transaction's events (in commit order across processes, in one executemany); the
    newest id, or None. Under the lock no other transaction inserts events, so the newest is ours."""
    state = state_of(session)
    rows, state.events = state.events, []
    if not rows:
        return None
    if postgres:
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": EVENTS_LOCK})
    session.execute(insert(EventRow), rows)
    return session.scalar(select(func.max(EventRow.id)))


def _event(row: EventRow) -> Event:
    return Event(
        id=row.id,
        type=row.type,
        time=row.time,
        job=row.job,
        node=row.node,
        position=PositionBody.of(position_of(row.epoch, row.batch_key)),
        data=row.data,
    )


def events_after(
    session: Session, after: int, *, job: str | None = None, types: frozenset[str] | None = None, limit: int = 1000
) -> list[Event]:
    """Events with id above `after`, oldest first, of one job and some types where given."""
    query = select(EventRow).where(EventRow.id > after)
    if job is not None:
        query = query.where(EventRow.job == job)
    if types:
        query = query.where(EventRow.type.in_(sorted(types)))
    return [_event(row) for row in session.scalars(query.order_by(EventRow.id).limit(limit))]


def oldest_event_id(session: Session) -> int | None:
    return session.scalar(select(func.min(EventRow.id)))


def newest_event_id(session: Session) -> int:
    return session.scalar(select(func.max(EventRow.id))) or 0


def out_of_window(
    session: Session, *, keep_seconds: float, keep_rows: int, now: float, keep_after: int | None, most_rows: int
) -> int:
    """The highest event id that leaves the log now (0: none): events older than the window (time and
    rows) — but those after `keep_after` (what a reader has not been given yet) stay, as long as the
    log then holds at most `most_rows` events."""
    newest = newest_event_id(session)
    by_time = session.scalar(select(func.max(EventRow.id)).where(EventRow.time < now - keep_seconds)) or 0
    through = max(newest - keep_rows, by_time, 0)
    if keep_after is not None:
        through = min(through, max(keep_after, newest - most_rows))
    return through


def prune(session: Session, through: int) -> int:
    """Drop the events up to id `through` (`out_of_window`); how many were dropped."""
    result = session.execute(delete(EventRow).where(EventRow.id <= through))
    return int(result.rowcount or 0)  # type: ignore[attr-defined]
