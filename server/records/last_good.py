"""The judge: which positions are good (and durable), the last good epoch, the resume position,
and why newer positions are not good.

Invariant: a node's part of a position is its newest attempt there that has an intact copy (the
newest attempt counts; an older one is the fallback while the newer one's copies are all corrupt or
missing), or its newest attempt when none has. The part is intact when one of its copies (on any
tier) is committed, and durable when its durable copy is. A position is good when every node expected at it (the job's node set when the position
was first written) has an intact part, durable when every such part is durable. `positions.good`,
`positions.durable` and the job's cached last good, durable epoch and resume position change only
through `judge_position`, in the same transaction as the commit or mark that changes a position.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session

from ckptstore.names import attempt_sort_key
from ckptstore.position import Position
from ckptstore.server.db import queries
from ckptstore.server.db.models import END_OF_EPOCH, Checkpoint, Job, NodeSet, PositionRow, batch_key
from ckptstore.server.db.transaction import state_of
from ckptstore.server.events.log import emit
from ckptstore.server.records import held
from ckptstore.wire.schema import DELETED_ON_PURPOSE, CopyInfo, LastGood, NodeLocation, NotGood, PositionBody

__all__ = [
    "is_expected",
    "Part",
    "expected_nodes",
    "parts_at",
    "parts",
    "judge_position",
    "defer_judgments",
    "run_deferred_judgments",
    "read_node_sets",
    "bump",
    "newest_good",
    "last_good",
    "NOT_GOOD_LIMIT",
]

NOT_GOOD_LIMIT = 20


@dataclass
class Part:
    """One node's part of a position: the copies of the attempt that counts there, nearest tier first."""

    attempt: str
    copies: list[Checkpoint] = field(default_factory=list)

    @property
    def intact(self) -> bool:
        return any(c.state == "committed" for c in self.copies)

    @property
    def durable(self) -> bool:
        return any(c.state == "committed" and c.tier == "durable" for c in self.copies)

    @property
    def state(self) -> str:
        """committed when intact, else the most telling state of its copies: corrupt, missing, deleted."""
        states = {c.state for c in self.copies}
        return next(s for s in ("committed", "corrupt", "missing", "deleted") if s in states)

    @property
    def reason(self) -> str | None:
        """Why its copies are not committed, as recorded with the first that says (None: nothing said)."""
        return next((c.reason for c in self.copies if c.state != "committed" and c.reason), None)

    @property
    def deleted_on_purpose(self) -> bool:
        """Every copy deleted by retention, gc or a finished fit (not by hand, not lost)."""
        return all(c.state == "deleted" and c.cause in DELETED_ON_PURPOSE for c in self.copies)

    @property
    def location(self) -> str:
        """The durable copy's location when there is one (what other machines can read), else the nearest."""
        durable = [c for c in self.copies if c.tier == "durable"]
        return (durable or self.copies)[0].location


def expected_nodes(session: Session, job: Job, version: int | None = None) -> list[str]:
    """The job's expected nodes (at node-set `version`; default: the current one)."""
    return list(_node_set(session, job, version)[0])


def is_expected(session: Session, job: Job, node: str) -> bool:
    """Whether `node` is one of the job's current expected nodes."""
    return node in _node_set(session, job, None)[1]


def _node_set(session: Session, job: Job, version: int | None) -> tuple[list[str], frozenset[str]]:
    """A node set, read once per transaction (a group commit of a 4,096-node job asks for it per write)."""
    key = (job.id, version or job.nodes_version)
    found = _node_sets(session).get(key)
    if found is None:
        node_set = session.get(NodeSet, key)
        assert node_set is not None, "every job has the node set its nodes_version names"
        found = _hold_node_set(session, node_set)
    return found


def read_node_sets(session: Session, jobs: list[Job]) -> None:
    """Read the current node sets of `jobs` in one query and hold them for the transaction."""
    if jobs:
        keys = [(job.id, job.nodes_version) for job in jobs]
        for node_set in session.scalars(select(NodeSet).where(tuple_(NodeSet.job_id, NodeSet.version).in_(keys))):
            _hold_node_set(session, node_set)


def _node_sets(session: Session) -> dict[tuple[int, int], tuple[list[str], frozenset[str]]]:
    return state_of(session).node_sets


