"""Group commit: concurrent writes arriving at one service process share one transaction (one fsync).

Each request hands its write (a function of the session) to `WriteBatcher.run` and awaits it. One
writer thread takes whatever has queued up — up to MAX_BATCH writes — locks all their jobs in one
statement, in name order (so two replicas never lock two jobs in opposite orders), runs the writes
in that order, judges every touched position once, and commits once. Every write still gets its
own answer: a refusal (`ApiError`, a conflicting insert) is raised in its own request and changes
nothing — the batch is then run again with each write in its own savepoint, so the refusal rolls
back only itself (savepoints cost more than the writes, so only a batch that needs them pays for
them). A failed commit (the database away) is raised in every request of the batch, none of which
is then recorded. The judge runs once per touched position per batch rather than once per write,
which is what keeps a 4,096-node job's commits of one position linear.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NamedTuple, TypeVar

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ckptstore.server.db.engine import Database
from ckptstore.server.db.transaction import state_of
from ckptstore.server.errors import ApiError
from ckptstore.server.records import held
from ckptstore.server.records.last_good import defer_judgments, run_deferred_judgments
from ckptstore.server.records.restarts import read_attempt_numbers
from ckptstore.server.records.rules import lock_jobs

__all__ = ["WriteBatcher", "MAX_BATCH"]

T = TypeVar("T")
MAX_BATCH = 256


class WriteBatcher:
    """One writer thread per service process (see module docstring)."""

    def __init__(self, db: Database):
        self.db = db
        self._queue: queue.SimpleQueue[tuple[str, _Write] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ckptstore-group-commit", daemon=True)
        self._thread.start()

    async def run(
        self,
        job: str,
        write: Callable[[Session], T],
        *,
        defers_inserts: bool = False,
        attempts_of: tuple[str, str | None] | None = None,
    ) -> T:
        """Run `write` in the next group transaction; its result once that transaction committed (the
        request waits on the event loop: no worker thread is held per waiting request)."""
        return await asyncio.wrap_future(
            self.submit(job, write, defers_inserts=defers_inserts, attempts_of=attempts_of)
        )

    def submit(
        self,
        job: str,
        write: Callable[[Session], T],
        *,
        defers_inserts: bool = False,
        attempts_of: tuple[str, str | None] | None = None,
    ) -> Future[T]:
        """Queue `write` for the next group transaction; writes of one job run in the order submitted.
        A write that `defers_inserts` may hold its new rows until later in the batch (server/records/held.py);
        one that reads the attempt numbers `attempts_of` a node (and an Idempotency-Key) has them read
        with the batch's others (`restarts.read_attempt_numbers`)."""
        future: Future[T] = Future()
        self._queue.put((job, _Write(write, future, defers_inserts, attempts_of)))
        return future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < MAX_BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                batch.append(item)
            self._commit(batch)

    def _commit(self, batch: list[tuple[str, _Write]]) -> None:
        ordered = sorted(batch, key=lambda item: item[0])
        try:
            try:
                outcomes = self._transaction(ordered, savepoints=False)
            except _Refused:  # a write was refused: again, each write in its own savepoint
                outcomes = self._transaction(ordered, savepoints=True)
        except BaseException as exc:  # nothing of this batch was recorded: every request says so
            for _, item in batch:
                item.future.set_exception(exc)
            return
        for future, result, error in outcomes:
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

    def _transaction(
        self, ordered: list[tuple[str, _Write]], *, savepoints: bool
    ) -> list[tuple[Future[Any], Any, BaseException | None]]:
        """Run the writes in one transaction and commit it. Without `savepoints` (the common case: a
        savepoint per write costs more than the write) the first refusal rolls everything back and
        raises _Refused, and new rows may be held until they are read (server/records/held.py); with them,
        a refusal rolls back only its own write."""
        outcomes: list[tuple[Future[Any], Any, BaseException | None]] = []
        with self.db.write() as session:
            state = state_of(session)
            defer_judgments(session)
            lock_jobs(session, sorted({job for job, _ in ordered}))
            if not savepoints:
                held.start_holding(session)
                locked = state.locked_jobs
                wanted = [
                    (locked[job], *item.attempts_of) for job, item in ordered if item.attempts_of and job in locked
                ]
                read_attempt_numbers(session, wanted)
            for _, (write, future, defers_inserts, _) in ordered:
                if not savepoints:
                    if not defers_inserts:
                        held.flush(session)
                    try:
                        outcomes.append((future, write(session), None))
                    except (ApiError, IntegrityError) as exc:
                        raise _Refused from exc
                    continue
                emitted = len(state.events)
                try:
                    with session.begin_nested():
                        outcomes.append((future, write(session), None))
                except (ApiError, IntegrityError) as exc:
                    del state.events[emitted:]  # what the refused write emitted never happened
                    # Row locks taken in the rolled-back savepoint are released: lock again later;
                    # what it read or bumped may have been its own rolled-back writes: again.
                    state.forget_reads()
                    outcomes.append((future, None, exc))
            held.flush(session)
            run_deferred_judgments(session)
        return outcomes


class _Write(NamedTuple):
    write: Callable[[Session], Any]
    future: Future[Any]
    defers_inserts: bool
    attempts_of: tuple[str, str | None] | None


class _Refused(Exception):
    """A write of a batch run without savepoints was refused: the batch must run again with them."""
