"""Operations advice per job, from the service's own records: goodput — how much of the job's wall
time went to training, not to work redone after failures nor to saves and restores — and the
checkpoint interval Young and Daly recommend, √(2 · save cost · mean time between failures).

`advise` is a pure function of a job's totals; `job_advice` and `job_goodput` (the plot) have the
database compute them in a few aggregate queries, so what one request reads follows the job's nodes,
not its history: a 4,096-node job's 400,000 commits, or one token's 100,000 starts and timings, are
never read row by row (the dashboard and /metrics ask for the advice). Definitions
(docs/operations.md, "Goodput"):
- wall: from the job's first start to its latest record (a start or a commit);
- lost: per restart of a node, from the commit of the copy it resumed from (its first start when it
  resumed nothing) to the restart — the work redone, the time down included; the node that lost most;
- blocked: the seconds training waited for saves (`blocked` stats; `save` where a client reports no
  `blocked`) and restores; the node that waited most;
- failures: the restarts of the node restarted most; fewer than 2 → no MTBF and no interval.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Integer, Row, Select, case, cast, func, select
from sqlalchemy.orm import InstrumentedAttribute, Session

from ckptstore.server.db.models import Attempt, Checkpoint, Job, Stat
from ckptstore.wire.schema import Advice

__all__ = [
    "Starts",
    "Progress",
    "Usage",
    "advise",
    "goodput_over_time",
    "job_advice",
    "job_goodput",
    "MIN_FAILURES",
]

MIN_FAILURES = 2
PLOT_POINTS = 40
COST_SAMPLE = 1000  # a save's cost: the median of the job's newest this many save timings


@dataclass(frozen=True)
class Starts:
    """What the advice reads of a job's process starts: the first and the latest start, and per node
    its restarts and the seconds of work they redid (`lost` in the module docstring)."""

    first_at: float
    latest_at: float
    restarts: dict[str, tuple[int, float]]


@dataclass(frozen=True)
class Progress:
    """A commit: when, and the training step it holds (None when the client gave none)."""

    at: float
    step: int | None


@dataclass(frozen=True)
class Usage:
    """What saves and restores cost the job: the seconds each node waited for them, and a save's
    median blocked time (None: no save timed yet)."""

    waited: dict[str, float]
    save_cost: float | None


def _blocking(actions: set[str]) -> str:
    """The action whose timings count as a save's blocked time: `blocked`, or `save` from clients
    that report no `blocked`."""
    return "blocked" if "blocked" in actions else "save"


def _steps_per_second(progress: list[Progress]) -> float | None:
    stepped = sorted((p.at, p.step) for p in progress if p.step is not None)
    if len(stepped) < 2 or stepped[-1][0] <= stepped[0][0] or stepped[-1][1] <= stepped[0][1]:
        return None
    return (stepped[-1][1] - stepped[0][1]) / (stepped[-1][0] - stepped[0][0])


def advise(
    job: str, starts: Starts | None, progress: list[Progress], usage: Usage, *, until: float | None = None
) -> Advice:
    """The job's goodput and recommended interval from its records (see the module docstring);
    `until`: the wall time ends there rather than at the latest record."""
    if starts is None:
        return Advice(job=job, note="no process of this job has started yet")
    wall = (until if until is not None else max([starts.latest_at] + [p.at for p in progress])) - starts.first_at
    failures, lost = max(starts.restarts.values())
    blocked, cost = max(usage.waited.values(), default=0.0), usage.save_cost
    mtbf = wall / failures if failures >= MIN_FAILURES and wall > 0 else None
    interval = math.sqrt(2 * cost * mtbf) if mtbf is not None and cost else None
    rate = _steps_per_second(progress)
    notes = []
    if failures < MIN_FAILURES:
        notes.append(
            f"{failures} failure(s) so far: no interval until the job has failed at least {MIN_FAILURES} times"
        )
    elif failures < 5:
        notes.append(f"only {failures} failures: the mean time between them, and so the interval, is a rough estimate")
    if cost is None:
        notes.append("no save timings reported yet")
    return Advice(
        job=job,
        goodput=None if wall <= 0 else min(1.0, max(0.0, (wall - lost - blocked) / wall)),
        wall_seconds=wall,
        lost_seconds=lost,
        blocked_seconds=blocked,
        failures=failures,
        mtbf_seconds=mtbf,
        save_cost_seconds=cost,
        interval_seconds=interval,
        interval_steps=None if interval is None or rate is None else max(1, round(interval * rate)),
        note="; ".join(notes) or None,
    )


def goodput_over_time(job: str, moments: list[tuple[float, Starts | None, Usage]]) -> list[tuple[float, float]]:
    """The job's goodput as it stood at each moment, from the starts and timings up to it (the
    dashboard's plot)."""
    series = []
    for moment, starts, usage in moments:
        advice = advise(job, starts, [], usage, until=moment)
        if advice.goodput is not None:
            series.append((moment, advice.goodput))
    return series


