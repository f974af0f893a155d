"""Per-process caches of last-good answers, valid while the job's version is unchanged.

The last-good query is the hot read path: with the cache of encoded answers a request costs one
indexed read of the job's version and no serialisation. Every commit, mark or job update bumps the
version in the same transaction, so a cached answer is never served after the records changed — in
any worker. Keys are (job, max_epoch, node): a node asks for its own part only (`?node=`), derived
from the whole answer, which a second, small cache keeps as a model (a 4,096-node job's whole
answer is 820 KB: every node of a restart storm fetching it was 3.3 GB, bench/storm.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from typing import Any, Generic, TypeVar

from ckptstore.schema import LastGood
from server import records
from server.db import Database
from server.last_good import last_good

__all__ = ["AnswerCache", "AnswerKey", "last_good_answer"]

AnswerKey = tuple[str, int | None, str | None]  # job, max_epoch, node (None: every node's part)
V = TypeVar("V")


class AnswerCache(Generic[V]):
    """LRU of (job, max_epoch, node) → (version, answer)."""

    def __init__(self, capacity: int = 16384):
        self.capacity = capacity
        self._entries: OrderedDict[AnswerKey, tuple[int, V]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: AnswerKey, version: int) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[0] != version:
                return None
            self._entries.move_to_end(key)
            return entry[1]

    def put(self, key: AnswerKey, version: int, body: V) -> None:
        with self._lock:
            current = self._entries.get(key)
            if current is not None and current[0] > version:
                return
            self._entries[key] = (version, body)
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)


async def last_good_answer(state: Any, job: str, max_epoch: int | None, node: str | None) -> bytes:
    """The encoded last-good answer (only `node`'s part when given) from the app's caches (`state`),
    or computed in a worker thread and cached."""
    try:
        version = state.versions.version(job)
    except state.db.errors:
        version = None  # answered (503) by computing it below, through the app's handlers
    cached = None if version is None else state.answers.get((job, max_epoch, node), version)
    if cached is not None:
        return cached
    version, body = await asyncio.to_thread(_compute, state.db, state.whole_answers, job, max_epoch, node)
    state.answers.put((job, max_epoch, node), version, body)
    return body


def _compute(
    db: Database, wholes: AnswerCache[LastGood], job: str, max_epoch: int | None, node: str | None
) -> tuple[int, bytes]:
    """The answer's version and JSON: one node's part is cut from the whole answer, computed once per version."""
    with db.read() as session:
        row = records.find_job(session, job)
        version, answer = row.version, wholes.get((job, max_epoch, None), row.version)
        if answer is None:
            answer = last_good(session, row, max_epoch=max_epoch)
            wholes.put((job, max_epoch, None), version, answer)
    if node is not None:
        answer = answer.model_copy(update={"nodes": {n: part for n, part in answer.nodes.items() if n == node}})
    return version, answer.model_dump_json().encode()
