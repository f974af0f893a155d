"""Attempts: a process start gets its number; the job's restart history."""

from __future__ import annotations

from fastapi import APIRouter

from ckptstore.schema import AttemptInfo, AttemptRequest
from server import records
from server.deps import DbDep, JobName, NodeName
from server.errors import COMMON_ERRORS

router = APIRouter(prefix="/v1/jobs/{job}", tags=["attempts"], responses=COMMON_ERRORS)


@router.post("/nodes/{node}/attempts", status_code=201, response_model=AttemptInfo)
def start_attempt(job: JobName, node: NodeName, db: DbDep, body: AttemptRequest | None = None) -> AttemptInfo:
    """Number a new start of `node` (fencing every older attempt) and record where it resumed from."""
    resumed = body.resumed_from.to_position() if body and body.resumed_from else None
    with db.write() as session:
        row = records.lock_job(session, job)
        return records.attempt_info(row, records.start_attempt(session, row, node, resumed))


@router.get("/attempts", response_model=list[AttemptInfo])
def list_attempts(job: JobName, db: DbDep, node: str | None = None) -> list[AttemptInfo]:
    with db.read() as session:
        return records.list_attempts(session, records.find_job(session, job), node=node)
