"""Database tables. Positions store `batch_key` (the batch, or 10^10 for end-of-epoch) so that
(epoch, batch_key) is both unique in SQL (NULLs are distinct there) and ordered like positions.

`positions.good` and the job's cached last-good/resume are maintained as commits and marks
arrive, so the last-good answer reads a handful of indexed rows, never a scan.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Insert,
    Integer,
    String,
    Text,
    UniqueConstraint,
    insert,
    inspect,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from ckptstore.names import attempt_sort_key
from ckptstore.position import POSITION_LIMIT, Position

__all__ = [
    "batch_key",
    "batch_of",
    "position_of",
    "Base",
    "Job",
    "NodeSet",
    "Attempt",
    "Checkpoint",
    "PositionRow",
    "Health",
    "Stat",
    "RevokedSession",
    "BlobServer",
    "EventRow",
    "Webhook",
    "insert_rows",
    "Delivery",
    "END_OF_EPOCH",
]

END_OF_EPOCH = POSITION_LIMIT


def batch_key(batch: int | None) -> int:
    return END_OF_EPOCH if batch is None else batch


def batch_of(key: int) -> int | None:
    return None if key == END_OF_EPOCH else key


def position_of(epoch: int | None, key: int | None) -> Position | None:
    """The position stored as (epoch, batch_key) columns, or None where the epoch is NULL."""
    return None if epoch is None or key is None else Position(epoch, batch_of(key))


class Base(DeclarativeBase):
    pass


def insert_rows(session: Session, rows: Sequence[Base]) -> None:
    """Insert new `rows` of one model with Core (one executemany per set of attributes given),
    leaving them out of the session: on the hot write path the unit of work costs several times
    the INSERT. Queries read them back like any row."""
    by_columns: dict[frozenset[str], list[dict[str, Any]]] = {}
    for row in rows:
        values = {key: value for key, value in inspect(row).dict.items() if not key.startswith("_")}
        by_columns.setdefault(frozenset(values), []).append(values)
    for values_list in by_columns.values():
        session.connection().execute(_insert(type(rows[0])), values_list)


@functools.cache
def _insert(model: type[Base]) -> Insert:
    return insert(model)


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    storage_root: Mapped[str] = mapped_column(Text)
    local_root: Mapped[str | None] = mapped_column(Text, nullable=True)
    retention: Mapped[dict[str, Any]] = mapped_column(JSON)
    nodes_version: Mapped[int] = mapped_column(Integer, default=1)
    version: Mapped[int] = mapped_column(BigInteger, default=1)  # bumped by every change to the job's records
    last_good_epoch: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    durable_epoch: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    resume_epoch: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    resume_batch_key: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    parent_job: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)  # a fork's
    parent_epoch: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    parent_batch_key: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # The parent's identity (its row's id when the fork was declared): a new job of the parent's name,
    # declared after the parent was forgotten, is not the parent.
    parent_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True, index=True)

    @property
    def resume(self) -> Position | None:
        """The cached resume position (the highest good position)."""
        return position_of(self.resume_epoch, self.resume_batch_key)

    @property
    def parent_position(self) -> Position | None:
        """The position of the parent's checkpoint a fork started from."""
        return position_of(self.parent_epoch, self.parent_batch_key)


class NodeSet(Base):
    """The expected nodes of a job from `version` on (positions remember the version they began under)."""

    __tablename__ = "node_sets"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    nodes: Mapped[list[str]] = mapped_column(JSON)


class Attempt(Base):
    __tablename__ = "attempts"
    __table_args__ = (Index("ix_attempts_started", "job_id", "started_at"),)

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    node: Mapped[str] = mapped_column(String(128), primary_key=True)
    number: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    resumed_epoch: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    resumed_batch_key: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    skipped: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    started_at: Mapped[float] = mapped_column(Float)
    resumed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # the Idempotency-Key of the request that registered it: a retry of that request gets this attempt
    request_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    audit: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)  # its resume audit (schema.ResumeAudit)
    # what the registration asked (where it resumed, at_least): a retry with the same key must ask the same
    request_body: Mapped[str | None] = mapped_column(String(64), nullable=True)

    @property
    def resumed_from(self) -> Position | None:
        """Where this attempt resumed from (None for a fresh start)."""
        return position_of(self.resumed_epoch, self.resumed_batch_key)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("job_id", "node", "epoch", "batch_key", "attempt", "tier", name="uq_checkpoint_copy"),
        # created_at last: when a position was first committed is the first entry of its range
        Index("ix_checkpoint_position_time", "job_id", "epoch", "batch_key", "created_at"),
        Index("ix_checkpoints_time", "job_id", "created_at"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    node: Mapped[str] = mapped_column(String(128))
    epoch: Mapped[int] = mapped_column(BigInteger)
    batch_key: Mapped[int] = mapped_column(BigInteger)
    attempt: Mapped[str] = mapped_column(String(32))
    attempt_number: Mapped[int] = mapped_column(BigInteger)
    attempt_suffix: Mapped[str] = mapped_column(String(16), default="")
    tier: Mapped[str] = mapped_column(String(16), default="durable")
    step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    location: Mapped[str] = mapped_column(Text)
    bytes: Mapped[int] = mapped_column(BigInteger)
    checksums: Mapped[dict[str, str]] = mapped_column(JSON)
    metrics: Mapped[dict[str, float]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16), default="committed")
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    cause: Mapped[str | None] = mapped_column(String(16), nullable=True)  # who marked it (schema.MarkCause)
    created_at: Mapped[float] = mapped_column(Float)

    @property
    def position(self) -> Position:
        return Position(self.epoch, batch_of(self.batch_key))

    @property
    def attempt_key(self) -> tuple[int, str]:
        """Orders attempts as `ckptstore.names.attempt_sort_key` does (newest last)."""
        return attempt_sort_key(self.attempt)


