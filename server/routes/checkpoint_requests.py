"""Checkpoint requests: ask every running node of a job to save at its next step, and see which nodes
have since committed (`ckptstore.server.records.checkpoint_requests`)."""

from __future__ import annotations

from fastapi import APIRouter, Response

from ckptstore.server.deps import DbDep, JobName
from ckptstore.server.errors import COMMON_ERRORS, ApiError
from ckptstore.server.records import checkpoint_requests, rules
from ckptstore.wire.schema import CheckpointRequestBody, CheckpointRequestInfo

__all__ = ["router"]

router = APIRouter(prefix="/v1/jobs/{job}", tags=["checkpoint requests"], responses=COMMON_ERRORS)


@router.post(
    "/checkpoint-requests",
    response_model=CheckpointRequestInfo,
    status_code=201,
    responses={200: {"model": CheckpointRequestInfo, "description": "an earlier request, still pending (coalesced)"}},
)
def request_checkpoint(
    job: JobName, body: CheckpointRequestBody, db: DbDep, response: Response
) -> CheckpointRequestInfo:
    """Every running node of the job saves at its next step (an ordinary mid-epoch position). A request
    made while an earlier one is still pending answers that one (200, `coalesced`); event
    `checkpoint.requested`."""
    with db.write() as session:
        pending = checkpoint_requests.request_checkpoint(session, rules.lock_job(session, job), body.reason)
    if pending is not None:
        response.status_code = 200
        return pending
    with db.read() as session:
        made = checkpoint_requests.newest_request(session, rules.find_job(session, job))
    if made is None:  # the job was forgotten between the two transactions
        raise ApiError.not_found(f"job {job!r} not found")
    return made


@router.get("/checkpoint-requests/latest", response_model=CheckpointRequestInfo)
def latest_request(job: JobName, db: DbDep) -> CheckpointRequestInfo:
    """The job's newest checkpoint request and the nodes that have not committed since (404: none yet)."""
    with db.read() as session:
        newest = checkpoint_requests.newest_request(session, rules.find_job(session, job))
    if newest is None:
        raise ApiError.not_found(f"job {job!r} has no checkpoint request")
    return newest
