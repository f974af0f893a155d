"""Database tables. Positions store `batch_key` (the batch, or 10^10 for end-of-epoch) so that
(epoch, batch_key) is both unique in SQL (NULLs are distinct there) and ordered like positions.

`positions.good` and the job's cached last-good/resume are maintained as commits and marks
arrive, so the last-good answer reads a handful of indexed rows, never a scan.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from ckptstore.position import POSITION_LIMIT

__all__ = ["Base", "Job", "NodeSet", "Attempt", "Checkpoint", "PositionRow", "Health", "Stat", "END_OF_EPOCH"]

END_OF_EPOCH = POSITION_LIMIT


def batch_key(batch: int | None) -> int:
    return END_OF_EPOCH if batch is None else batch


def batch_of(key: int) -> int | None:
    return None if key == END_OF_EPOCH else key


class Base(DeclarativeBase):
    pass


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    storage_root: Mapped[str] = mapped_column(Text)
    retention: Mapped[dict] = mapped_column(JSON)
    nodes_version: Mapped[int] = mapped_column(Integer, default=1)
    version: Mapped[int] = mapped_column(BigInteger, default=1)  # bumped by every change to the job's records
    last_good_epoch: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    resume_epoch: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    resume_batch_key: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class NodeSet(Base):
    """The expected nodes of a job from `version` on (positions remember the version they began under)."""

    __tablename__ = "node_sets"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    nodes: Mapped[list] = mapped_column(JSON)


class Attempt(Base):
    __tablename__ = "attempts"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    node: Mapped[str] = mapped_column(String(128), primary_key=True)
    number: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    resumed_epoch: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    resumed_batch_key: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    started_at: Mapped[float] = mapped_column(Float)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("job_id", "node", "epoch", "batch_key", "attempt", name="uq_checkpoint"),
        Index("ix_checkpoint_position", "job_id", "epoch", "batch_key"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    node: Mapped[str] = mapped_column(String(128))
    epoch: Mapped[int] = mapped_column(BigInteger)
    batch_key: Mapped[int] = mapped_column(BigInteger)
    attempt: Mapped[str] = mapped_column(String(32))
    attempt_number: Mapped[int] = mapped_column(BigInteger)
    attempt_suffix: Mapped[str] = mapped_column(String(16), default="")
    step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    location: Mapped[str] = mapped_column(Text)
    bytes: Mapped[int] = mapped_column(BigInteger)
    checksums: Mapped[dict] = mapped_column(JSON)
    metrics: Mapped[dict] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16), default="committed")
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)


class PositionRow(Base):
    __tablename__ = "positions"
    __table_args__ = (Index("ix_position_good", "job_id", "good", "epoch", "batch_key"),)

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    batch_key: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    nodes_version: Mapped[int] = mapped_column(Integer)
    good: Mapped[bool] = mapped_column(Boolean, default=False)


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
    __table_args__ = (Index("ix_stats_job", "job_id", "action", "node"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    node: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(16))
    seconds: Mapped[float] = mapped_column(Float)
    bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