def _restarts(session: Session, job: Job, *by: ColumnElement[Any]) -> Select[Any]:
    """Per node (and per each of `by`): its starts, the seconds they redid, its first and latest start —
    summed by the database, one row per group whatever the job's history."""
    first = (
        select(Attempt.node, func.min(Attempt.number).label("number"), func.min(Attempt.started_at).label("at"))
        .where(Attempt.job_id == job.id)
        .group_by(Attempt.node)
        .subquery()
    )
    copy_at = (  # when the position the start resumed from was first committed, on any node
        select(func.min(Checkpoint.created_at))
        .where(
            Checkpoint.job_id == job.id,
            Checkpoint.epoch == Attempt.resumed_epoch,
            Checkpoint.batch_key == Attempt.resumed_batch_key,
        )
        .scalar_subquery()
    )
    redone = Attempt.started_at - func.coalesce(copy_at, first.c.at)
    lost = case((Attempt.number == first.c.number, 0.0), (redone > 0, redone), else_=0.0)
    return (
        select(
            Attempt.node,
            *by,
            func.count().label("starts"),
            func.sum(lost).label("lost"),
            func.min(Attempt.started_at).label("first_at"),
            func.max(Attempt.started_at).label("latest_at"),
        )
        .join(first, first.c.node == Attempt.node)
        .where(Attempt.job_id == job.id)
        .group_by(Attempt.node, *by)
    )


def _starts(session: Session, job: Job) -> Starts | None:
    rows = session.execute(_restarts(session, job)).all()
    if not rows:
        return None
    return Starts(
        min(r.first_at for r in rows),
        max(r.latest_at for r in rows),
        {r.node: (r.starts - 1, float(r.lost)) for r in rows},
    )


def _progress(session: Session, job: Job) -> list[Progress]:
    """What `advise` reads of the commits, in one pass over them: the latest, and the first and last
    commit times that carry a step with the least and the greatest step (the job's rate)."""
    stepped_at = case((Checkpoint.step.is_not(None), Checkpoint.created_at))
    latest, first, last, low, high = session.execute(
        select(
            func.max(Checkpoint.created_at),
            func.min(stepped_at),
            func.max(stepped_at),
            func.min(Checkpoint.step),
            func.max(Checkpoint.step),
        ).where(Checkpoint.job_id == job.id)
    ).one()
    progress = [] if latest is None else [Progress(latest, None)]
    if first is not None:
        progress += [Progress(first, low), Progress(last, high)]
    return progress


