"""Operations advice per job, from the service's own records: goodput — how much of the job's wall
time went to training, not to work redone after failures nor to saves and restores — and the
checkpoint interval Young and Daly recommend, √(2 · save cost · mean time between failures).

`advise` is a pure function of a job's totals; `job_advice` and `job_goodput` (the plot) have the
database compute them in a few aggregate queries over the job's newest WINDOW starts, timings and
commits of each kind (found by walking indexes by time), so what one request costs follows the job's
nodes and the window, not its history: a 4,096-node job's 400,000 commits, or one token's 100,000
starts and timings, are never all read, by the service or by the database (the dashboard and
/metrics ask for the advice). A job whose history is longer is advised on its recent part, and the
advice says since when. Definitions (docs/operations.md, "Goodput"):
- wall: from the job's first start (or the window's start) to its latest record (a start or a commit);
- lost: per restart of a node, from the commit of the copy it resumed from (its first start when it
  resumed nothing; the window's start at the earliest) to the restart — the work redone, the time
  down included; the node that lost most;
- blocked: the seconds training waited for saves (`blocked` stats; `save` where a client reports no
  `blocked`) and restores; the node that waited most;
- failures: the restarts of the node restarted most; fewer than 2 → no MTBF and no interval.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import ColumnElement, Integer, Row, Select, case, cast, func, select
from sqlalchemy.orm import InstrumentedAttribute, Session, aliased

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
    "WINDOW",
]

MIN_FAILURES = 2
WINDOW = 5000  # the newest starts, timings and commits (of each kind) one request reads
PLOT_POINTS = 40
COST_SAMPLE = 1000  # a save's cost: the median of the job's newest this many save timings


@dataclass(frozen=True)
class Starts:
    """What the advice reads of a job's process starts: the first and the latest start, per node its
    restarts and the seconds of work they redid (`lost` in the module docstring), and where the window
    of newest records it was read from begins (None: the whole history)."""

    first_at: float
    latest_at: float
    restarts: dict[str, tuple[int, float]]
    since: float | None = None


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
    failures, lost = max(starts.restarts.values(), default=(0, 0.0))
    blocked, cost = max(usage.waited.values(), default=0.0), usage.save_cost
    mtbf = wall / failures if failures >= MIN_FAILURES and wall > 0 else None
    interval = math.sqrt(2 * cost * mtbf) if mtbf is not None and cost else None
    rate = _steps_per_second(progress)
    notes = []
    if starts.since is not None:
        began = datetime.fromtimestamp(starts.since, timezone.utc).isoformat(timespec="seconds")
        notes.append(f"from the job's newest records, since {began}: its older history is not read")
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


def _window_start(session: Session, job: Job, window: int) -> float | None:
    """Where the job's newest `window` records of each kind (starts, timings, commits) begin: the
    latest of the window-th newest start, timing and commit; None when the whole history is within
    (each read walks an index by time: `window` entries, not the history)."""
    newest = (
        (Attempt.started_at, Attempt.job_id),
        (Stat.created_at, Stat.job_id),
        (Checkpoint.created_at, Checkpoint.job_id),
    )
    bounds = [
        session.scalar(select(at).where(job_id == job.id).order_by(at.desc()).offset(window - 1).limit(1))
        for at, job_id in newest
    ]
    return max((bound for bound in bounds if bound is not None), default=None)


def _restarts(session: Session, job: Job, since: float | None, *by: ColumnElement[Any]) -> Select[Any]:
    """Per node (and per each of `by`): its starts from `since` on, the restarts among them, the
    seconds they redid (counted from `since` at the earliest), its first and latest start — summed by
    the database, one row per group."""
    earlier = aliased(Attempt)
    of_node = (earlier.job_id == job.id, earlier.node == Attempt.node)
    first_number = select(func.min(earlier.number)).where(*of_node).scalar_subquery()
    first_at = select(earlier.started_at).where(*of_node).order_by(earlier.number).limit(1).scalar_subquery()
    copy_at = (  # when the position the start resumed from was first committed, on any node
        select(func.min(Checkpoint.created_at))
        .where(
            Checkpoint.job_id == job.id,
            Checkpoint.epoch == Attempt.resumed_epoch,
            Checkpoint.batch_key == Attempt.resumed_batch_key,
        )
        .scalar_subquery()
    )
    anchor: ColumnElement[Any] = func.coalesce(copy_at, first_at)
    if since is not None:
        anchor = case((anchor < since, since), else_=anchor)
    redone = Attempt.started_at - anchor
    is_first = Attempt.number == first_number
    lost = case((is_first, 0.0), (redone > 0, redone), else_=0.0)
    return (
        select(
            Attempt.node,
            *by,
            func.sum(case((is_first, 0), else_=1)).label("restarts"),
            func.sum(lost).label("lost"),
            func.min(Attempt.started_at).label("first_at"),
            func.max(Attempt.started_at).label("latest_at"),
        )
        .where(Attempt.job_id == job.id, Attempt.started_at >= (since if since is not None else -math.inf))
        .group_by(Attempt.node, *by)
    )


def _starts(session: Session, job: Job, since: float | None) -> Starts | None:
    rows = session.execute(_restarts(session, job, since)).all()
    if not rows and since is None:
        return None
    return Starts(
        since if since is not None else min(r.first_at for r in rows),
        max([r.latest_at for r in rows], default=since or 0.0),
        {r.node: (int(r.restarts), float(r.lost)) for r in rows},
        since,
    )


def _progress(session: Session, job: Job, since: float | None) -> list[Progress]:
    """What `advise` reads of the commits from `since` on: the latest, and the first and the last that
    carry a step, with their steps (the job's rate) — each the end of an index range."""
    in_window = (Checkpoint.job_id == job.id, Checkpoint.created_at >= (since if since is not None else -math.inf))
    latest = session.scalar(select(func.max(Checkpoint.created_at)).where(*in_window))
    if latest is None:
        return []
    progress = [Progress(latest, None)]
    for order in (Checkpoint.created_at, Checkpoint.created_at.desc()):
        stepped = session.execute(
            select(Checkpoint.created_at, Checkpoint.step)
            .where(*in_window, Checkpoint.step.is_not(None))
            .order_by(order)
            .limit(1)
        ).first()
        if stepped is not None:
            progress.append(Progress(stepped.created_at, stepped.step))
    return progress


def _waited(
    session: Session, job: Job, since: float | None, *by: ColumnElement[Any], until: float | None = None
) -> tuple[str, list[Row[Any]]]:
    """The action that counts as a save's blocked time, and the seconds of it and of restores per node
    (and per each of `by`; reported from `since` up to `until`), summed by the database."""
    reports_blocked = session.scalar(select(Stat.id).where(Stat.job_id == job.id, Stat.action == "blocked").limit(1))
    blocking = "blocked" if reports_blocked is not None else "save"
    rows = session.execute(
        select(Stat.node, *by, func.sum(Stat.seconds).label("seconds"))
        .where(
            Stat.job_id == job.id,
            Stat.action.in_([blocking, "restore"]),
            Stat.created_at >= (since if since is not None else -math.inf),
            Stat.created_at <= (until if until is not None else math.inf),
        )
        .group_by(Stat.node, *by)
    ).all()
    return blocking, list(rows)


def _usage(session: Session, job: Job, since: float | None) -> Usage:
    """What the job's timings from `since` on say saves and restores cost, summed by the database; the
    save cost is the median of the newest COST_SAMPLE."""
    blocking, rows = _waited(session, job, since)
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


def job_advice(session: Session, job: Job, *, window: int = WINDOW) -> Advice:
    """`advise` over the job's newest `window` starts, commits and timings of each kind, as the
    database holds them."""
    since = _window_start(session, job, window)
    return advise(job.name, _starts(session, job, since), _progress(session, job, since), _usage(session, job, since))


def _moment_of(session: Session, at: InstrumentedAttribute[float], begun: float, end: float, points: int) -> Any:
    """The first of `points` moments evenly spaced over (begun, end] at or after `at`: its number,
    computed by the database (points − ⌊(end − at) · points / span⌋; 0 for `at` = `begun`)."""
    scaled = (end - at) * (points / (end - begun))
    floor = cast(scaled, Integer) if session.get_bind().dialect.name == "sqlite" else func.floor(scaled)
    return (points - floor).label("moment")


def job_goodput(
    session: Session, job: Job, *, points: int = PLOT_POINTS, window: int = WINDOW
) -> tuple[Advice, list[tuple[float, float]]]:
    """The job's advice and its goodput at `points` moments from its first start (or its window's
    start) to its latest record (the dashboard's job page): the starts and timings summed per node and
    moment by the database, so the cost follows the job's nodes and the window, not its history."""
    since = _window_start(session, job, window)
    starts, progress = _starts(session, job, since), _progress(session, job, since)
    advice = advise(job.name, starts, progress, _usage(session, job, since))
    if starts is None:
        return advice, []
    begun, end = starts.first_at, max([starts.latest_at] + [p.at for p in progress])
    if end <= begun:
        return advice, []
    restarts = session.execute(
        _restarts(session, job, since, _moment_of(session, Attempt.started_at, begun, end, points))
    )
    _, waits = _waited(session, job, since, _moment_of(session, Stat.created_at, begun, end, points), until=end)
    started: dict[int, list[Row[Any]]] = defaultdict(list)
    for row in restarts:
        started[int(row.moment)].append(row)
    waited_in: dict[int, list[Row[Any]]] = defaultdict(list)
    for row in waits:
        waited_in[int(row.moment)].append(row)
    starts_so_far: dict[str, tuple[int, float]] = {}
    waited_so_far: dict[str, float] = defaultdict(float)
    moments: list[tuple[float, Starts | None, Usage]] = []
    first_moment = min(list(started) + list(waited_in), default=1)
    latest = begun
    for number in range(min(first_moment, 1), points + 1):
        for row in started.get(number, []):
            count, lost = starts_so_far.get(row.node, (0, 0.0))
            starts_so_far[row.node] = (count + int(row.restarts), lost + float(row.lost))
            latest = max(latest, row.latest_at)
        for row in waited_in.get(number, []):
            waited_so_far[row.node] += row.seconds
        if number >= 1:
            moments.append(
                (
                    begun + (end - begun) * number / points,
                    Starts(begun, latest, dict(starts_so_far), since),
                    Usage(dict(waited_so_far), None),
                )
            )
    return advice, goodput_over_time(job.name, moments)
