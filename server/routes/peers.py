"""Peer blob servers: a training process says where its blob server answers; the job's other nodes ask
(`ckptstore.server.records.peers`)."""

from __future__ import annotations

from fastapi import APIRouter

from ckptstore.server.deps import DbDep, JobName, NodeName
from ckptstore.server.errors import COMMON_ERRORS
from ckptstore.server.records import peers, rules
from ckptstore.wire.schema import BlobServerInfo, BlobServerRegistration

__all__ = ["router"]

router = APIRouter(prefix="/v1/jobs/{job}", tags=["peers"], responses=COMMON_ERRORS)


@router.put("/nodes/{node}/blob-server", response_model=BlobServerInfo)
def register_blob_server(job: JobName, node: NodeName, body: BlobServerRegistration, db: DbDep) -> BlobServerInfo:
    """Where this node's blob server answers now and the token it asks for; replaces the node's previous one."""
    with db.write() as session:
        return peers.register_blob_server(session, rules.lock_job(session, job), node, body)


@router.get("/blob-servers", response_model=list[BlobServerInfo])
def blob_servers(job: JobName, db: DbDep) -> list[BlobServerInfo]:
    """Every node's registered blob server (the newest registration of each)."""
    with db.read() as session:
        return peers.blob_servers(session, rules.find_job(session, job))
