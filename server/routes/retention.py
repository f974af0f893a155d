"""The retention plan: what the job's policy allows deleting now (clients and the CLI execute it)."""

from __future__ import annotations

import time

from fastapi import APIRouter

from ckptstore.schema import RetentionPlan
from server import records
from server.deps import DbDep, JobName
from server.errors import COMMON_ERRORS

__all__ = ["router"]

router = APIRouter(prefix="/v1/jobs/{job}", tags=["retention"], responses=COMMON_ERRORS)


@router.get("/gc-plan", response_model=RetentionPlan)
def retention_plan(job: JobName, db: DbDep) -> RetentionPlan:
    """Never the last good epoch, the resume position or anything newer; whole positions across nodes."""
    with db.read() as session:
        return records.retention_plan(session, records.find_job(session, job), now=time.time())
