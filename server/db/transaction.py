"""What one database transaction carries beside its session: the jobs it locked, what it read once
for all its writes, the rows it holds back, what it changed and the events it emitted.

One typed object per session (`state_of`), and the only code that touches `session.info`: every
module that needs per-transaction state asks for it here. A group commit (server/records/batching.py) runs
many writes in one transaction, so most of this is there to do once per transaction what each write
would otherwise do again (lock a job, read a node set, bump a version, judge a position).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from ckptstore.position import Position
from ckptstore.server.db.models import Attempt, Base, Checkpoint, Job, PositionRow

__all__ = ["WriteState", "Held", "HeldCopy", "PositionKey", "state_of"]

PositionKey = tuple[int, int, int]  # job id, epoch, batch key
HeldCopy = tuple[int, str, int, int, str]  # job id, node, epoch, batch key, attempt: one attempt's copies
_KEY = "ckptstore_write_state"


@dataclass
class Held:
    """What a batch's hot writes added and have not inserted yet (server/records/held.py)."""

    rows: dict[type[Base], list[Base]] = field(default_factory=lambda: defaultdict(list))
    newest_attempt: dict[tuple[int, str], int] = field(default_factory=dict)
    newest_committed: dict[tuple[int, str], int] = field(default_factory=dict)
    keyed_attempts: dict[tuple[int, str, str], Attempt] = field(default_factory=dict)
    copies: dict[HeldCopy, list[Checkpoint]] = field(default_factory=lambda: defaultdict(list))
    # Read for the batch's registrations at its start (ckptstore.server.records.restarts.read_attempt_numbers); a flush
    # starts a new Held, so they are never read beside rows inserted since.
    stored_numbers: dict[tuple[int, str], tuple[int | None, int | None]] = field(default_factory=dict)
    stored_keys: dict[tuple[int, str, str], int | None] = field(default_factory=dict)


@dataclass
class WriteState:
    """A transaction's own state (see the module docstring)."""

    locked_jobs: dict[str, Job] = field(default_factory=dict)
    node_sets: dict[tuple[int, int], tuple[list[str], frozenset[str]]] = field(default_factory=dict)
    bumped_jobs: set[str] = field(default_factory=set)
    # Jobs whose records changed (None: deleted), for the other service processes (server/db/engine.py).
    changed_jobs: dict[str, Job | None] = field(default_factory=dict)
    position_rows: dict[PositionKey, PositionRow] = field(default_factory=dict)
    fresh_positions: dict[PositionKey, set[str]] = field(default_factory=dict)
    # Positions to judge at the end of a group commit (None: judge at once).
    deferred_judgments: dict[tuple[int, Position], Job] | None = None
    held: Held | None = None  # rows held back for one insert each (None: insert at once)
    events: list[dict[str, Any]] = field(default_factory=list)

    def forget_reads(self) -> None:
        """A savepoint rolled back: what it locked, read or bumped may be undone, so read it all again."""
        self.locked_jobs.clear()
        self.node_sets.clear()
        self.bumped_jobs.clear()
        self.position_rows.clear()
        self.fresh_positions.clear()


def state_of(session: Session) -> WriteState:
    """The state of the transaction `session` is in (made on first use)."""
    state = session.info.get(_KEY)
    if state is None:
        state = session.info[_KEY] = WriteState()
    return state
