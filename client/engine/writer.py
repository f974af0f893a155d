"""Saves in the background, at most one in flight — and never waited behind when it is in trouble.

A new save waits for the one in flight only while that one is healthy and within its patience (a
few times a save's usual time, at least SAVE_PATIENCE_S): a save in flight that is retrying a
failing storage, or has run past its patience, makes the new one skip instead, counted and said,
so training never waits behind storage. `SaveCounts` keeps what a run asked for and got, for the
summary a run ends with when saves were skipped.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptstore import CheckpointRef, CopyKey, Position, Store
from ckptstore.errors import CommitConflictError, StorageUnavailableError

__all__ = ["BackgroundWriter", "InFlight", "SaveCounts", "write_retrying", "SAVE_PATIENCE_S", "SYNC_RETRY_S"]

log = logging.getLogger("ckptstore.client")
SAVE_PATIENCE_S = 2.0
SYNC_RETRY_S = 10.0  # a synchronous save holds training: it retries a failing storage this long at most
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 10.0  # a failing save's backoff between tries


@dataclass
class InFlight:
    """The save being written: where, since when, and the storage failure it is retrying, if any."""

    position: Position
    started: float = field(default_factory=time.monotonic)
    failure: str | None = None
    abandoned: bool = False  # the end of a run stopped waiting for it: it goes on in the background

    def state(self) -> str:
        age = time.monotonic() - self.started
        return (
            f"still retrying after {age:.1f} s ({self.failure})" if self.failure else f"still writing after {age:.1f} s"
        )


@dataclass
class SaveCounts:
    """Saves a run asked for, committed and skipped, and why the last skip happened."""

    requested: int = 0
    committed: int = 0
    skipped: int = 0
    last_skip: str | None = None

    def skip(self, why: str) -> None:
        self.skipped += 1
        self.last_skip = why

    def summary(self) -> str | None:
        """One line when saves were skipped (None otherwise)."""
        if not self.skipped:
            return None
        lost = "; nothing of this run can be resumed from" if not self.committed else ""
        return f"{self.committed} of {self.requested} saves committed, {self.skipped} skipped (last: {self.last_skip}){lost}"


class BackgroundWriter:
    """Runs one save at a time on a daemon thread (see the module docstring)."""

    def __init__(self, name: str = "ckptstore-writer"):
        self._name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.in_flight: InFlight | None = None
        self._seconds: deque[float] = deque(maxlen=5)  # recent healthy saves' durations

    def patience(self) -> float:
        """How long a new save waits for a healthy one in flight."""
        usual = statistics.median(self._seconds) if self._seconds else 0.0
        return max(SAVE_PATIENCE_S, 3 * usual)

    def blocker(self) -> InFlight | None:
        """None when a new save may start now (after waiting for a healthy save in flight within its
        patience), else the save in flight that it must not wait behind."""
        flight = self.in_flight
        if flight is None:
            return None
        if flight.failure is None:
            left = self.patience() - (time.monotonic() - flight.started)
            if left > 0 and self.wait(timeout=left):
                return None
        return flight if self.busy else None

    def admit(self, position: Position, counts: SaveCounts) -> bool:
        """Whether a new save at `position` may start (`blocker`); when not, it is counted as skipped and
        said — at WARNING for the first save skipped behind one in flight, then at INFO."""
        flight = self.blocker()
        if flight is None:
            return True
        why = f"the save at {flight.position} is {flight.state()}"
        first = counts.last_skip is None or not counts.last_skip.startswith(f"the save at {flight.position} ")
        counts.requested += 1
        counts.skip(why)
        log.log(logging.WARNING if first else logging.INFO, "save at %s skipped: %s", position, why)
        return False

    def submit(self, position: Position, job: Callable[[], None]) -> None:
        """Run `job` (the save at `position`) on the writer thread; the previous one must be done."""
        self.wait()
        flight = self.in_flight = InFlight(position)

        def run() -> None:
            try:
                job()
                if flight.failure is None:
                    self._seconds.append(time.monotonic() - flight.started)
            except BaseException as exc:  # kept for the caller: re-raised by wait()
                self._error = exc
            finally:
                self.in_flight = None

        self._thread = threading.Thread(target=run, name=self._name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join_current(self) -> None:
        """Until the save running now (if any) is done, from any thread; its error stays for `wait`."""
        thread = self._thread
        if thread is not None:
            thread.join()

    def wait(self, timeout: float | None = None) -> bool:
        """Until the save in flight is done (True; its error, if any, raised once), or `timeout` passed (False)."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return True


def write_retrying(
    store: Store,
    copy: CopyKey,
    arrays: Mapping[str, np.ndarray],
    *,
    step: int | None,
    metadata: dict[str, Any],
    timeout_s: float,
    flight: InFlight | None,
    on_first_failure: Callable[[StorageUnavailableError], None],
) -> CheckpointRef:
    """Write and commit `copy` to `store`, trying again after a transient failure (with backoff) until
    `timeout_s` has passed; meanwhile `flight` says what it retries, so later saves skip rather than wait,
    and `on_first_failure` hears of the first failure at once (the node's health)."""
    deadline, backoff, tries = time.monotonic() + timeout_s, RETRY_FIRST_S, 0
    while True:
        tries += 1
        try:
            return store.write(copy, arrays, step=step, metadata=metadata)
        except CommitConflictError:
            if tries == 1:
                raise
            # An earlier try committed it and only its answer was lost: the same bytes, committed.
            return CheckpointRef.of(store.location(copy), store.manifest(copy), store.tier)
        except StorageUnavailableError as exc:
            if exc.permanent or time.monotonic() + backoff > deadline:
                raise
            if tries == 1:
                on_first_failure(exc)
            if flight is not None:
                flight.failure = str(exc)
            log.info("save at %s failed (%s); trying again in %.1f s", copy.position, exc, backoff)
            time.sleep(backoff)
            backoff = min(2 * backoff, RETRY_MAX_S)