class PositionRow(Base):
    __tablename__ = "positions"
    __table_args__ = (Index("ix_position_good", "job_id", "good", "epoch", "batch_key"),)

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    batch_key: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    nodes_version: Mapped[int] = mapped_column(Integer)
    good: Mapped[bool] = mapped_column(Boolean, default=False)
    durable: Mapped[bool] = mapped_column(Boolean, default=False)

    @property
    def position(self) -> Position:
        return Position(self.epoch, batch_of(self.batch_key))


class Health(Base):
    __tablename__ = "health"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    node: Mapped[str] = mapped_column(String(128), primary_key=True)
    cp_accessible: Mapped[bool] = mapped_column(Boolean)
    latency_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    reported_at: Mapped[float] = mapped_column(Float)


class Stat(Base):
    __tablename__ = "stats"
    __table_args__ = (
        Index("ix_stats_job", "job_id", "action", "node"),
        Index("ix_stats_action_time", "job_id", "action", "created_at"),
        Index("ix_stats_time", "job_id", "created_at"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    node: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(16))
    seconds: Mapped[float] = mapped_column(Float)
    bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)


class BlobServer(Base):
    """Where a node's peer blob server answers now (`ckptstore.client.peers`): registered at each start, so
    a node restoring from a copy another node holds reaches that node's current process."""

    __tablename__ = "blob_servers"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    node: Mapped[str] = mapped_column(String(128), primary_key=True)
    url: Mapped[str] = mapped_column(String(512))
    token: Mapped[str] = mapped_column(String(128))
    registered_at: Mapped[float] = mapped_column(Float)


class RevokedSession(Base):
    """A dashboard session signed out before it expired (server/http/auth.py)."""

    __tablename__ = "revoked_sessions"

    nonce: Mapped[str] = mapped_column(String(64), primary_key=True)
    expires_at: Mapped[float] = mapped_column(Float)


class EventRow(Base):
    """One change the service recorded (server/events/log.py), in commit order; ids never reused."""

    __tablename__ = "events"
    __table_args__ = (Index("ix_events_job", "job", "id"), {"sqlite_autoincrement": True})

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    time: Mapped[float] = mapped_column(Float)
    type: Mapped[str] = mapped_column(String(32))
    job: Mapped[str | None] = mapped_column(String(128), nullable=True)
    node: Mapped[str | None] = mapped_column(String(128), nullable=True)
    epoch: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    batch_key: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    data: Mapped[dict[str, Any]] = mapped_column(JSON)


class Webhook(Base):
    """A subscriber URL (server/events/webhooks.py): events after `cursor` are still to be delivered, in order;
    one service process at a time delivers (`lease_owner` until `lease_until`)."""

    __tablename__ = "webhooks"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    url: Mapped[str] = mapped_column(Text)
    events: Mapped[list[str]] = mapped_column(JSON)
    job: Mapped[str | None] = mapped_column(String(128), nullable=True)
    secret: Mapped[str] = mapped_column(Text)
    cursor: Mapped[int] = mapped_column(BigInteger)
    lease_owner: Mapped[str | None] = mapped_column(String(64), nullable=True)
    lease_until: Mapped[float] = mapped_column(Float, default=0.0)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class Delivery(Base):
    """One event's delivery to one webhook: its tries and how the last one went."""

    __tablename__ = "deliveries"

    webhook: Mapped[str] = mapped_column(ForeignKey("webhooks.name", ondelete="CASCADE"), primary_key=True)
    event_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    type: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))  # pending, delivered, failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    last_attempt_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    next_attempt_at: Mapped[float] = mapped_column(Float)
    delivered_at: Mapped[float | None] = mapped_column(Float, nullable=True)
