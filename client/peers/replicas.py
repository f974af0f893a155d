"""A node's part in peer replicas (`peer_replicas=N`): its blob server, registered with the service; the
puller that keeps the copies of the nodes it holds for; the peer tier its start reads; and, at the end
of a run or before a planned stop, the wait until its newest copy is kept on a peer."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence

from ckptstore import CopyKey, Store
from ckptstore.client.peers.blob_server import HELD, HELD_DIR, BlobServer
from ckptstore.client.peers.filesystem import peer_store
from ckptstore.client.peers.replication import PeerReplicator, copy_order
from ckptstore.client.peers.ring import held_by, holders_of
from ckptstore.client.peers.tier import peer_tier
from ckptstore.client.service.rest import ServiceClient
from ckptstore.client.service.wire import Commit
from ckptstore.errors import ServiceUnavailableError, StorageUnavailableError
from ckptstore.wire.schema import LastGood, MarkCause, MarkState

__all__ = ["PeerReplicas", "HELD_WAIT_S"]

log = logging.getLogger("ckptstore.client")
HELD_WAIT_S = 30.0  # how long `wait_until_held` waits for a peer to record the newest copy


class PeerReplicas:
    """This node's peer replicas over its local tier `local` (see the module docstring). The blob server
    binds CKPTSTORE_PEER_HOST (default every interface) and CKPTSTORE_PEER_PORT (default any free port),
    and is reached at CKPTSTORE_PEER_ADVERTISE (default the address this host's name resolves to)."""

    def __init__(
        self,
        *,
        local: Store,
        client: ServiceClient,
        job: str,
        node: str,
        replicas: int,
        keep: int,
        commit: Callable[[Commit], None],
        mark: Callable[[CopyKey, MarkState, MarkCause, str], None],
    ):
        self.local, self.client, self.job, self.node, self.replicas = local, client, job, node, replicas
        self._keep, self._commit, self._mark = keep, commit, mark
        self.held = Store(os.path.join(local.url, HELD_DIR), tier="peer")
        self.server: BlobServer | None = None
        self._replicator: PeerReplicator | None = None
        self._waited: CopyKey | None = None  # the newest copy `wait_until_held` last waited for
        self._holders: list[str] = []  # the nodes that keep this node's copies (`follow`)

    def serve(self) -> None:
        """Start the blob server and say where it answers (a start does this before it restores: the nodes
        restoring from this one's disk ask for it)."""
        if self.server is None:
            host = os.environ.get("CKPTSTORE_PEER_HOST") or "0.0.0.0"
            port = int(os.environ.get("CKPTSTORE_PEER_PORT") or 0)
            advertise = os.environ.get("CKPTSTORE_PEER_ADVERTISE")
            try:
                self.server = BlobServer(self.local.url, self.job, host=host, port=port, advertise=advertise)
            except OSError as exc:
                log.warning("no blob server on %s:%s (%s): this node's copies are not kept on peers", host, port, exc)
                return
        try:
            self.client.register_blob_server(self.job, self.node, self.server.url, self.server.token)
        except ServiceUnavailableError as exc:
            log.warning("service unreachable (%s): this node's copies are not kept on peers for now", exc)

    def tier(self, nodes: Sequence[str], answer: LastGood | None) -> Store | None:
        """The peer tier this start reads (`ckptstore.client.peers.tier`)."""
        try:
            return peer_tier(self.client, self.job, self.node, nodes=nodes, replicas=self.replicas, answer=answer)
        except ServiceUnavailableError as exc:
            log.warning("service unreachable (%s): no peer is asked for this node's copies", exc)
            return None

    def follow(self, nodes: Sequence[str]) -> None:
        """Start keeping the copies of the nodes this one holds for, among the job's `nodes`."""
        self._holders = holders_of(self.node, nodes, self.replicas)
        if not self._holders:
            log.warning(
                "peer_replicas=%d, but job %s has no other node to keep %s's copies: they stay on its own disk",
                self.replicas,
                self.job,
                self.node,
            )
        sources = held_by(self.node, nodes, self.replicas)
        if self._replicator is not None or not sources:
            return
        self._replicator = PeerReplicator(
            held=self.held,
            client=self.client,
            job=self.job,
            node=self.node,
            sources=sources,
            keep=self._keep,
            commit=self._commit,
            mark=self._mark,
            own_url=None if self.server is None else self.server.url,
        )
        self._replicator.start()

    def wait_until_held(self, timeout: float = HELD_WAIT_S) -> bool:
        """Until the service records a peer copy of this node's newest local copy (True), or `timeout`
        passed (False, said): a run that ends, or stops on purpose, leaves its last copy on a peer."""
        keys = self.local.manifest_keys(self.job, self.node)
        if not keys:
            return True
        newest = max(keys, key=copy_order)
        if newest == self._waited:
            return True  # waited for already (found held, or said it was not)
        self._waited = newest
        deadline = time.monotonic() + timeout
        polls = 0
        while True:
            try:
                records = self.client.list_checkpoints(self.job, node=self.node, epoch=newest.position.epoch)
                running = True if polls % 10 else self._holder_running()  # asked every 2 s
            except ServiceUnavailableError:
                records, running = [], True
            if any(r.key == newest.on("peer") and r.state == "committed" for r in records):
                return True
            if not running or time.monotonic() >= deadline:
                why = (
                    "no node that keeps this node's copies is running"
                    if not running
                    else f"none within {timeout:.0f} s"
                )
                log.warning("no peer recorded a replica of %s (%s): it is on this node's disk only", newest, why)
                return False
            polls += 1
            time.sleep(0.2)

    def _holder_running(self) -> bool:
        """Whether the blob server of a node that keeps this node's copies answers (one that has stopped
        pulls nothing more)."""
        servers = self.client.blob_servers(self.job)
        for holder in self._holders:
            server = servers.get(holder)
            if server is None:
                continue
            try:
                peer_store(server.url, server.token, HELD).list_nodes(self.job)
            except StorageUnavailableError:
                continue
            return True
        return False

    def summary(self) -> str | None:
        return None if self._replicator is None else self._replicator.summary()

    def close(self) -> None:
        if self._replicator is not None:
            self._replicator.close()
        if self.server is not None:
            self.server.close()
