"""`ServiceClient`: the service's REST API over httpx, with retries and typed errors.

Connection errors, timeouts and 5xx are retried with exponential backoff and jitter (idempotent
by design: commits re-posted with the same content answer 200). The service's JSON errors are
mapped to `ckptstore.errors` in one place, `_raise_for`.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

from ckptstore.errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    FencedError,
    RequestRejectedError,
    ServiceUnavailableError,
)
from ckptstore.position import Position
from ckptstore.report import AccessReport, CheckpointRef
from ckptstore.schema import (
    AttemptInfo,
    CheckpointRecord,
    GcPlan,
    JobHealth,
    JobInfo,
    LastGood,
    NodeHealth,
    StatsSummary,
)

__all__ = ["ServiceClient"]

T = TypeVar("T")
_RETRYABLE_STATUS = {502, 503, 504}


def _raise_for(response: httpx.Response) -> None:
    """Translate an error answer into the typed error it means."""
    if response.is_success:
        return
    try:
        body = response.json()
        code, detail = str(body.get("error", "")), str(body.get("detail", response.text))
    except ValueError:
        code, detail = "", response.text[:500]
    status = response.status_code
    if status >= 500:
        raise ServiceUnavailableError(f"service answered {status}: {detail}")
    if status == 409 and code == "fenced":
        raise FencedError(detail)
    if status == 409:
        raise CommitConflictError(detail)
    if status == 404:
        raise CheckpointNotFoundError(detail)
    raise RequestRejectedError(status, code or "invalid", detail)


class ServiceClient:
    """A client of the ckptstore metadata service.

    `url` defaults to `CKPTSTORE_URL`; `token` to `CKPTSTORE_TOKEN`. `retries` bounds the attempts
    per call on connection errors and 5xx (ServiceUnavailableError after the last one).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        retries: int = 4,
        backoff: float = 0.2,
        transport: httpx.BaseTransport | None = None,
    ):
        url = url or os.environ.get("CKPTSTORE_URL")
        if not url:
            raise ValueError("no service URL: pass url= or set CKPTSTORE_URL")
        token = token if token is not None else os.environ.get("CKPTSTORE_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self.retries = max(1, retries)
        self.backoff = backoff
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport)

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, *, parse: Callable[[Any], T] | None = None, **kwargs: Any) -> T | None:
        for attempt in range(self.retries):
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                error: Exception = exc
            else:
                if response.status_code not in _RETRYABLE_STATUS:
                    _raise_for(response)
                    return parse(response.json()) if parse and response.content else None
                error = ServiceUnavailableError(f"service answered {response.status_code}")
            if attempt + 1 < self.retries:
                time.sleep(self.backoff * (2**attempt) * (0.5 + random.random()))
        raise ServiceUnavailableError(
            f"{method} {self.url}{path} failed after {self.retries} tries: {error}"
        ) from error

    # -- jobs and attempts ---------------------------------------------------------------------

    def put_job(
        self, job: str, nodes: list[str], *, storage_root: str | None = None, retention: dict[str, Any] | None = None
    ) -> JobInfo:
        body: dict[str, Any] = {"nodes": nodes}
        if storage_root is not None:
            body["storage_root"] = storage_root
        if retention is not None:
            body["retention"] = retention
        return self._call("PUT", f"/v1/jobs/{job}", json=body, parse=JobInfo.model_validate)

    def get_job(self, job: str) -> JobInfo:
        return self._call("GET", f"/v1/jobs/{job}", parse=JobInfo.model_validate)

    def list_jobs(self, *, limit: int = 100, offset: int = 0) -> list[JobInfo]:
        return self._call(
            "GET",
            "/v1/jobs",
            params={"limit": limit, "offset": offset},
            parse=lambda rows: [JobInfo.model_validate(r) for r in rows],
        )

    def delete_job(self, job: str) -> None:
        self._call("DELETE", f"/v1/jobs/{job}")

    def start_attempt(self, job: str, node: str, *, resumed_from: Position | None = None) -> int:
        """Register a process start; returns its attempt number (every older attempt is fenced)."""
        body = {
            "resumed_from": None if resumed_from is None else {"epoch": resumed_from.epoch, "batch": resumed_from.batch}
        }
        return self._call(
            "POST",
            f"/v1/jobs/{job}/nodes/{node}/attempts",
            json=body,
            parse=lambda b: AttemptInfo.model_validate(b).attempt,
        )

    def list_attempts(self, job: str, *, node: str | None = None) -> list[AttemptInfo]:
        params = {"node": node} if node else {}
        return self._call(
            "GET",
            f"/v1/jobs/{job}/attempts",
            params=params,
            parse=lambda rows: [AttemptInfo.model_validate(r) for r in rows],
        )

    # -- checkpoints ---------------------------------------------------------------------------

    def commit(self, ref: CheckpointRef, *, metrics: dict[str, float] | None = None) -> CheckpointRecord:
        """Record a checkpoint the core committed (idempotent: a re-post of the same commit is fine)."""
        body = {
            "epoch": ref.position.epoch,
            "batch": ref.position.batch,
            "attempt": ref.attempt,
            "step": ref.manifest.step,
            "location": ref.location,
            "bytes": ref.bytes,
            "checksums": ref.checksums,
            "metrics": metrics or {},
        }
        return self._call(
            "POST", f"/v1/jobs/{ref.job}/nodes/{ref.node}/checkpoints", json=body, parse=CheckpointRecord.model_validate
        )

    def list_checkpoints(
        self,
        job: str,
        *,
        node: str | None = None,
        epoch: int | None = None,
        state: str | None = None,
        limit: int = 1000,
        offset: int = 0,
    ) -> list[CheckpointRecord]:
        params = {
            k: v
            for k, v in {"node": node, "epoch": epoch, "state": state, "limit": limit, "offset": offset}.items()
            if v is not None
        }
        return self._call(
            "GET",
            f"/v1/jobs/{job}/checkpoints",
            params=params,
            parse=lambda rows: [CheckpointRecord.model_validate(r) for r in rows],
        )

    def mark(
        self,
        job: str,
        node: str,
        position: Position,
        state: str,
        *,
        attempt: str | int | None = None,
        reason: str | None = None,
    ) -> list[CheckpointRecord]:
        body = {"epoch": position.epoch, "batch": position.batch, "state": state, "attempt": attempt, "reason": reason}
        return self._call(
            "POST",
            f"/v1/jobs/{job}/nodes/{node}/checkpoints/mark",
            json=body,
            parse=lambda rows: [CheckpointRecord.model_validate(r) for r in rows],
        )

    def last_good_epoch(self, job: str, *, max_epoch: int | None = None) -> LastGood:
        params = {} if max_epoch is None else {"max_epoch": max_epoch}
        return self._call("GET", f"/v1/jobs/{job}/last-good-epoch", params=params, parse=LastGood.model_validate)

    def gc_plan(self, job: str) -> GcPlan:
        return self._call("GET", f"/v1/jobs/{job}/gc-plan", parse=GcPlan.model_validate)

    # -- health and stats ----------------------------------------------------------------------

    def report_health(self, job: str, node: str, report: AccessReport) -> NodeHealth:
        body = {
            "cp_accessible": report.ok,
            "latency_ms": report.latency_ms,
            "error": None if report.error is None else report.error[:2000],
        }
        return self._call("PUT", f"/v1/jobs/{job}/nodes/{node}/health", json=body, parse=NodeHealth.model_validate)

    def health(self, job: str, *, probe: bool = False) -> JobHealth:
        return self._call(
            "GET", f"/v1/jobs/{job}/health", params={"probe": str(probe).lower()}, parse=JobHealth.model_validate
        )

    def report_stats(self, job: str, node: str, action: str, seconds: float, *, nbytes: int | None = None) -> None:
        self._call(
            "POST", f"/v1/jobs/{job}/stats", json={"node": node, "action": action, "seconds": seconds, "bytes": nbytes}
        )

    def stats(self, job: str) -> StatsSummary:
        return self._call("GET", f"/v1/jobs/{job}/stats", parse=StatsSummary.model_validate)
