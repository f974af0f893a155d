"""The retention plan: what the job's policy allows deleting now (clients and the CLI execute it)."""

from __future__ import annotations

import time

from fastapi import APIRouter

from ckptstore.server.deps import DbDep, JobName
from ckptstore.server.errors import COMMON_ERRORS
from ckptstore.server.records import rules
from ckptstore.wire.schema import RetentionPlan

__all__ = ["router"]

router = APIRouter(prefix="/v1/jobs/{job}", tags=["retention"], responses=COMMON_ERRORS)


@router.get("/gc-plan", response_model=RetentionPlan)
def retention_plan(job: JobName, db: DbDep) -> RetentionPlan:
    """Never the last good epoch, the resume position or anything newer; whole positions across nodes."""
    with db.read() as session:
        return rules.retention_plan(session, rules.find_job(session, job), now=time.time())
