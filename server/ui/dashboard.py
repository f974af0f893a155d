"""What the web dashboard shows, read from the records: a page of jobs at a glance, and one job's
node × position grid, health, sizes, save times and restart history.

Read-only queries over the same tables the REST API answers from; the pages (server/ui/pages.py)
only render these values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ckptstore.position import Position
from ckptstore.server.db.models import Attempt, Checkpoint, Health, Job, PositionRow, Stat
from ckptstore.server.records.advice import job_advice, job_goodput
from ckptstore.server.records.last_good import expected_nodes, parts_at
from ckptstore.server.records.lineage import lineage
from ckptstore.server.records.telemetry import job_health
from ckptstore.server.ui.aggregate import (
    AGGREGATE_NODES,
    SHOWN_NODES,
    Laggard,
    PositionCounts,
    laggards,
    newest_epochs_by_node,
    position_counts,
)
from ckptstore.wire.schema import Advice, Lineage, NodeHealth

__all__ = [
    "JobSummary",
    "JobDetail",
    "Cell",
    "jobs_overview",
    "job_detail",
    "GRID_WINDOW",
    "JOBS_PER_PAGE",
]

GRID_WINDOW = 100
JOBS_PER_PAGE = 50
STATES = ("committed", "corrupt", "deleted", "missing")


@dataclass(frozen=True)
class JobSummary:
    name: str
    last_good_epoch: int | None
    resume: Position | None
    nodes: list[str]
    newest: Position | None
    slowest_lag: int | None  # epochs between the newest position any node committed and the slowest node's newest
    slowest_node: str | None
    health: str  # "all ok", "N failing", "N stale", "no reports"
    health_level: str  # ok, failing, stale, none
    last_activity: float


@dataclass(frozen=True)
class Cell:
    state: str  # committed, corrupt, deleted, missing, or "" where the node was not expected
    attempt: str | None = None
    reason: str | None = None
    copies: str = ""  # each copy's tier and state, e.g. "local committed, durable committed"
    local_only: bool = False  # intact only on the local tier: replication pending


@dataclass
class JobDetail:
    name: str
    storage_root: str
    local_root: str | None
    durable_epoch: int | None
    nodes: list[str]
    last_good_epoch: int | None
    resume: Position | None
    positions: list[Position]  # newest first
    good: set[Position]
    cells: dict[tuple[str, Position], Cell]
    health: list
    sizes: list[tuple[Position, int]]  # oldest first
    save_seconds: list[float]  # the newest saves reported, oldest first
    attempts: list[Attempt]
    page: int
    more: bool
    counts: dict[str, int] = field(default_factory=dict)
    aggregate: list[PositionCounts] | None = None  # a large job: counts per position instead of `cells`
    laggards: list[Laggard] = field(default_factory=list)
    behind: int = 0  # nodes whose newest intact copy is older than the newest position
    health_more: int = 0  # a large job lists SHOWN_NODES nodes that are not ok: how many more are not
    advice: Advice | None = None  # goodput and the recommended interval (server/records/advice.py)
    goodput: list[tuple[float, float]] = field(default_factory=list)  # (when, goodput then), oldest first
    lineage: Lineage | None = None  # the checkpoint it was forked from, and the jobs forked from it


def _newest_position(session: Session, job: Job) -> Position | None:
    row = session.scalar(
        select(Checkpoint)
        .where(Checkpoint.job_id == job.id, Checkpoint.state == "committed")
        .order_by(Checkpoint.epoch.desc(), Checkpoint.batch_key.desc())
        .limit(1)
    )
    return None if row is None else row.position


def _health_summary(session: Session, job: Job, nodes: list[str], stale_after: float) -> tuple[str, str]:
    reports = job_health(session, job, nodes, stale_after=stale_after)
    failing = sum(r.cp_accessible is False and not r.stale for r in reports)
    stale = sum(r.stale for r in reports)
    if failing:
        return f"{failing} failing", "failing"
    if all(r.reported_at is None for r in reports):
        return "no reports", "none"
    if stale:
        return f"{stale} stale", "stale"
    return "all ok", "ok"


def jobs_overview(
    session: Session, *, page: int, stale_after: float, only: str | None = None
) -> tuple[list[JobSummary], bool]:
    """One page of jobs by name (just the job `only`, for a job's session), and whether there is a next page."""
    query = select(Job) if only is None else select(Job).where(Job.name == only)
    jobs = list(session.scalars(query.order_by(Job.name).limit(JOBS_PER_PAGE + 1).offset(page * JOBS_PER_PAGE)))
    summaries = []
    for job in jobs[:JOBS_PER_PAGE]:
        nodes = expected_nodes(session, job)
        newest_epochs = newest_epochs_by_node(session, job)
        newest = _newest_position(session, job)
        lag, slowest = None, None
        if newest is not None:
            slowest = min(nodes, key=lambda n: (newest_epochs.get(n, -1), n))
            lag = newest.epoch - newest_epochs.get(slowest, -1)
        health, level = _health_summary(session, job, nodes, stale_after)
        activity = [
            job.updated_at,
            session.scalar(select(func.max(Checkpoint.created_at)).where(Checkpoint.job_id == job.id)),
            session.scalar(select(func.max(Health.reported_at)).where(Health.job_id == job.id)),
            session.scalar(select(func.max(Attempt.started_at)).where(Attempt.job_id == job.id)),
        ]
        summaries.append(
            JobSummary(
                name=job.name,
                last_good_epoch=job.last_good_epoch,
                resume=job.resume,
                nodes=nodes,
                newest=newest,
                slowest_lag=lag,
                slowest_node=slowest,
                health=health,
                health_level=level,
                last_activity=max(t for t in activity if t is not None),
            )
        )
    return summaries, len(jobs) > JOBS_PER_PAGE


def job_detail(session: Session, job: Job, *, page: int, stale_after: float) -> JobDetail:
    """The grid of the newest positions (GRID_WINDOW per page, `page` 0 = newest) and the rest of the job page."""
    rows = list(
        session.scalars(
            select(PositionRow)
            .where(PositionRow.job_id == job.id)
            .order_by(PositionRow.epoch.desc(), PositionRow.batch_key.desc())
            .limit(GRID_WINDOW + 1)
            .offset(page * GRID_WINDOW)
        )
    )
    more, rows = len(rows) > GRID_WINDOW, rows[:GRID_WINDOW]
    positions = [r.position for r in rows]
    nodes = expected_nodes(session, job)
    if len(nodes) > AGGREGATE_NODES:
        aggregate = position_counts(session, job, rows)
        cells: dict[tuple[str, Position], Cell] = {}
        sizes = [(c.position, c.bytes) for c in reversed(aggregate)]
        shown_laggards, behind = laggards(session, job, _newest_position(session, job))
        unhealthy = [h for h in job_health(session, job, nodes, stale_after=stale_after) if not _healthy(h)]
        health, health_more = unhealthy[:SHOWN_NODES], max(len(unhealthy) - SHOWN_NODES, 0)
    else:
        aggregate, shown_laggards, behind, health_more = None, [], 0, 0
        cells, nodes, sizes = _grid(session, job, rows)
        health = job_health(session, job, nodes, stale_after=stale_after)
    saves = session.scalars(
        select(Stat.seconds)
        .where(Stat.job_id == job.id, Stat.action == "save")
        .order_by(Stat.created_at.desc())
        .limit(GRID_WINDOW)
    )
    attempts = list(
        session.scalars(select(Attempt).where(Attempt.job_id == job.id).order_by(Attempt.started_at.desc()).limit(50))
    )
    # A large job's page gives the advice without its plot: the plot reads a row per node and moment.
    advice, goodput = (job_advice(session, job), []) if aggregate is not None else job_goodput(session, job)
    return JobDetail(
        name=job.name,
        storage_root=job.storage_root,
        local_root=job.local_root,
        durable_epoch=job.durable_epoch,
        nodes=nodes,
        last_good_epoch=job.last_good_epoch,
        resume=job.resume,
        positions=positions,
        good={r.position for r in rows if r.good},
        cells=cells,
        health=health,
        sizes=sizes,
        save_seconds=list(saves)[::-1],
        attempts=attempts,
        page=page,
        more=more,
        counts=_counts(cells),
        aggregate=aggregate,
        laggards=shown_laggards,
        behind=behind,
        health_more=health_more,
        advice=advice,
        goodput=goodput,
        lineage=lineage(session, job),
    )


def _healthy(report: NodeHealth) -> bool:
    return bool(report.cp_accessible) and not report.stale and not (report.replication and report.replication.pending)


def _grid(
    session: Session, job: Job, rows: list[PositionRow]
) -> tuple[dict[tuple[str, Position], Cell], list[str], list[tuple[Position, int]]]:
    """Each node's cell at each position, every node seen, and the size of each position (oldest first)."""
    positions = [r.position for r in rows]
    expected = {r.position: set(expected_nodes(session, job, r.nodes_version)) for r in rows}
    nodes = set(expected_nodes(session, job))
    found_parts = parts_at(session, job, positions)
    nodes.update(node for at in found_parts.values() for node in at)
    cells: dict[tuple[str, Position], Cell] = {}
    for position in positions:
        for node in nodes:
            part = found_parts[position].get(node)
            if part is not None:
                reasons = [c.reason for c in part.copies if c.reason]
                cells[(node, position)] = Cell(
                    part.state,
                    part.attempt,
                    reasons[0] if reasons else None,
                    ", ".join(f"{c.tier} {c.state}" for c in part.copies),
                    part.intact and not part.durable and job.local_root is not None,
                )
            else:
                cells[(node, position)] = Cell("missing" if node in expected[position] else "")
    sizes = [(p, sum(part.copies[0].bytes for part in found_parts[p].values())) for p in reversed(positions)]
    return cells, sorted(nodes), sizes


def _counts(cells: dict[tuple[str, Position], Cell]) -> dict[str, int]:
    counts = dict.fromkeys(STATES, 0)
    for cell in cells.values():
        if cell.state:
            counts[cell.state] += 1
    return counts
