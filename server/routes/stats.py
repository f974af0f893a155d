"""Save/load timings per action and node, and their summary."""

from __future__ import annotations

from fastapi import APIRouter, Response

from ckptstore.schema import StatsReport, StatsSummary
from server import records, telemetry
from server.deps import DbDep, JobName
from server.errors import COMMON_ERRORS

router = APIRouter(prefix="/v1/jobs/{job}", tags=["stats"], responses=COMMON_ERRORS)


@router.post("/stats", status_code=204)
def add_stats(job: JobName, body: StatsReport, db: DbDep) -> Response:
    with db.write() as session:
        telemetry.add_stat(session, records.find_job(session, job), body)
    return Response(status_code=204)


@router.get("/stats", response_model=StatsSummary)
def get_stats(job: JobName, db: DbDep) -> StatsSummary:
    with db.read() as session:
        return telemetry.stats_summary(session, records.find_job(session, job))
