"""cp_accessible: nodes report whether they can use storage; the service can probe it itself."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from fastapi import APIRouter
from sqlalchemy.orm import Session

from ckptstore import Store
from ckptstore.errors import StorageUnavailableError
from ckptstore.server.deps import DbDep, JobName, NodeName, SettingsDep, WritesDep
from ckptstore.server.errors import COMMON_ERRORS
from ckptstore.server.records import rules, telemetry
from ckptstore.server.records.last_good import expected_nodes
from ckptstore.wire.schema import HealthReport, JobHealth, NodeHealth, ProbeResult

__all__ = ["router"]

router = APIRouter(prefix="/v1/jobs/{job}", tags=["health"], responses=COMMON_ERRORS)
PROBE_TIMEOUT_S = 5.0  # the whole probe, opening the storage included: well inside a client's timeout


@router.put("/nodes/{node}/health", response_model=NodeHealth)
async def report_health(
    job: JobName, node: NodeName, body: HealthReport, writes: WritesDep, settings: SettingsDep
) -> NodeHealth:
    def report(session: Session) -> NodeHealth:
        row = rules.find_job(session, job)
        rules.require_node(session, row, node)
        return telemetry.report_health(session, row, node, body, stale_after=settings.health_stale_seconds)

    return await writes.run(job, report)


def _probe(root: str) -> ProbeResult:
    """The service's own cp_accessible probe of a storage root (its credentials, its network),
    answered within PROBE_TIMEOUT_S even when opening the storage hangs (a credentials lookup, an
    unreachable endpoint)."""
    started = time.monotonic()
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        store = pool.submit(Store, root).result(timeout=PROBE_TIMEOUT_S)
    except FutureTimeout:
        return ProbeResult(
            cp_accessible=False, latency_ms=None, error=f"storage did not open within {PROBE_TIMEOUT_S:g} s"
        )
    except (StorageUnavailableError, ValueError) as exc:  # no backend package, or a URL fsspec cannot open
        return ProbeResult(cp_accessible=False, latency_ms=None, error=f"cannot open storage: {exc}")
    finally:
        pool.shutdown(wait=False)
    report = store.accessible(timeout=max(0.1, PROBE_TIMEOUT_S - (time.monotonic() - started)))
    return ProbeResult(cp_accessible=report.ok, latency_ms=report.latency_ms, error=report.error)


@router.get("/health", response_model=JobHealth)
async def job_health(job: JobName, db: DbDep, settings: SettingsDep, probe: bool = False) -> JobHealth:
    """Each node's last cp_accessible report and its staleness; `?probe=true` also probes the storage root."""

    def read() -> tuple[str, list[NodeHealth]]:
        with db.read() as session:
            row = rules.find_job(session, job)
            nodes = expected_nodes(session, row)
            return row.storage_root, telemetry.job_health(
                session, row, nodes, stale_after=settings.health_stale_seconds
            )

    root, nodes = await asyncio.to_thread(read)
    result = await asyncio.to_thread(_probe, root) if probe else None
    return JobHealth(job=job, nodes=nodes, probe=result)
