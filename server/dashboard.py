"""What the web dashboard shows, read from the records: a page of jobs at a glance, and one job's
node × position grid, health, sizes, save times and restart history.

Read-only queries over the same tables the REST API answers from; the pages (server/ui.py)
only render these values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ckptstore.names import attempt_sort_key
from ckptstore.position import Position
from server.models import Attempt, Checkpoint, Health, Job, PositionRow, Stat, batch_of
from server.records import expected_nodes, resume_position
from server.telemetry import job_health

__all__ = [
    "JobSummary",
    "JobDetail",
    "Cell",
    "jobs_overview",
    "job_detail",
    "resumed_from",
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


@dataclass
class JobDetail:
    name: str
    storage_root: str
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


def _newest_position(session: Session, job: Job) -> Position | None:
    row = session.execute(
        select(Checkpoint.epoch, Checkpoint.batch_key)
        .where(Checkpoint.job_id == job.id, Checkpoint.state == "committed")
        .order_by(Checkpoint.epoch.desc(), Checkpoint.batch_key.desc())
        .limit(1)
    ).first()
    return None if row is None else Position(row.epoch, batch_of(row.batch_key))


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


def jobs_overview(session: Session, *, page: int, stale_after: float) -> tuple[list[JobSummary], bool]:
    """One page of jobs by name, and whether there is a next page."""
    jobs = list(session.scalars(select(Job).order_by(Job.name).limit(JOBS_PER_PAGE + 1).offset(page * JOBS_PER_PAGE)))
    summaries = []
    for job in jobs[:JOBS_PER_PAGE]:
        nodes = expected_nodes(session, job)
        newest_epochs = dict(
            session.execute(
                select(Checkpoint.node, func.max(Checkpoint.epoch))
                .where(Checkpoint.job_id == job.id, Checkpoint.state == "committed")
                .group_by(Checkpoint.node)
            ).all()
        )
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
                resume=resume_position(job),
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
    positions = [Position(r.epoch, batch_of(r.batch_key)) for r in rows]
    expected = {
        Position(r.epoch, batch_of(r.batch_key)): set(expected_nodes(session, job, r.nodes_version)) for r in rows
    }
    nodes = set(expected_nodes(session, job))
    newest_attempt: dict[tuple[str, Position], Checkpoint] = {}
    if rows:
        low, high = rows[-1], rows[0]
        checkpoints = session.scalars(
            select(Checkpoint).where(
                Checkpoint.job_id == job.id,
                Checkpoint.epoch.between(low.epoch, high.epoch),
            )
        )
        window = set(positions)
        for c in checkpoints:
            position = Position(c.epoch, batch_of(c.batch_key))
            if position not in window:
                continue
            key = (c.node, position)
            if key not in newest_attempt or attempt_sort_key(c.attempt) > attempt_sort_key(newest_attempt[key].attempt):
                newest_attempt[key] = c
            nodes.add(c.node)
    cells: dict[tuple[str, Position], Cell] = {}
    counts = dict.fromkeys(STATES, 0)
    for position in positions:
        for node in nodes:
            found = newest_attempt.get((node, position))
            if found is not None:
                cell = Cell(found.state, found.attempt, found.reason)
            elif node in expected[position]:
                cell = Cell("missing")
            else:
                cell = Cell("")
            cells[(node, position)] = cell
            if cell.state:
                counts[cell.state] += 1
    sizes = [
        (p, sum(c.bytes for (n, q), c in newest_attempt.items() if q == p and c.state != "deleted"))
        for p in reversed(positions)
    ]
    saves = session.scalars(
        select(Stat.seconds)
        .where(Stat.job_id == job.id, Stat.action == "save")
        .order_by(Stat.created_at.desc())
        .limit(GRID_WINDOW)
    )
    attempts = list(
        session.scalars(select(Attempt).where(Attempt.job_id == job.id).order_by(Attempt.started_at.desc()).limit(50))
    )
    return JobDetail(
        name=job.name,
        storage_root=job.storage_root,
        nodes=sorted(nodes),
        last_good_epoch=job.last_good_epoch,
        resume=resume_position(job),
        positions=positions,
        good={Position(r.epoch, batch_of(r.batch_key)) for r in rows if r.good},
        cells=cells,
        health=job_health(session, job, sorted(nodes), stale_after=stale_after),
        sizes=sizes,
        save_seconds=list(saves)[::-1],
        attempts=attempts,
        page=page,
        more=more,
        counts=counts,
    )


def resumed_from(attempt: Attempt) -> Position | None:
    """Where an attempt resumed from (None for a fresh start)."""
    if attempt.resumed_epoch is None:
        return None
    return Position(attempt.resumed_epoch, batch_of(attempt.resumed_batch_key))
