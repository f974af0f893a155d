"""cp_accessible: nodes report whether they can use storage; the service can probe it itself."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from ckptstore import Store
from ckptstore.schema import HealthReport, JobHealth, NodeHealth, ProbeResult
from server import records, telemetry
from server.deps import DbDep, JobName, NodeName, SettingsDep
from server.errors import COMMON_ERRORS

router = APIRouter(prefix="/v1/jobs/{job}", tags=["health"], responses=COMMON_ERRORS)
PROBE_TIMEOUT_S = 10.0


@router.put("/nodes/{node}/health", response_model=NodeHealth)
def report_health(job: JobName, node: NodeName, body: HealthReport, db: DbDep, settings: SettingsDep) -> NodeHealth:
    with db.write() as session:
        row = records.find_job(session, job)
        return telemetry.report_health(session, row, node, body, stale_after=settings.health_stale_seconds)


def _probe(root: str) -> ProbeResult:
    try:
        report = Store(root).accessible(timeout=PROBE_TIMEOUT_S)
    except Exception as exc:  # e.g. an fsspec protocol whose package is missing, or no credentials
        return ProbeResult(
            cp_accessible=False, latency_ms=None, error=f"cannot open storage: {type(exc).__name__}: {exc}"
        )
    error = report.error
    if error and ("credential" in error.lower() or "NoCredentials" in error):
        error = f"the service has no credentials for this storage: {error}"
    return ProbeResult(cp_accessible=report.ok, latency_ms=report.latency_ms, error=error)


@router.get("/health", response_model=JobHealth)
async def job_health(job: JobName, db: DbDep, settings: SettingsDep, probe: bool = False) -> JobHealth:
    """Each node's last cp_accessible report and its staleness; `?probe=true` also probes the storage root."""

    def read() -> tuple[str, list[NodeHealth]]:
        with db.read() as session:
            row = records.find_job(session, job)
            nodes = records.expected_nodes(session, row)
            return row.storage_root, telemetry.job_health(
                session, row, nodes, stale_after=settings.health_stale_seconds
            )

    root, nodes = await asyncio.to_thread(read)
    result = await asyncio.to_thread(_probe, root) if probe else None
    return JobHealth(job=job, nodes=nodes, probe=result)
