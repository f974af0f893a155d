"""New attempts, copies and positions of a group commit's hot writes, held and inserted together.

One INSERT per new row was most of a commit's or a registration's round trips on PostgreSQL. In
a batch run without savepoints (server/records/batching.py), the writes that know about held rows
(`recording`, `registration`: submitted with `defers_inserts`) hold their new rows here and
consult them where they would have read them back — a node's newest attempt, its newest
committed one, an Idempotency-Key's attempt, an attempt's copies of a position. Before any other
write, before the judgments and before anything else reads those tables (`flush`), every held row
is inserted, one executemany per table, so the rest of the service reads them from the database
as before. Outside such a batch, `hold` inserts at once. The numbers registrations read from the
database are read once for the whole batch, at its start (`ckptstore.server.records.restarts.read_attempt_numbers`).
"""

from __future__ import annotations

from sqlalchemy.orm import Session, make_transient_to_detached

from ckptstore.server.db.models import Attempt, Base, Checkpoint, Job, PositionRow, insert_rows
from ckptstore.server.db.transaction import Held, HeldCopy, PositionKey, state_of

__all__ = [
    "held_rows",
    "hold",
    "flush",
    "start_holding",
    "newest_attempt",
    "newest_committed",
    "copies_of",
    "keyed_attempt",
    "stored_attempt_numbers",
    "hold_position",
    "fresh_nodes",
]


def start_holding(session: Session) -> None:
    """From now on, `hold` keeps rows for `flush` (the batch's transaction, without savepoints)."""
    state_of(session).held = Held()


def held_rows(session: Session) -> Held | None:
    """What is held in this transaction, or None where rows are inserted at once."""
    return state_of(session).held


def hold(session: Session, row: Base) -> None:
    """Insert `row` at the next `flush` (at once where nothing is held)."""
    held = held_rows(session)
    if held is None:
        insert_rows(session, [row])
        return
    held.rows[type(row)].append(row)
    if isinstance(row, Attempt):
        where = (row.job_id, row.node)
        held.newest_attempt[where] = max(held.newest_attempt.get(where, 0), row.number)
        if row.request_key is not None:
            held.keyed_attempts[(row.job_id, row.node, row.request_key)] = row
    elif isinstance(row, Checkpoint):
        where = (row.job_id, row.node)
        held.newest_committed[where] = max(held.newest_committed.get(where, 0), row.attempt_number)
        held.copies[(row.job_id, row.node, row.epoch, row.batch_key, row.attempt)].append(row)


def hold_position(session: Session, job: Job, epoch: int, key: int, *, known: bool, node: str) -> None:
    """The row of the position `node` just committed, inserted if not `known` yet. Held for the
    transaction: the session keeps unchanged rows only weakly, and a group commit's writes to one
    position would otherwise read it once each. A new row is held (`hold`: inserted with Core, not
    by the unit of work) and joins the session as already persistent: the judge, which runs after
    the flush, reads and updates it without loading it back. For a
    position this transaction created, every copy is one it recorded: the nodes are counted here."""
    state = state_of(session)
    kept, fresh = state.position_rows, state.fresh_positions
    where = (job.id, epoch, key)
    if where not in kept:
        row = session.get(PositionRow, where) if known else None
        if row is None:
            row = PositionRow(
                job_id=job.id, epoch=epoch, batch_key=key, nodes_version=job.nodes_version, good=False, durable=False
            )
            hold(session, row)
            make_transient_to_detached(row)
            session.add(row)
            fresh[where] = set()
        kept[where] = row
    if where in fresh:
        fresh[where].add(node)


def fresh_nodes(session: Session, where: PositionKey) -> set[str] | None:
    """The nodes that committed a position (job id, epoch, batch key) this transaction created — all
    of its copies; None for a position that existed before."""
    return state_of(session).fresh_positions.get(where)


def flush(session: Session) -> None:
    """Insert every held row, one executemany per table; the session keeps holding after."""
    held = held_rows(session)
    if held is None or not held.rows:
        return
    start_holding(session)
    for rows in held.rows.values():
        insert_rows(session, rows)


def stored_attempt_numbers(
    session: Session, job_id: int, node: str, request_key: str | None
) -> tuple[int | None, int | None, int | None] | None:
    """The node's newest registered and committed attempts and the key's attempt as stored before
    the batch (`queries.ATTEMPT_NUMBERS`), where they were read at its start; else None."""
    held = held_rows(session)
    numbers = None if held is None else held.stored_numbers.get((job_id, node))
    if held is None or numbers is None:
        return None
    if request_key is None:
        return (*numbers, None)
    if (job_id, node, request_key) not in held.stored_keys:
        return None
    return (*numbers, held.stored_keys[(job_id, node, request_key)])


def newest_attempt(session: Session, job_id: int, node: str, stored: int | None) -> int | None:
    """The node's newest registered attempt: the `stored` one's number or a held one's."""
    held = held_rows(session)
    return stored if held is None else max(stored or 0, held.newest_attempt.get((job_id, node), 0)) or None


def newest_committed(session: Session, job_id: int, node: str, stored: int | None) -> int | None:
    """The node's newest attempt with a copy: the `stored` one's number or a held copy's."""
    held = held_rows(session)
    return stored if held is None else max(stored or 0, held.newest_committed.get((job_id, node), 0)) or None


def copies_of(session: Session, key: HeldCopy) -> list[Checkpoint]:
    """The held copies of an attempt at a position."""
    held = held_rows(session)
    return [] if held is None else held.copies.get(key, [])


def keyed_attempt(session: Session, job_id: int, node: str, request_key: str) -> Attempt | None:
    """The held attempt registered with `request_key`."""
    held = held_rows(session)
    return None if held is None else held.keyed_attempts.get((job_id, node, request_key))