def _waited(
    session: Session, job: Job, *by: ColumnElement[Any], until: float | None = None
) -> tuple[str, list[Row[Any]]]:
    """The action that counts as a save's blocked time, and the seconds of it and of restores per node
    (and per each of `by`; reported up to `until`), summed by the database."""
    actions = set(session.scalars(select(Stat.action).where(Stat.job_id == job.id).distinct()))
    blocking = _blocking(actions)
    rows = session.execute(
        select(Stat.node, *by, func.sum(Stat.seconds).label("seconds"))
        .where(
            Stat.job_id == job.id,
            Stat.action.in_([blocking, "restore"]),
            Stat.created_at <= (until if until is not None else math.inf),
        )
        .group_by(Stat.node, *by)
    ).all()
    return blocking, list(rows)


def _usage(session: Session, job: Job) -> Usage:
    """What the job's timings say saves and restores cost, summed by the database; the save cost is
    the median of the newest COST_SAMPLE."""
    blocking, rows = _waited(session, job)
    waited: dict[str, float] = defaultdict(float)
    for row in rows:
        waited[row.node] += row.seconds
    saves = list(
        session.scalars(
            select(Stat.seconds)
            .where(Stat.job_id == job.id, Stat.action == blocking)
            .order_by(Stat.created_at.desc())
            .limit(COST_SAMPLE)
        )
    )
    return Usage(dict(waited), statistics.median(saves) if saves else None)


def job_advice(session: Session, job: Job) -> Advice:
    """`advise` over the job's attempts, commits and timings as the database holds them."""
    return advise(job.name, _starts(session, job), _progress(session, job), _usage(session, job))


def _moment_of(session: Session, at: InstrumentedAttribute[float], begun: float, end: float, points: int) -> Any:
    """The first of `points` moments evenly spaced over (begun, end] at or after `at`: its number,
    computed by the database (points − ⌊(end − at) · points / span⌋; 0 for `at` = `begun`)."""
    scaled = (end - at) * (points / (end - begun))
    floor = cast(scaled, Integer) if session.get_bind().dialect.name == "sqlite" else func.floor(scaled)
    return (points - floor).label("moment")


def job_goodput(session: Session, job: Job, *, points: int = PLOT_POINTS) -> tuple[Advice, list[tuple[float, float]]]:
    """The job's advice and its goodput at `points` moments from its first start to its latest record
    (the dashboard's job page): the starts and timings summed per node and moment by the database, so
    the cost follows the job's nodes, not its history."""
    starts, progress = _starts(session, job), _progress(session, job)
    advice = advise(job.name, starts, progress, _usage(session, job))
    if starts is None:
        return advice, []
    begun, end = starts.first_at, max([starts.latest_at] + [p.at for p in progress])
    if end <= begun:
        return advice, []
    restarts = session.execute(_restarts(session, job, _moment_of(session, Attempt.started_at, begun, end, points)))
    _, waits = _waited(session, job, _moment_of(session, Stat.created_at, begun, end, points), until=end)
    started: dict[int, list[Row[Any]]] = defaultdict(list)
    for row in restarts:
        started[int(row.moment)].append(row)
    waited_in: dict[int, list[Row[Any]]] = defaultdict(list)
    for row in waits:
        waited_in[int(row.moment)].append(row)
    starts_so_far: dict[str, tuple[int, float]] = {}
    waited_so_far: dict[str, float] = defaultdict(float)
    moments: list[tuple[float, Starts | None, Usage]] = []
    first_moment = min(list(started) + list(waited_in))
    latest = begun
    for number in range(min(first_moment, 1), points + 1):
        for row in started.get(number, []):
            count, lost = starts_so_far.get(row.node, (0, 0.0))
            starts_so_far[row.node] = (count + row.starts, lost + float(row.lost))
            latest = max(latest, row.latest_at)
        for row in waited_in.get(number, []):
            waited_so_far[row.node] += row.seconds
        if number >= 1:
            restarts_now = {node: (count - 1, lost) for node, (count, lost) in starts_so_far.items()}
            moments.append(
                (
                    begun + (end - begun) * number / points,
                    Starts(begun, latest, restarts_now),
                    Usage(dict(waited_so_far), None),
                )
            )
    return advice, goodput_over_time(job.name, moments)