def _hold_node_set(session: Session, node_set: NodeSet) -> tuple[list[str], frozenset[str]]:
    nodes = (list(node_set.nodes), frozenset(node_set.nodes))
    _node_sets(session)[(node_set.job_id, node_set.version)] = nodes
    return nodes


def bump(session: Session, job: Job) -> None:
    """The job's records changed: a new version (cached answers keyed by the old one go stale), and a
    note for the transaction's commit to tell the other service processes (server/db/engine.py). Once per
    transaction is enough: nobody sees its states in between (a group commit's writes share one)."""
    state = state_of(session)
    if job.name not in state.bumped_jobs:
        job.version += 1
        state.bumped_jobs.add(job.name)
    state.changed_jobs[job.name] = job


def parts_at(session: Session, job: Job, positions: list[Position]) -> dict[Position, dict[str, Part]]:
    """Each node's part (its newest attempt's copies) at each of `positions`, in one query."""
    found: dict[Position, dict[str, Part]] = {p: {} for p in positions}
    if not positions:
        return found
    keys = [(p.epoch, batch_key(p.batch)) for p in positions]
    rows = session.scalars(
        select(Checkpoint).where(Checkpoint.job_id == job.id, tuple_(Checkpoint.epoch, Checkpoint.batch_key).in_(keys))
    )
    attempts: dict[tuple[Position, str], dict[str, Part]] = defaultdict(dict)
    for row in sorted(rows, key=lambda r: r.tier != "local"):
        attempts[(row.position, row.node)].setdefault(row.attempt, Part(row.attempt)).copies.append(row)
    for (position, node), by_attempt in attempts.items():
        newest_first = sorted(by_attempt.values(), key=lambda p: attempt_sort_key(p.attempt), reverse=True)
        found[position][node] = next((p for p in newest_first if p.intact), newest_first[0])
    return found


def parts(session: Session, job: Job, position: Position) -> dict[str, Part]:
    return parts_at(session, job, [position])[position]


def judge_position(session: Session, job: Job, position: Position) -> None:
    """Re-decide whether `position` is good and durable; refresh the job's cached answers if it changed.
    Inside a group commit (server/records/batching.py) the judgment waits for the end of the batch, once per
    position however many writes touched it."""
    deferred = state_of(session).deferred_judgments
    if deferred is not None:
        deferred[(job.id, position)] = job
        return
    _judge(session, job, position)


def defer_judgments(session: Session) -> None:
    """From now on, `judge_position` waits for `run_deferred_judgments` (a group commit's end)."""
    state_of(session).deferred_judgments = {}


def run_deferred_judgments(session: Session) -> None:
    """Judge every position the batch's writes touched (once each), then stop deferring."""
    state = state_of(session)
    deferred, state.deferred_judgments = state.deferred_judgments or {}, None
    for (_, position), job in deferred.items():
        _judge(session, job, position)


def _judge(session: Session, job: Job, position: Position) -> None:
    where = (job.id, position.epoch, batch_key(position.batch))
    row = session.get(PositionRow, where)
    assert row is not None, "a position row exists for every position with a checkpoint record"
    expected = expected_nodes(session, job, row.nodes_version)
    if not (row.good or row.durable) and _nodes_with_intact_copy(session, job, position, where) < len(expected):
        return  # still not good: counted without loading the position's records
    current = parts(session, job, position)
    good = all(n in current and current[n].intact for n in expected)
    durable = all(n in current and current[n].durable for n in expected)
    if (good, durable) == (row.good, row.durable):
        return
    became_good = good and not row.good
    row.good, row.durable = good, durable
    session.flush()
    _refresh_last_good(session, job)
    if became_good:
        emit(
            session,
            "position.good",
            job.name,
            position=position,
            last_good_epoch=job.last_good_epoch,
            durable=durable,
            nodes=len(expected),
        )


def _nodes_with_intact_copy(session: Session, job: Job, position: Position, where: tuple[int, int, int]) -> int:
    """At most the nodes with an intact copy (a mark since may have made one not intact; the full
    judgment follows when enough are counted). A position this transaction created has only the
    copies it recorded (`held.hold_position` counts their nodes); others are counted on the connection:
    copies go in with Core and marks flush at once, so nothing is pending to flush first (the
    batch's job versions flush once, at its end)."""
    fresh = held.fresh_nodes(session, where)
    if fresh is not None:
        return len(fresh)
    parameters = {"job_id": job.id, "epoch": position.epoch, "key": where[2]}
    return session.connection().scalar(queries.NODES_WITH_INTACT_COPY, parameters) or 0


