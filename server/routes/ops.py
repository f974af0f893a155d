"""Operations endpoints: liveness, readiness (the database answers), Prometheus metrics."""

from __future__ import annotations

import time

from fastapi import APIRouter, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import select, text

from ckptstore.server.db.models import Attempt, Job
from ckptstore.server.deps import DbDep
from ckptstore.server.errors import ApiError
from ckptstore.server.metrics import METRICS, scrape_metrics
from ckptstore.server.records.advice import job_advice
from ckptstore.server.records.telemetry import replication_lag

__all__ = ["router", "ADVICE_WINDOW_S"]

ADVICE_WINDOW_S = 86_400.0  # /metrics gives the advice of jobs with a process started this recently

router = APIRouter(tags=["operations"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
def readyz(db: DbDep) -> dict[str, str]:
    try:
        with db.read() as session:
            session.execute(text("SELECT 1"))
    except Exception:
        raise ApiError(503, "unavailable", "the database does not answer", headers={"Retry-After": "1"}) from None
    return {"status": "ready"}


@router.get("/metrics", response_class=PlainTextResponse, responses={200: {"content": {"text/plain": {}}}})
def metrics(db: DbDep) -> Response:
    """Prometheus metrics (text exposition format), with replication lag per node of jobs with a local
    tier, and goodput and the recommended interval of jobs that started a process in the last day."""
    now = time.time()
    with db.read() as session:
        jobs = session.scalars(select(Job).where(Job.local_root.is_not(None)))
        lags = {job.name: replication_lag(session, job, now=now) for job in jobs}
        recent = select(Attempt.job_id).where(Attempt.started_at > now - ADVICE_WINDOW_S).distinct()
        advice = [job_advice(session, job) for job in session.scalars(select(Job).where(Job.id.in_(recent)))]
    return Response(generate_latest(METRICS.registry) + scrape_metrics(lags, advice), media_type=CONTENT_TYPE_LATEST)
