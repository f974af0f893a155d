"""Executing retention: delete copies on storage, then mark their records deleted.

The service plans (`GET /v1/jobs/{job}/gc-plan`: never the last good epoch, the resume position
or anything newer); nodes and the command line execute. The manifest goes first on storage
(`Store.delete_copy`), so a crash mid-way leaves an uncommitted leftover, never a committed
checkpoint with missing shards; the record is marked only once the bytes are gone.

A training node runs its part of the plan on a thread of its own (`Retention`), after its durable
commits: it asks for the plan once the reports queue has sent what came before (so the plan knows
the newest commits), deletes, and queues the marks as reports. Nothing in the reports queue calls
back into it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from ckptstore import CopyKey, Store
from ckptstore.client.engine.background import RetryingQueue
from ckptstore.client.engine.reports import Reports
from ckptstore.client.service.rest import ServiceClient
from ckptstore.errors import CheckpointNotFoundError, ServiceUnavailableError
from ckptstore.names import Tier

__all__ = ["delete_copy", "local_tier_surplus", "Retention", "DELETED_BECAUSE"]

# Why retention deleted a copy, as its record says (`cause` says it was retention).
DELETED_BECAUSE = {
    "retention": "outside the job's retention policy",
    "superseded": "a newer attempt committed the same position",
    "uncommitted": "never committed",
}

log = logging.getLogger("ckptstore.client")


def delete_copy(store: Store, copy: CopyKey) -> bool:
    """Delete `copy` from `store`; False when it was already gone (retention may run twice)."""
    try:
        store.delete_copy(copy)
    except CheckpointNotFoundError:
        return False
    return True


def local_tier_surplus(local: Store, durable: Store, job: str, node: str, keep: int) -> list[CopyKey]:
    """The node's copies on its local tier beyond the newest `keep` positions that are on the durable
    tier as well: what local tier retention deletes."""
    copies = [i.key for i in local.list_checkpoints(job, node) if i.committed]
    kept = set(sorted({k.position for k in copies})[-keep:])
    durable_copies = {i.key for i in durable.list_checkpoints(job, node) if i.committed}
    return [copy for copy in copies if copy.position not in kept and copy.on("durable") in durable_copies]


class _Pass:
    """Queue item: one pass over the retention plan."""


class Retention:
    """This node's part of its job's retention plan, executed on its tiers by a thread of its own."""

    def __init__(
        self,
        client: ServiceClient,
        job: str,
        node: str,
        tiers: Mapping[Tier, Store],
        reports: Reports,
        *,
        on_delete: Callable[[CopyKey], None] = lambda copy: None,
    ):
        """`on_delete` is told of each copy before it is deleted (the replicator forgets it)."""
        self.client, self.job, self.node, self.tiers, self.reports = client, job, node, tiers, reports
        self._on_delete = on_delete
        self._waiting = threading.Lock()  # held while a requested pass has not started: requests join it
        self._queue: RetryingQueue[_Pass] = RetryingQueue(
            "ckptstore-retention",
            self._run,
            transient=(ServiceUnavailableError,),
            on_dropped=lambda item, error: log.warning("retention step failed: %s", error),
        )

    def request(self) -> None:
        """Run a pass soon (a durable copy was committed); requests before it starts are one pass."""
        if self._waiting.acquire(blocking=False):
            self._queue.put(_Pass())

    def wait(self, timeout: float | None = None) -> bool:
        """Until the requested passes ran (True), or the service failed a try made since (False)."""
        return self._queue.drain(timeout)

    def close(self) -> None:
        self._queue.close()

    def _run(self, _: _Pass) -> None:
        if self._waiting.locked():
            self._waiting.release()  # a request from now on asks for another pass: this one may miss it
        if not self.reports.drain():
            raise ServiceUnavailableError("the service is away: its retention plan waits")
        for deletion in self.client.retention_plan(self.job).deletions:
            store = self.tiers.get(deletion.tier)
            if deletion.node != self.node or store is None:
                continue
            copy = deletion.key(self.job)
            self._on_delete(copy)
            delete_copy(store, copy)
            self.reports.mark(copy, "deleted", cause="retention", reason=DELETED_BECAUSE[deletion.reason])