def newest_good(
    session: Session, job: Job, *, end_of_epoch: bool, max_epoch: int | None = None, durable: bool = False
) -> Position | None:
    """The highest good (or durable) position — only end-of-epoch ones with `end_of_epoch` — at or below `max_epoch`."""
    flag = PositionRow.durable if durable else PositionRow.good
    query = select(PositionRow).where(PositionRow.job_id == job.id, flag.is_(True))
    if end_of_epoch:
        query = query.where(PositionRow.batch_key == END_OF_EPOCH)
    if max_epoch is not None:
        query = query.where(PositionRow.epoch <= max_epoch)
    row = session.scalar(query.order_by(PositionRow.epoch.desc(), PositionRow.batch_key.desc()).limit(1))
    return None if row is None else row.position


def _refresh_last_good(session: Session, job: Job) -> None:
    last = newest_good(session, job, end_of_epoch=True)
    durable = newest_good(session, job, end_of_epoch=True, durable=True)
    resume = newest_good(session, job, end_of_epoch=False)
    job.last_good_epoch = None if last is None else last.epoch
    job.durable_epoch = None if durable is None else durable.epoch
    job.resume_epoch = None if resume is None else resume.epoch
    job.resume_batch_key = None if resume is None else batch_key(resume.batch)


def _location(part: Part) -> NodeLocation:
    copies = [CopyInfo(tier=c.tier, location=c.location, state=c.state) for c in part.copies]
    return NodeLocation(location=part.location, attempt=part.attempt, copies=copies)


def last_good(session: Session, job: Job, *, max_epoch: int | None = None) -> LastGood:
    """The last good epoch, the durable epoch, the resume position, where each node's part of it is,
    and why newer positions are not good."""
    if max_epoch is None:
        last, durable, resume = job.last_good_epoch, job.durable_epoch, job.resume
    else:
        end = newest_good(session, job, end_of_epoch=True, max_epoch=max_epoch)
        durable_end = newest_good(session, job, end_of_epoch=True, max_epoch=max_epoch, durable=True)
        resume = newest_good(session, job, end_of_epoch=False, max_epoch=max_epoch)
        last, durable = (None if end is None else end.epoch), (None if durable_end is None else durable_end.epoch)
    nodes = {}
    if resume is not None:
        nodes = {node: _location(part) for node, part in sorted(parts(session, job, resume).items())}
    return LastGood(
        job=job.name,
        epoch=last,
        durable_epoch=durable,
        resume=PositionBody.of(resume),
        nodes=nodes,
        not_good=_not_good(session, job, above=resume, max_epoch=max_epoch),
    )


def _not_good(session: Session, job: Job, *, above: Position | None, max_epoch: int | None) -> list[NotGood]:
    """The newest positions above `above` that are not good, and which nodes' parts are missing, corrupt or
    deleted (positions every part of which was deleted are left out: nothing went wrong there)."""
    newer = select(PositionRow).where(PositionRow.job_id == job.id, PositionRow.good.is_(False))
    if above is not None:
        newer = newer.where(tuple_(PositionRow.epoch, PositionRow.batch_key) > (above.epoch, batch_key(above.batch)))
    if max_epoch is not None:
        newer = newer.where(PositionRow.epoch <= max_epoch)
    rows = list(
        session.scalars(newer.order_by(PositionRow.epoch.desc(), PositionRow.batch_key.desc()).limit(NOT_GOOD_LIMIT))
    )
    parts_by_position = parts_at(session, job, [row.position for row in rows])
    not_good = []
    for row in rows:
        at = parts_by_position[row.position]
        expected = expected_nodes(session, job, row.nodes_version)
        states = {n: at[n].state if n in at else "missing" for n in expected}
        if all(n in at and at[n].deleted_on_purpose for n in expected):
            continue  # deleted by retention, gc or a finished fit: nothing went wrong there
        not_good.append(
            NotGood(
                epoch=row.epoch,
                batch=row.position.batch,
                missing=[n for n in expected if states[n] == "missing"],
                corrupt=[n for n in expected if states[n] == "corrupt"],
                deleted=[n for n in expected if states[n] == "deleted"],
                reasons={n: reason for n in expected if n in at and (reason := at[n].reason) is not None},
            )
        )
    return not_good
