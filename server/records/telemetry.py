"""Health (cp_accessible reports, probes and replication lag) and save/load timing stats of a job's nodes."""

from __future__ import annotations

import time
from collections import defaultdict

from sqlalchemy import select
from sqlalchemy.orm import Session

from ckptstore.names import TIERS
from ckptstore.position import Position
from ckptstore.server.db.models import Checkpoint, Health, Job, Stat
from ckptstore.server.events.log import emit
from ckptstore.wire.schema import (
    HealthReport,
    NodeHealth,
    PositionBody,
    ReplicationLag,
    StatsReport,
    StatsRow,
    StatsSummary,
)

__all__ = ["report_health", "job_health", "replication_lag", "add_stat", "stats_summary"]


def _node_health(
    node: str, row: Health | None, stale_after: float, now: float, lag: ReplicationLag | None = None
) -> NodeHealth:
    if row is None:
        return NodeHealth(
            node=node, cp_accessible=None, latency_ms=None, error=None, reported_at=None, stale=True, replication=lag
        )
    return NodeHealth(
        node=node,
        cp_accessible=row.cp_accessible,
        latency_ms=row.latency_ms,
        error=row.error,
        reported_at=row.reported_at,
        stale=now - row.reported_at > stale_after,
        replication=lag,
    )


def report_health(session: Session, job: Job, node: str, body: HealthReport, *, stale_after: float) -> NodeHealth:
    now = time.time()
    row = session.get(Health, (job.id, node))
    if row is None:
        row = Health(job_id=job.id, node=node)
        session.add(row)
    previous = row.cp_accessible
    if previous != body.cp_accessible:
        emit(
            session,
            "health.changed",
            job.name,
            node=node,
            cp_accessible=body.cp_accessible,
            previous=previous,
            error=body.error,
            latency_ms=body.latency_ms,
        )
    row.cp_accessible, row.latency_ms, row.error, row.reported_at = body.cp_accessible, body.latency_ms, body.error, now
    return _node_health(node, row, stale_after, now)


def job_health(session: Session, job: Job, nodes: list[str], *, stale_after: float) -> list[NodeHealth]:
    """Every expected node's last report (stale when older than `stale_after`, or never sent), and
    its replication lag when the job has a local tier."""
    now = time.time()
    rows = {r.node: r for r in session.scalars(select(Health).where(Health.job_id == job.id))}
    lag = replication_lag(session, job, now=now) if job.local_root else {}
    return [
        _node_health(node, rows.get(node), stale_after, now, lag.get(node) if job.local_root else None)
        for node in sorted(set(nodes) | set(rows))
    ]


def replication_lag(session: Session, job: Job, *, now: float) -> dict[str, ReplicationLag]:
    """Per node: committed local copies whose attempt has no committed durable copy yet, the oldest's
    wait, and the newest position on each tier."""
    copies: dict[str, dict[tuple[Position, str], dict[str, float]]] = defaultdict(dict)
    for row in session.scalars(select(Checkpoint).where(Checkpoint.job_id == job.id, Checkpoint.state == "committed")):
        copies[row.node].setdefault((row.position, row.attempt), {})[row.tier] = row.created_at
    lag = {}
    for node, found in copies.items():
        waiting = [tiers["local"] for tiers in found.values() if "local" in tiers and "durable" not in tiers]
        newest = {tier: max((p for (p, _), t in found.items() if tier in t), default=None) for tier in TIERS}
        lag[node] = ReplicationLag(
            pending=len(waiting),
            oldest_pending_seconds=round(now - min(waiting), 3) if waiting else None,
            newest_local=PositionBody.of(newest["local"]),
            newest_durable=PositionBody.of(newest["durable"]),
        )
    return lag


def add_stat(session: Session, job: Job, body: StatsReport) -> None:
    session.add(Stat(job_id=job.id, created_at=time.time(), **body.model_dump()))


def _percentile(ordered: list[float], fraction: float) -> float:
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


def stats_summary(session: Session, job: Job) -> StatsSummary:
    """Count, mean, p50, p95 and max seconds (and total bytes) per action and node."""
    groups: dict[tuple[str, str], list[tuple[float, int]]] = defaultdict(list)
    for action, node, seconds, size in session.execute(
        select(Stat.action, Stat.node, Stat.seconds, Stat.bytes).where(Stat.job_id == job.id)
    ):
        groups[(action, node)].append((seconds, size or 0))
    rows = []
    for (action, node), samples in sorted(groups.items()):
        ordered = sorted(s for s, _ in samples)
        rows.append(
            StatsRow(
                action=action,
                node=node,
                count=len(ordered),
                mean=sum(ordered) / len(ordered),
                p50=_percentile(ordered, 0.5),
                p95=_percentile(ordered, 0.95),
                max=ordered[-1],
                bytes=sum(b for _, b in samples),
            )
        )
    return StatsSummary(job=job.name, rows=rows)
