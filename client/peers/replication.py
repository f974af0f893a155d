"""Peer replication, the holder's side: keep the newest copies of the nodes this node holds for (`ring`),
pulled from their blob servers by a thread of this process.

Invariant: a peer copy is committed here (in a save's order) only after every blob arrived CRC-checked
and its sizes and manifest read back, and recorded with the service only then, as a `peer` copy at
`peer://<this node>/…`. Only the newest copy of each node is pulled: one that another copy overtook
while this node was busy is skipped (counted, said at the end) — replication never queues behind
training. Memory stays bounded: blobs stream through in 8 MiB blocks. The newest `keep` copies of each
node are kept; older ones are deleted and marked deleted on the service.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from urllib.parse import urlsplit

from ckptstore import CopyKey, Store
from ckptstore.client.engine.retention import delete_copy
from ckptstore.client.peers.blob_server import OWN
from ckptstore.client.peers.filesystem import peer_store
from ckptstore.client.service.rest import ServiceClient
from ckptstore.client.service.wire import Commit
from ckptstore.errors import CheckpointNotFoundError, CkptStoreError, CorruptCheckpointError, StorageUnavailableError
from ckptstore.format.layout import checkpoint_location
from ckptstore.names import attempt_sort_key
from ckptstore.wire.schema import PEER_SCHEME, BlobServerInfo, MarkCause, MarkState

__all__ = ["PeerReplicator", "PULL_INTERVAL_S", "copy_order"]

log = logging.getLogger("ckptstore.client")
PULL_INTERVAL_S = 0.5  # how often a holder looks for a newer copy of the nodes it holds for


def copy_order(key: CopyKey) -> tuple[object, ...]:
    """Sorts a node's copies oldest to newest: by attempt, then position — a newer attempt's copy
    supersedes every copy of an older one (its timeline went on from an earlier position)."""
    return (attempt_sort_key(key.attempt), key.position)


class PeerReplicator:
    """Pulls the copies of `sources` (nodes this node holds for) into `held`; `commit` records each peer
    copy, `mark` each one deleted or found damaged (the node's reports queue); `own_url`: this node's blob
    server, to say when a source runs on the same machine (a holder there protects nothing)."""

    def __init__(
        self,
        *,
        held: Store,
        client: ServiceClient,
        job: str,
        node: str,
        sources: list[str],
        keep: int,
        commit: Callable[[Commit], None],
        mark: Callable[[CopyKey, MarkState, MarkCause, str], None],
        own_url: str | None = None,
    ):
        self.own_host = None if own_url is None else urlsplit(own_url).hostname
        self.held, self.client, self.job, self.node, self.sources, self.keep = held, client, job, node, sources, keep
        self._commit, self._mark = commit, mark
        self.pulled = 0  # copies pulled by this process
        self.overtaken = 0  # copies skipped because a newer one of the same node came first
        self._servers: dict[str, BlobServerInfo] = {}
        self._stores: dict[str, Store] = {}
        self._failed: set[tuple[str, CopyKey]] = set()  # (server url, copy) found damaged there: not pulled again
        self._said_same_host: set[str] = set()  # sources found on this node's machine, said once
        self._unreachable: set[str] = set()  # sources whose server did not answer, said once until it does
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptstore-peer-replicator", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def summary(self) -> str | None:
        """One line when copies were pulled or overtaken during this run (None otherwise)."""
        if not self.pulled and not self.overtaken:
            return None
        line = f"{self.pulled} copies of {', '.join(self.sources)} kept on this node's disk as peer replicas"
        if self.overtaken:
            line += f"; {self.overtaken} skipped: a newer copy came before they were pulled"
        return line

    def _run(self) -> None:
        while not self._stop.wait(PULL_INTERVAL_S):
            for source in self.sources:
                try:
                    self._pull_newest(source)
                except (StorageUnavailableError, CkptStoreError, OSError) as exc:
                    self._away(source, exc)

    def _away(self, source: str, error: Exception) -> None:
        self._stores.pop(source, None)  # asked again of the service: the node may have restarted elsewhere
        if source not in self._unreachable:
            self._unreachable.add(source)
            log.warning("peer replicas of %s wait: its blob server does not answer (%s)", source, error)

    def _source(self, source: str) -> Store | None:
        store = self._stores.get(source)
        if store is None:
            self._servers = self.client.blob_servers(self.job)
            server = self._servers.get(source)
            if server is None:
                return None
            if urlsplit(server.url).hostname == self.own_host and source not in self._said_same_host:
                self._said_same_host.add(source)
                log.warning(
                    "%s keeps the copies of %s, which runs on the same machine (%s): losing that machine loses "
                    "both — order the job's nodes so that the next ones run elsewhere (docs/operations.md)",
                    self.node,
                    source,
                    self.own_host,
                )
            store = self._stores[source] = peer_store(server.url, server.token, OWN)
        return store

    def _pull_newest(self, source: str) -> None:
        store = self._source(source)
        if store is None:
            return
        offered = sorted(store.manifest_keys(self.job, source), key=copy_order)
        self._unreachable.discard(source)
        held = sorted(self.held.manifest_keys(self.job, source), key=copy_order)
        newest_held = copy_order(held[-1]) if held else None
        fresh = [k for k in offered if newest_held is None or copy_order(k) > newest_held]
        if not fresh or (store.url, fresh[-1]) in self._failed:
            return
        newest = fresh[-1]
        try:
            ref = self.held.copy_from(store, newest, verify="sizes")
        except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
            self._failed.add((store.url, newest))  # the source's own restore will find it damaged too
            log.warning("peer replica of %s not taken: %s", newest, exc)
            return
        self.pulled += 1
        self.overtaken += len(fresh) - 1 if held else 0
        where = checkpoint_location(PEER_SCHEME + self.node, self.job, source, newest.position, newest.attempt)
        self._commit(Commit.of(replace(ref, location=where)))
        for old in held[: max(0, len(held) + 1 - self.keep)]:
            delete_copy(self.held, old)
            self._mark(old.on("peer"), "deleted", "retention", "peer replica retention")
