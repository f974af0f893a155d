"""Operations endpoints: liveness, readiness (the database answers), Prometheus metrics."""

from __future__ import annotations

import time

from fastapi import APIRouter, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import select, text

from server.deps import DbDep
from server.errors import ApiError
from server.metrics import METRICS, replication_metrics
from server.models import Job
from server.telemetry import replication_lag

__all__ = ["router"]

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
    """Prometheus metrics (text exposition format), with replication lag per node of jobs with a local tier."""
    now = time.time()
    with db.read() as session:
        jobs = session.scalars(select(Job).where(Job.local_root.is_not(None)))
        lags = {job.name: replication_lag(session, job, now=now) for job in jobs}
    return Response(generate_latest(METRICS.registry) + replication_metrics(lags), media_type=CONTENT_TYPE_LATEST)
