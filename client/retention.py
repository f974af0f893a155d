"""Executing retention: delete a checkpoint on storage, then mark its record deleted.

The service plans (`GET /v1/jobs/{job}/gc-plan`: never the last good epoch, the resume position
or anything newer); nodes and the command line execute. The manifest goes first on storage
(`Store.delete`), so a crash mid-way leaves an uncommitted leftover, never a committed checkpoint
with missing shards; the record is marked only once the bytes are gone.
"""

from __future__ import annotations

from ckptstore import Position, Store
from ckptstore.errors import CheckpointNotFoundError
from ckptstore.names import Tier
from client.service import ServiceClient

__all__ = ["delete_checkpoint"]


def delete_checkpoint(
    store: Store,
    client: ServiceClient | None,
    job: str,
    node: str,
    position: Position,
    *,
    attempt: str | None,
    reason: str,
    tier: Tier = "durable",
) -> None:
    """Delete one attempt (or every attempt) of a node's position from `store` (the copy on `tier`)
    and mark that copy's record deleted.

    Already gone on storage, or never recorded (a storage-only leftover), is fine; other service
    errors propagate.
    """
    try:
        store.delete(job, node, position.epoch, batch=position.batch, attempt=attempt)
    except CheckpointNotFoundError:
        pass
    if client is None:
        return
    try:
        client.mark(job, node, position, "deleted", attempt=attempt, tier=tier, reason=reason)
    except CheckpointNotFoundError:
        pass
