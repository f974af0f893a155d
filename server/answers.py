"""A per-process cache of encoded last-good answers, valid while the job's version is unchanged.

The last-good query is the hot read path: with the cache a request costs one indexed read of the
job's version and no serialisation. Every commit, mark or job update bumps the version in the
same transaction, so a cached answer is never served after the records changed — in any worker.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["AnswerCache"]


class AnswerCache:
    """LRU of (job, max_epoch) → (version, JSON bytes)."""

    def __init__(self, capacity: int = 16384):
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, int | None], tuple[int, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int | None], version: int) -> bytes | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[0] != version:
                return None
            self._entries.move_to_end(key)
            return entry[1]

    def put(self, key: tuple[str, int | None], version: int, body: bytes) -> None:
        with self._lock:
            current = self._entries.get(key)
            if current is not None and current[0] > version:
                return
            self._entries[key] = (version, body)
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
