"""Replication: copy each committed local copy to the durable tier in the background, oldest first.

Invariant: a durable copy is recorded only after it is committed on the durable tier and verified
there (shards CRC-checked as they stream, sizes and manifest checked on arrival); until then the
local copy is the restore source and is never pruned. The durable store being away keeps the
copies queued and retried with backoff; a process that restarts finds the local copies that have no
durable copy yet (`resume`) and queues them again. A queued copy that retention deletes on purpose
while it waits (outside the job's policy before the durable tier came back) is `forget`-ten: skipped
without a word and counted for the run's summary, never reported lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ckptstore import CheckpointRef, CopyKey, Store, tracing
from ckptstore.agreement import disagreement_of
from ckptstore.client.engine.background import RetryingQueue
from ckptstore.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageUnavailableError

__all__ = ["Replicator", "pending_on_storage"]

log = logging.getLogger("ckptstore.client")


class _Scan:
    """Queue item: find the local copies a previous process left unreplicated."""


def pending_on_storage(local: Store, durable: Store, job: str, node: str) -> list[CopyKey]:
    """Committed local copies of `node` whose attempt has no committed durable copy, oldest first."""
    on_durable = {i.key.on("local") for i in durable.list_checkpoints(job, node) if i.committed}
    return [i.key for i in local.list_checkpoints(job, node) if i.committed and i.key not in on_durable]


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
        on_lost: Callable[[CopyKey, Exception], None],
    ):
        self.local, self.durable, self.job, self.node = local, durable, job, node
        self._on_replicated = on_replicated
        self._on_lost = on_lost
        self._forgotten: set[CopyKey] = set()  # deleted on purpose by this process: not lost if never replicated
        self.replicated = 0  # copies made durable by this process
        self.deleted_unreplicated = 0  # copies retention deleted before they became durable
        self._queue: RetryingQueue[CopyKey | _Scan] = RetryingQueue(
            "ckptstore-replicator",
            self._handle,
            transient=(StorageUnavailableError,),
            on_dropped=self._dropped,
        )

    def submit(self, copy: CopyKey) -> None:
        """Queue a committed local copy for the durable tier."""
        self._queue.put(copy, unique=True)

    def forget(self, copy: CopyKey) -> None:
        """`copy` is being deleted on purpose (retention): if it still waits for replication, it need not."""
        if copy in self._queue.snapshot():
            self._forgotten.add(copy)

    def summary(self) -> str | None:
        """One line when the durable tier kept copies waiting during this run (None otherwise)."""
        if not self._queue.transient_failures and not self.deleted_unreplicated:
            return None
        parts = [f"{self.replicated} local copies replicated to the durable tier"]
        if self.deleted_unreplicated:
            parts.append(
                f"{self.deleted_unreplicated} deleted by retention before they were (outside the job's policy)"
            )
        if self.pending:
            parts.append(f"{self.pending} still waiting for it (replicated at the next start)")
        return "; ".join(parts)

    def resume(self) -> None:
        """Queue the local copies that have no durable copy yet (left by a process that stopped)."""
        self._queue.put(_Scan())

    @property
    def pending(self) -> int:
        return self._queue.pending

    def wait(self, timeout: float | None = None) -> bool:
        """Until every queued copy is durable (True), or the durable tier failed a try made since (False)."""
        return self._queue.drain(timeout)

    def close(self) -> None:
        self._queue.close()

    def _handle(self, item: CopyKey | _Scan) -> None:
        if isinstance(item, _Scan):
            for copy in pending_on_storage(self.local, self.durable, self.job, self.node):
                self._queue.put(copy, unique=True)
            return
        self._replicate(item)

    def _replicate(self, copy: CopyKey) -> None:
        if copy in self._forgotten:
            self._forgotten.discard(copy)
            self.deleted_unreplicated += 1
            return
        if disagreement_of(self.local.manifest(copy)) is not None:
            return  # replicas disagreed at that save: kept locally for inspection, never made durable
        durable = copy.on("durable")
        if durable in self.durable.copies(self.job, self.node, copy.position):
            try:
                self.durable.manifest(durable)
                return  # already durable (queued twice, or replicated before a restart)
            except CheckpointNotFoundError:
                pass  # an uncommitted leftover of an interrupted replication: copy_from replaces it
        with tracing.span("ckptstore.replicate", job=self.job, node=self.node, position=str(copy.position)) as span:
            ref = self.durable.copy_from(self.local, copy, verify="sizes")
            tracing.set_attributes(span, bytes=ref.bytes)
        self.replicated += 1
        self._on_replicated(ref)

    def _dropped(self, copy: CopyKey | _Scan, error: Exception) -> None:
        if isinstance(copy, CopyKey) and copy in self._forgotten:  # deleted on purpose while it was copied
            self._forgotten.discard(copy)
            self.deleted_unreplicated += 1
        elif isinstance(copy, _Scan):
            log.error("could not look for local copies to replicate: %s", error)
        elif isinstance(error, (CorruptCheckpointError, CheckpointNotFoundError)):
            log.warning("local copy %s cannot be replicated: %s", copy, error)
            self._on_lost(copy, error)
        else:
            log.error("replication of %s failed: %s", copy, error)
