"""Save/load timings per action and node, their summary, and the job's operations advice."""

from __future__ import annotations

from fastapi import APIRouter, Response
from sqlalchemy.orm import Session

from ckptstore.server.deps import DbDep, JobName, WritesDep
from ckptstore.server.errors import COMMON_ERRORS
from ckptstore.server.records import advice, rules, telemetry
from ckptstore.wire.schema import Advice, StatsReport, StatsSummary

__all__ = ["router"]

router = APIRouter(prefix="/v1/jobs/{job}", tags=["stats"], responses=COMMON_ERRORS)


@router.post("/stats", status_code=204)
async def add_stats(job: JobName, body: StatsReport, writes: WritesDep) -> Response:
    def add(session: Session) -> None:
        row = rules.find_job(session, job)
        rules.require_node(session, row, body.node)
        telemetry.add_stat(session, row, body)

    await writes.run(job, add)
    return Response(status_code=204)


@router.get("/stats", response_model=StatsSummary)
def get_stats(job: JobName, db: DbDep) -> StatsSummary:
    with db.read() as session:
        return telemetry.stats_summary(session, rules.find_job(session, job))


@router.get("/advice", response_model=Advice)
def get_advice(job: JobName, db: DbDep) -> Advice:
    """Goodput — the share of the job's wall time not lost to failures nor blocked by saves and
    restores — and the Young/Daly checkpoint interval √(2 · save cost · MTBF), from its own records."""
    with db.read() as session:
        return advice.job_advice(session, rules.find_job(session, job))
