"""The peer tier of a starting node: the copies another node holds for it, read through that node's blob
server — the source between its own local tier and the durable tier.

The holder is the one the service records for the node's resume position (its last-good answer lists
every copy, `peer` ones at `peer://<holder>/…`), else the first of the ring's holders whose server has
copies of the node. Holders restart with the job, so a recorded holder whose registered server does not
answer is asked for again, for `PEER_WAIT_S` at most, before the restore goes on without it (said).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from ckptstore import Store
from ckptstore.client.peers.blob_server import HELD
from ckptstore.client.peers.filesystem import peer_store
from ckptstore.client.peers.ring import holders_of
from ckptstore.client.service.rest import ServiceClient
from ckptstore.errors import CheckpointNotFoundError, StorageUnavailableError
from ckptstore.names import TIERS, Tier
from ckptstore.wire.schema import LastGood, peer_holder

__all__ = ["peer_tier", "WithPeerTier", "PEER_WAIT_S"]

log = logging.getLogger("ckptstore.client")
PEER_WAIT_S = 15.0  # how long a start waits for a recorded holder's blob server to answer
_POLL_S = 0.5


def _recorded_holders(answer: LastGood, node: str) -> list[str]:
    """The nodes the service records as holding `node`'s committed copy at the resume position."""
    where = answer.nodes.get(node)
    copies = [] if where is None else [c for c in where.copies if c.tier == "peer" and c.state == "committed"]
    return [holder for c in copies if (holder := peer_holder(c.location)) is not None]


def peer_tier(
    client: ServiceClient, job: str, node: str, *, nodes: Sequence[str], replicas: int, answer: LastGood | None
) -> Store | None:
    """The store of the first holder whose blob server answers with copies of `node` (None: no holder
    has any, or none answered within PEER_WAIT_S — said)."""
    if answer is None:
        try:
            answer = client.last_good_epoch(job, node=node)
        except CheckpointNotFoundError:
            return None  # a job not declared yet has no copies
    recorded = _recorded_holders(answer, node)
    candidates = list(dict.fromkeys([*recorded, *holders_of(node, nodes, replicas)]))
    deadline = time.monotonic() + (PEER_WAIT_S if recorded else 0.0)
    unanswered: dict[str, str] = {}
    while True:
        servers = client.blob_servers(job)
        for holder in candidates:
            server = servers.get(holder)
            if server is None or holder == node:
                continue
            store = peer_store(server.url, server.token, HELD)
            try:
                if store.manifest_keys(job, node):
                    return store
            except StorageUnavailableError as exc:
                unanswered[holder] = str(exc)
        if time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    if recorded:
        why = "; ".join(f"{h}: {unanswered.get(h, 'no copy there')}" for h in recorded)
        log.warning(
            "the peers that hold %s's copies did not answer within %.0f s (%s): not read", node, PEER_WAIT_S, why
        )
    return None


class WithPeerTier(Mapping[Tier, Store]):
    """A start's tiers, the peer tier among them once looked for: `find` runs the first time it is
    wanted — a restore whose own local copy verifies never asks for a peer."""

    def __init__(self, tiers: Mapping[Tier, Store], find: Callable[[], Store | None]):
        self._tiers, self._find = dict(tiers), find
        self._looked = False

    def _peer(self) -> Store | None:
        if not self._looked:
            self._looked = True
            found = self._find()
            if found is not None:
                self._tiers["peer"] = found
        return self._tiers.get("peer")

    def __getitem__(self, tier: Tier) -> Store:
        if tier == "peer" and self._peer() is None:
            raise KeyError(tier)
        return self._tiers[tier]

    def __iter__(self) -> Iterator[Tier]:
        self._peer()
        return iter([t for t in TIERS if t in self._tiers])

    def __len__(self) -> int:
        self._peer()
        return len(self._tiers)
