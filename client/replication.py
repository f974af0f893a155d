"""Replication: copy each committed local copy to the durable tier in the background, oldest first.

Invariant: a durable copy is recorded only after it is committed on the durable tier and verified
there (shards CRC-checked as they stream, sizes and manifest checked on arrival); until then the
local copy is the restore source and is never pruned. The durable store being away keeps the
copies queued and retried with backoff; a process that restarts finds the local copies that have no
durable copy yet (`resume`) and queues them again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ckptstore import CheckpointRef, Position, Store, tracing
from ckptstore.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageUnavailableError
from client.background import RetryingQueue

__all__ = ["LocalCopy", "Replicator", "pending_on_storage"]

log = logging.getLogger("ckptstore.client")


@dataclass(frozen=True)
class LocalCopy:
    position: Position
    attempt: str


class _Scan:
    """Queue item: find the local copies a previous process left unreplicated."""


def pending_on_storage(local: Store, durable: Store, job: str, node: str) -> list[LocalCopy]:
    """Committed local copies of `node` whose attempt has no committed durable copy, oldest first."""
    on_durable = {(i.position, i.attempt) for i in durable.list_checkpoints(job, node) if i.committed}
    return [
        LocalCopy(i.position, i.attempt)
        for i in local.list_checkpoints(job, node)
        if i.committed and (i.position, i.attempt) not in on_durable
    ]


class Replicator:
    """Copies `node`'s local copies to the durable tier; `on_replicated` gets each durable copy's ref,
    `on_lost` each local copy that could not be replicated because it is corrupt or gone."""

    def __init__(
        self,
        local: Store,
        durable: Store,
        job: str,
        node: str,
        *,
        on_replicated: Callable[[CheckpointRef], None],
        on_lost: Callable[[LocalCopy, Exception], None],
    ):
        self.local, self.durable, self.job, self.node = local, durable, job, node
        self._on_replicated = on_replicated
        self._on_lost = on_lost
        self._queue: RetryingQueue[LocalCopy | _Scan] = RetryingQueue(
            "ckptstore-replicator",
            self._handle,
            transient=(StorageUnavailableError,),
            on_dropped=self._dropped,
        )

    def submit(self, position: Position, attempt: str) -> None:
        self._queue.put(LocalCopy(position, attempt), unique=True)

    def resume(self) -> None:
        """Queue the local copies that have no durable copy yet (left by a process that stopped)."""
        self._queue.put(_Scan())

    @property
    def pending(self) -> int:
        return self._queue.pending

    @property
    def blocked(self) -> bool:
        """Whether the durable tier refused the last try (copies wait for it)."""
        return self._queue.blocked

    def wait(self, timeout: float | None = None) -> bool:
        """Until every queued copy is durable (True), or the durable tier failed a try made since (False)."""
        return self._queue.drain(timeout)

    def close(self) -> None:
        self._queue.close()

    def _handle(self, item: LocalCopy | _Scan) -> None:
        if isinstance(item, _Scan):
            for copy in pending_on_storage(self.local, self.durable, self.job, self.node):
                self._queue.put(copy, unique=True)
            return
        self._replicate(item)

    def _replicate(self, copy: LocalCopy) -> None:
        position = copy.position
        if copy.attempt in self.durable.attempts(self.job, self.node, position.epoch, batch=position.batch):
            try:
                self.durable.manifest(self.job, self.node, position.epoch, batch=position.batch, attempt=copy.attempt)
                return  # already durable (queued twice, or replicated before a restart)
            except CheckpointNotFoundError:
                pass  # an uncommitted leftover of an interrupted replication: copy_from replaces it
        with tracing.span("ckptstore.replicate", job=self.job, node=self.node, position=str(position)) as span:
            ref = self.durable.copy_from(
                self.local,
                self.job,
                self.node,
                copy.position.epoch,
                batch=copy.position.batch,
                attempt=copy.attempt,
                verify="sizes",
            )
            tracing.set_attributes(span, bytes=ref.bytes)
        self._on_replicated(ref)

    def _dropped(self, copy: LocalCopy | _Scan, error: Exception) -> None:
        if isinstance(copy, _Scan):
            log.error("could not look for local copies to replicate: %s", error)
        elif isinstance(error, (CorruptCheckpointError, CheckpointNotFoundError)):
            log.warning("local copy %s attempt %s cannot be replicated: %s", copy.position, copy.attempt, error)
            self._on_lost(copy, error)
        else:
            log.error("replication of %s attempt %s failed: %s", copy.position, copy.attempt, error)
