"""Operations advice per job, from the service's own records: goodput — how much of the job's wall
time went to training, not to work redone after failures nor to saves and restores — and the
checkpoint interval Young and Daly recommend, √(2 · save cost · mean time between failures).

`advise` is a pure function of plain records (tested with histories whose answers are known);
`job_advice` reads them from the database in a few aggregate queries, whatever the job's size (the
dashboard and /metrics ask for it: a 4,096-node job's 400,000 commits are never read row by row). Definitions (docs/operations.md, "Goodput"):
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

from sqlalchemy import case, func, select, tuple_
from sqlalchemy.orm import Session

from ckptstore.server.db.models import Attempt, Checkpoint, Job, Stat
from ckptstore.wire.schema import Advice

__all__ = [
    "Start",
    "Progress",
    "Timing",
    "Usage",
    "usage_of",
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
class Start:
    """A process start of a node; `resumed_copy_at`: when the copy it resumed from was committed."""

    node: str
    number: int
    started_at: float
    resumed_copy_at: float | None


@dataclass(frozen=True)
class Progress:
    """A commit: when, and the training step it holds (None when the client gave none)."""

    at: float
    step: int | None


@dataclass(frozen=True)
class Timing:
    """A save's or restore's reported time (`at`: when it was reported)."""

    node: str
    action: str
    seconds: float
    at: float


def _lost(starts: list[Start]) -> tuple[float, int]:
    """The seconds of work one node redid after its restarts, and how many restarts."""
    ordered = sorted(starts, key=lambda s: s.number)
    first, lost = ordered[0].started_at, 0.0
    for start in ordered[1:]:
        lost += max(0.0, start.started_at - (first if start.resumed_copy_at is None else start.resumed_copy_at))
    return lost, len(ordered) - 1


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


def usage_of(timings: list[Timing]) -> Usage:
    """`Usage` from single timings."""
    blocking = _blocking({t.action for t in timings})
    waited: dict[str, float] = defaultdict(float)
    for timing in timings:
        if timing.action in (blocking, "restore"):
            waited[timing.node] += timing.seconds
    saves = [t.seconds for t in timings if t.action == blocking]
    return Usage(dict(waited), statistics.median(saves) if saves else None)


def _steps_per_second(progress: list[Progress]) -> float | None:
    stepped = sorted((p.at, p.step) for p in progress if p.step is not None)
    if len(stepped) < 2 or stepped[-1][0] <= stepped[0][0] or stepped[-1][1] <= stepped[0][1]:
        return None
    return (stepped[-1][1] - stepped[0][1]) / (stepped[-1][0] - stepped[0][0])


def advise(
    job: str, starts: list[Start], progress: list[Progress], usage: Usage, *, until: float | None = None
) -> Advice:
    """The job's goodput and recommended interval from its records (see the module docstring);
    `until`: the wall time ends there rather than at the latest record."""
    if not starts:
        return Advice(job=job, note="no process of this job has started yet")
    by_node: dict[str, list[Start]] = defaultdict(list)
    for start in starts:
        by_node[start.node].append(start)
    begun = min(s.started_at for s in starts)
    wall = (until if until is not None else max([s.started_at for s in starts] + [p.at for p in progress])) - begun
    lost, failures = max((_lost(node_starts) for node_starts in by_node.values()), key=lambda lf: (lf[1], lf[0]))
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


def goodput_over_time(
    job: str, starts: list[Start], progress: list[Progress], timings: list[Timing], *, points: int = PLOT_POINTS
) -> list[tuple[float, float]]:
    """The job's goodput as it stood at `points` moments from its first start to its latest record:
    `advise` over the records up to each (the dashboard's plot)."""
    if not starts:
        return []
    begun = min(s.started_at for s in starts)
    end = max([s.started_at for s in starts] + [p.at for p in progress])
    series = []
    for i in range(1, points + 1):
        moment = begun + (end - begun) * i / points
        advice = advise(
            job,
            [s for s in starts if s.started_at <= moment],
            [p for p in progress if p.at <= moment],
            usage_of([t for t in timings if t.at <= moment]),
            until=moment,
        )
        if advice.goodput is not None:
            series.append((moment, advice.goodput))
    return series


def _starts(session: Session, job: Job) -> list[Start]:
    """Every start of the job, with when the position it resumed from was first committed."""
    rows = session.execute(
        select(
            Attempt.node, Attempt.number, Attempt.started_at, Attempt.resumed_epoch, Attempt.resumed_batch_key
        ).where(Attempt.job_id == job.id)
    ).all()
    resumed = {(r.resumed_epoch, r.resumed_batch_key) for r in rows if r.resumed_epoch is not None}
    committed_at: dict[tuple[int, int], float] = {}  # a resumed position's first commit, on any node
    if resumed:
        position = tuple_(Checkpoint.epoch, Checkpoint.batch_key)
        for epoch, key, at in session.execute(
            select(Checkpoint.epoch, Checkpoint.batch_key, func.min(Checkpoint.created_at))
            .where(Checkpoint.job_id == job.id, position.in_(list(resumed)))
            .group_by(Checkpoint.epoch, Checkpoint.batch_key)
        ):
            committed_at[(epoch, key)] = at
    return [
        Start(r.node, r.number, r.started_at, committed_at.get((r.resumed_epoch, r.resumed_batch_key))) for r in rows
    ]


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


def _usage(session: Session, job: Job) -> Usage:
    """`usage_of` the job's timings, summed by the database; the save cost from the newest COST_SAMPLE."""
    sums = session.execute(
        select(Stat.node, Stat.action, func.sum(Stat.seconds))
        .where(Stat.job_id == job.id)
        .group_by(Stat.node, Stat.action)
    ).all()
    blocking = _blocking({action for _, action, _ in sums})
    waited: dict[str, float] = defaultdict(float)
    for node, action, seconds in sums:
        if action in (blocking, "restore"):
            waited[node] += seconds
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


def job_goodput(session: Session, job: Job) -> tuple[Advice, list[tuple[float, float]]]:
    """The job's advice and its goodput over time (the dashboard's job page, for jobs small enough
    to replay: every timing is read)."""
    starts, progress = _starts(session, job), _progress(session, job)
    timings = [
        Timing(*row)
        for row in session.execute(
            select(Stat.node, Stat.action, Stat.seconds, Stat.created_at).where(Stat.job_id == job.id)
        )
    ]
    return advise(job.name, starts, progress, _usage(session, job)), goodput_over_time(
        job.name, starts, progress, timings
    )
