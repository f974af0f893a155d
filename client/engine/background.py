"""Work that must not hold up training: a queue processed in order on a daemon thread, where a
transient failure keeps the item and retries it with backoff.

Invariant: an item leaves the queue only once it was handled, or failed for good (then
`on_dropped` says so); a transient failure (the service or the durable store away) keeps it at the
head, and new work or a `drain` wakes the retries at once. With `handle_run`, the run of items at the
head that `joins` admits is handled in one call (what piled up during an outage goes in one request).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["RetryingQueue"]

log = logging.getLogger("ckptstore.client")
T = TypeVar("T")


class RetryingQueue(Generic[T]):
    """Handles items one at a time, oldest first (see the module docstring)."""

    def __init__(
        self,
        name: str,
        handle: Callable[[T], object],
        *,
        transient: tuple[type[Exception], ...],
        on_dropped: Callable[[T, Exception], None],
        handle_run: Callable[[list[T]], list[Exception | None]] | None = None,
        joins: Callable[[T], bool] = lambda item: False,
        first_backoff: float = 0.5,
        max_backoff: float = 30.0,
    ):
        self._name = name
        self._handle = handle
        self._handle_run, self._joins = handle_run, joins
        self._transient = transient
        self._on_dropped = on_dropped
        self._first_backoff, self._max_backoff = first_backoff, max_backoff
        self._items: deque[T] = deque()
        self._changed = threading.Condition()
        self._rounds = 0  # handling attempts finished, successful or not
        self._blocked = False  # the last attempt failed transiently
        self.transient_failures = 0  # attempts that failed transiently, over the queue's life
        self._wake = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def put(self, item: T, *, unique: bool = False) -> None:
        """Queue `item` (not again, with `unique`, while an equal item waits or is being handled)."""
        with self._changed:
            if unique and item in self._items:
                return
            self._items.append(item)
            self._wake = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._changed.notify_all()

    @property
    def pending(self) -> int:
        return len(self._items)

    def snapshot(self) -> list[T]:
        """The items not handled yet, oldest first."""
        with self._changed:
            return list(self._items)

    @property
    def blocked(self) -> bool:
        """Whether the last attempt failed transiently (items wait for the service or the store)."""
        return self._blocked

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until the queue is empty (True), or an attempt made after this call failed transiently,
        or `timeout` passed (False). Wakes a retry that is waiting out its backoff."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            start = self._rounds
            self._wake = True
            self._changed.notify_all()
            while self._items and not (self._blocked and self._rounds > start):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._changed.wait(left)
            return not self._items

    def close(self) -> None:
        """Stop the thread once its current attempt is over (items left stay unhandled)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _run(self) -> None:
        backoff = self._first_backoff
        while True:
            with self._changed:
                while not self._items and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
                run = self._head_run()
                self._wake = False
            try:
                failures = self._handle_items(run)
            except self._transient as exc:
                with self._changed:
                    self._blocked, self._rounds = True, self._rounds + 1
                    self.transient_failures += 1
                    self._changed.notify_all()
                    log.warning(
                        "%s: %s; %d item(s) wait, retrying in %.1f s", self._name, exc, len(self._items), backoff
                    )
                    self._changed.wait_for(lambda: self._wake or self._closed, timeout=backoff)
                backoff = min(backoff * 2, self._max_backoff)
                continue
            for item, failure in zip(run, failures, strict=True):
                if failure is not None:
                    self._on_dropped(item, failure)
            with self._changed:
                for _ in run:
                    self._items.popleft()
                self._blocked, self._rounds = False, self._rounds + 1
                self._changed.notify_all()
            backoff = self._first_backoff

    def _head_run(self) -> list[T]:
        """The items handled next: the head, and the items after it while `joins` admits them all."""
        if self._handle_run is None or not self._joins(self._items[0]):
            return [self._items[0]]
        run = []
        for item in self._items:
            if not self._joins(item):
                break
            run.append(item)
        return run

    def _handle_items(self, run: list[T]) -> list[Exception | None]:
        """Handle `run`; for each item None, or the error it failed with for good. Raises when transient."""
        if self._handle_run is not None and self._joins(run[0]):
            return self._handle_run(run)
        try:
            self._handle(run[0])
        except self._transient:
            raise
        except Exception as exc:
            return [exc]
        return [None]
