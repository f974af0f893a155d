"""Which stores a node's tiers are: the durable tier — opened with this process's storage credentials,
or through URLs the service signs (`ckptstore.client.service.presigned`) — and the local tier, where there is one."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ckptstore import Store
from ckptstore.client.engine.identity import NodeIdentity
from ckptstore.client.engine.options import CheckpointOptions
from ckptstore.client.service.presigned import presigned_storage
from ckptstore.client.service.rest import ServiceClient
from ckptstore.client.service.signed_urls import SignedUrlSource
from ckptstore.format.layout import normalize_root

__all__ = ["durable_tier", "local_tier"]

log = logging.getLogger("ckptstore.client")


def durable_tier(
    options: CheckpointOptions, client: ServiceClient | None, node: str, attempt: Callable[[], str | None]
) -> Store:
    """The job's durable tier; with `options.presigned`, reached through URLs the service signs for `node`,
    writes under its current `attempt()` (an offline attempt, taken while the service was away, can sign
    nothing: its writes fail as an outage does until the service is back)."""
    if not options.presigned or client is None:
        return Store(options.storage, storage_options=options.storage_options, codec=options.codec)

    def registered() -> str | None:
        current = attempt()
        return None if current is None or "-" in current else current

    urls = SignedUrlSource(lambda wanted: client.presigned_urls(options.job, node, wanted), registered)
    storage = presigned_storage(normalize_root(options.storage), urls, job=options.job, node=node)
    return Store(options.storage, codec=options.codec, storage=storage)


def local_tier(options: CheckpointOptions, identity: NodeIdentity) -> Store | None:
    """The node's local tier, if it has one: only a process that writes, and not under a multi-worker
    TF_CONFIG (every worker restores the chief's checkpoints)."""
    if options.local_storage is None or not identity.is_chief:
        return None
    if identity.shared_restore:
        log.warning(
            "local_storage is not used under a multi-worker TF_CONFIG: every worker restores the chief's "
            "checkpoints, so they go straight to the durable tier"
        )
        return None
    return Store(options.local_storage, tier="local")
