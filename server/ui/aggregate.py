"""The job page of a large job (more than AGGREGATE_NODES nodes): counts per position instead of a
node × position grid, and the nodes that hold the job back listed by name.

Everything is counted in SQL (GROUP BY), so the page costs a few queries whatever the node count;
a grid of 4,096 × 100 cells would be 400,000 table cells no one can read.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import and_, case, func, select, tuple_
from sqlalchemy.orm import Session

from ckptstore.position import Position
from ckptstore.server.db.models import Checkpoint, Job, PositionRow, batch_key
from ckptstore.server.records.last_good import expected_nodes

__all__ = [
    "newest_epochs_by_node",
    "AGGREGATE_NODES",
    "PositionCounts",
    "Laggard",
    "position_counts",
    "laggards",
    "SHOWN_NODES",
]

AGGREGATE_NODES = 64
SHOWN_NODES = 20  # nodes named per list; the rest are counted
_LISTED_POSITIONS = 5  # the newest positions whose absent nodes are named


@dataclass(frozen=True)
class PositionCounts:
    """How the expected nodes stand at one position: an intact copy, only corrupt copies, copies
    deleted or marked missing, or nothing recorded yet (the first few of those named)."""

    position: Position
    expected: int
    intact: int
    corrupt: int
    gone: int
    absent: int
    absent_nodes: list[str]
    bytes: int


@dataclass(frozen=True)
class Laggard:
    """A node whose newest intact copy is older than the job's newest position (None: it has none)."""

    node: str
    newest_epoch: int | None


def position_counts(session: Session, job: Job, rows: list[PositionRow]) -> list[PositionCounts]:
    """Counts for each of `rows` (positions, newest first), in two grouped queries."""
    if not rows:
        return []
    keys = [(r.epoch, r.batch_key) for r in rows]
    where = and_(Checkpoint.job_id == job.id, tuple_(Checkpoint.epoch, Checkpoint.batch_key).in_(keys))
    per_node = (
        select(
            Checkpoint.epoch,
            Checkpoint.batch_key,
            func.max(case((Checkpoint.state == "committed", 1), else_=0)).label("intact"),
            func.max(case((Checkpoint.state == "corrupt", 1), else_=0)).label("corrupt"),
            func.max(case((Checkpoint.state == "committed", Checkpoint.bytes), else_=0)).label("bytes"),
        )
        .where(where)
        .group_by(Checkpoint.epoch, Checkpoint.batch_key, Checkpoint.node)
        .subquery()
    )
    totals = {
        (epoch, key): (recorded, intact, corrupt, nbytes)
        for epoch, key, recorded, intact, corrupt, nbytes in session.execute(
            select(
                per_node.c.epoch,
                per_node.c.batch_key,
                func.count(),
                func.sum(per_node.c.intact),
                func.sum(case((and_(per_node.c.intact == 0, per_node.c.corrupt == 1), 1), else_=0)),
                func.sum(per_node.c.bytes),
            ).group_by(per_node.c.epoch, per_node.c.batch_key)
        )
    }
    expected = {r.nodes_version: expected_nodes(session, job, r.nodes_version) for r in rows}
    counts = []
    for row in rows:
        recorded, intact, corrupt, nbytes = totals.get((row.epoch, row.batch_key), (0, 0, 0, 0))
        nodes = expected[row.nodes_version]
        absent = max(len(nodes) - recorded, 0)
        counts.append(
            PositionCounts(
                position=row.position,
                expected=len(nodes),
                intact=int(intact or 0),
                corrupt=int(corrupt or 0),
                gone=recorded - int(intact or 0) - int(corrupt or 0),
                absent=absent,
                absent_nodes=[],
                bytes=int(nbytes or 0),
            )
        )
    return _name_absent_nodes(session, job, counts, expected, {r.position: r.nodes_version for r in rows})


def _name_absent_nodes(
    session: Session,
    job: Job,
    counts: list[PositionCounts],
    expected: dict[int, list[str]],
    versions: dict[Position, int],
) -> list[PositionCounts]:
    """Name the first SHOWN_NODES absent nodes of the newest few positions that have any."""
    named = []
    for listed, c in enumerate(c for c in counts if c.absent):
        if listed == _LISTED_POSITIONS:
            break
        recorded = set(
            session.scalars(
                select(Checkpoint.node)
                .distinct()
                .where(
                    Checkpoint.job_id == job.id,
                    Checkpoint.epoch == c.position.epoch,
                    Checkpoint.batch_key == batch_key(c.position.batch),
                )
            )
        )
        absent = [n for n in expected[versions[c.position]] if n not in recorded][:SHOWN_NODES]
        named.append(
            PositionCounts(c.position, c.expected, c.intact, c.corrupt, c.gone, c.absent, absent, c.bytes),
        )
    replaced = {c.position: c for c in named}
    return [replaced.get(c.position, c) for c in counts]


def newest_epochs_by_node(session: Session, job: Job) -> dict[str, int]:
    """Each node's newest epoch with a committed copy (nodes with none are absent)."""
    return dict(
        session.execute(
            select(Checkpoint.node, func.max(Checkpoint.epoch))
            .where(Checkpoint.job_id == job.id, Checkpoint.state == "committed")
            .group_by(Checkpoint.node)
        ).all()
    )


def laggards(session: Session, job: Job, newest: Position | None) -> tuple[list[Laggard], int]:
    """The slowest expected nodes (no intact copy at all first, then the oldest newest copy), the first
    SHOWN_NODES of them, and how many nodes are behind `newest` in all."""
    if newest is None:
        return [], 0
    newest_epochs = newest_epochs_by_node(session, job)
    behind = [
        Laggard(node, newest_epochs.get(node))
        for node in expected_nodes(session, job)
        if newest_epochs.get(node, -1) < newest.epoch
    ]
    behind.sort(key=lambda lag: (-1 if lag.newest_epoch is None else lag.newest_epoch, lag.node))
    return behind[:SHOWN_NODES], len(behind)
