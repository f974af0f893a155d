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

from ckptstore.server.db.engine import Database
from ckptstore.server.records import rules
from ckptstore.server.records.last_good import last_good
from ckptstore.wire.schema import LastGood

__all__ = ["AnswerCache", "AnswerKey", "last_good_answer", "last_good_part"]

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
    or cut from the whole answer, or computed in a worker thread; cached."""
    version = _version(state, job)
    cached = None if version is None else state.answers.get((job, max_epoch, node), version)
    if cached is not None:
        return cached
    version, answer = await last_good_part(state, job, max_epoch, node, version=version)
    body = answer.model_dump_json().encode()
    state.answers.put((job, max_epoch, node), version, body)
    return body


async def last_good_part(
    state: Any, job: str, max_epoch: int | None, node: str | None, *, version: int | None = None
) -> tuple[int, LastGood]:
    """The last-good answer's version and model, only `node`'s part when given: cut from the whole
    answer while the job's version is the cached one's (a restart storm's nodes each ask for their
    own part: no database round trip), else computed in a worker thread."""
    known = version if version is not None else _version(state, job)
    cached = None if known is None else state.whole_answers.get((job, max_epoch, None), known)
    if known is not None and cached is not None:
        found: tuple[int, LastGood] = (known, cached)
    else:
        found = await asyncio.to_thread(_compute, state.db, state.whole_answers, job, max_epoch)
    return found[0], found[1] if node is None else _part(found[1], node)


def _version(state: Any, job: str) -> int | None:
    try:
        return state.versions.version(job)
    except state.db.errors:
        return None  # answered (503) by computing it, through the app's handlers


def _part(answer: LastGood, node: str) -> LastGood:
    return answer.model_copy(update={"nodes": {node: answer.nodes[node]} if node in answer.nodes else {}})


def _compute(db: Database, wholes: AnswerCache[LastGood], job: str, max_epoch: int | None) -> tuple[int, LastGood]:
    """The whole answer and its version, computed once per version."""
    with db.read() as session:
        row = rules.find_job(session, job)
        version, answer = row.version, wholes.get((job, max_epoch, None), row.version)
        if answer is None:
            answer = last_good(session, row, max_epoch=max_epoch)
            wholes.put((job, max_epoch, None), version, answer)
    return version, answer
