"""The wire schema of what nodes report besides commits: storage health (cp_accessible, replication
lag) and timing statistics — the models `/health` and `/stats` accept and answer."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from ckptstore.schema import Name, PositionBody, RequestModel

__all__ = [
    "Advice",
    "HealthReport",
    "ReplicationLag",
    "NodeHealth",
    "ProbeResult",
    "JobHealth",
    "StatsAction",
    "StatsReport",
    "StatsRow",
    "StatsSummary",
]


class HealthReport(RequestModel):
    cp_accessible: bool
    latency_ms: float | None = Field(default=None, ge=0, le=10**9, allow_inf_nan=False)
    error: str | None = Field(default=None, max_length=2000)


class ReplicationLag(BaseModel):
    """A node's local copies not yet on the durable tier: how many, and how long the oldest has waited."""

    pending: int
    oldest_pending_seconds: float | None
    newest_local: PositionBody | None
    newest_durable: PositionBody | None


class NodeHealth(BaseModel):
    node: str
    cp_accessible: bool | None
    latency_ms: float | None
    error: str | None
    reported_at: float | None
    stale: bool
    replication: ReplicationLag | None = None


class ProbeResult(BaseModel):
    cp_accessible: bool
    latency_ms: float | None
    error: str | None


class JobHealth(BaseModel):
    job: str
    nodes: list[NodeHealth]
    probe: ProbeResult | None = None


StatsAction = Literal["save", "load", "restore", "verify", "delete", "blocked"]


class StatsReport(RequestModel):
    node: Name
    action: StatsAction
    seconds: float = Field(ge=0, le=10**7, allow_inf_nan=False)
    bytes: int | None = Field(default=None, ge=0, lt=2**62)


class StatsRow(BaseModel):
    action: str
    node: str
    count: int
    mean: float
    p50: float
    p95: float
    max: float
    bytes: int


class StatsSummary(BaseModel):
    job: str
    rows: list[StatsRow]


class Advice(BaseModel):
    """A job's goodput and recommended checkpoint interval from its own records (server/advice.py);
    null where its history is too short to say."""

    job: str
    goodput: float | None = None
    wall_seconds: float | None = None
    lost_seconds: float | None = None
    blocked_seconds: float | None = None
    failures: int = 0
    mtbf_seconds: float | None = None
    save_cost_seconds: float | None = None
    interval_seconds: float | None = None
    interval_steps: int | None = None
    note: str | None = None
