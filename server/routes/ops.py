"""Operations endpoints: liveness, readiness (the database answers), Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from server.deps import DbDep
from server.errors import ApiError
from server.metrics import METRICS

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
def metrics() -> Response:
    """Prometheus metrics (text exposition format)."""
    return Response(generate_latest(METRICS.registry), media_type=CONTENT_TYPE_LATEST)
