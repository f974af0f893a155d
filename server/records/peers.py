"""Peer blob servers: where each node's training process serves its local tier to the job's other nodes
(`ckptstore.client.peers`). A process registers its server at start; a registration replaces the node's
previous one (that process is gone, or about to be fenced)."""

from __future__ import annotations

import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from ckptstore.server.db.models import BlobServer, Job
from ckptstore.server.records.rules import require_node
from ckptstore.wire.schema import BlobServerInfo, BlobServerRegistration

__all__ = ["register_blob_server", "blob_servers"]


def _info(row: BlobServer) -> BlobServerInfo:
    return BlobServerInfo(node=row.node, url=row.url, token=row.token, registered_at=row.registered_at)


def register_blob_server(session: Session, job: Job, node: str, body: BlobServerRegistration) -> BlobServerInfo:
    """Record where `node`'s blob server answers now, in place of its previous one."""
    require_node(session, job, node)
    row = session.get(BlobServer, (job.id, node))
    if row is None:
        row = BlobServer(job_id=job.id, node=node)
        session.add(row)
    row.url, row.token, row.registered_at = body.url, body.token, time.time()
    return _info(row)


def blob_servers(session: Session, job: Job) -> list[BlobServerInfo]:
    """Every node's registered blob server, by node name."""
    rows = session.scalars(select(BlobServer).where(BlobServer.job_id == job.id).order_by(BlobServer.node))
    return [_info(row) for row in rows]
