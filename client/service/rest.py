"""`ServiceClient`: the service's REST API over httpx, with retries and typed errors.

Connection errors, timeouts and 5xx are retried with exponential backoff and jitter (idempotent
by design: commits re-posted with the same content answer 200). The service's JSON errors are
mapped to `ckptstore.errors` in one place, `_raise_for`.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from ckptstore import tracing
from ckptstore.client.engine.options import check_service_url, service_url_from_env, service_urls
from ckptstore.client.service.events import follow
from ckptstore.client.service.wire import Commit, answer, batches, commit_request, raise_for
from ckptstore.copykey import CopyKey
from ckptstore.errors import CheckpointNotFoundError, ServiceUnavailableError
from ckptstore.names import attempt_number, validate_attempt, validate_name
from ckptstore.position import Position
from ckptstore.report import AccessReport, CheckpointRef
from ckptstore.wire.events import Event
from ckptstore.wire.presign import SignedUrls, UrlsRequest
from ckptstore.wire.schema import (
    Advice,
    AttemptInfo,
    AttemptRequest,
    BlobServerInfo,
    BlobServerRegistration,
    CheckpointRecord,
    CheckpointRequestBody,
    CheckpointRequestInfo,
    CommitBatch,
    CommitOutcome,
    ForkPoint,
    HealthReport,
    JobHealth,
    JobInfo,
    JobSpec,
    LastGood,
    Lineage,
    MarkCause,
    MarkRequest,
    MarkState,
    NodeHealth,
    NodeStart,
    PositionBody,
    ResumeAgreement,
    ResumeAudit,
    ResumeReport,
    RetentionPlan,
    RetentionSpec,
    SkippedCopy,
    StartRequest,
    StatsAction,
    StatsReport,
    StatsSummary,
)

__all__ = ["ServiceClient"]

T = TypeVar("T")
_RETRYABLE_STATUS = {502, 503, 504}


class ServiceClient:
    """A client of the ckptstore metadata service.

    `url` — one URL, a comma-separated list or a sequence of replicas' URLs; a request that fails at one
    goes to the next (commits are idempotent: none is lost or doubled) — defaults to `CKPTSTORE_URL`; `token` to `CKPTSTORE_TOKEN`. `retries` bounds the attempts
    per call on connection errors and 5xx (ServiceUnavailableError after the last one).
    """

    def __init__(
        self,
        url: str | Sequence[str] | None = None,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        retries: int = 4,
        backoff: float = 0.2,
        transport: httpx.BaseTransport | None = None,
    ):
        urls = service_urls(url or service_url_from_env())
        if not urls:
            raise ValueError("no service URL: pass url= or set CKPTSTORE_URL")
        token = token if token is not None else os.environ.get("CKPTSTORE_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.urls = [check_service_url(u).rstrip("/") for u in urls]
        self._current = 0
        self.retries = max(1, retries)
        self.backoff = backoff
        self._http = httpx.Client(headers=headers, timeout=timeout, transport=transport)

    @property
    def url(self) -> str:
        """The service URL requests go to now (the next one takes over when it fails)."""
        return self.urls[self._current]

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    @staticmethod
    def _job_path(job: str) -> str:
        """`/v1/jobs/<job>`, the name checked first: a bad name is InvalidNameError, never a request."""
        return f"/v1/jobs/{validate_name(job, kind='job')}"

    def _node_path(self, job: str, node: str) -> str:
        return f"{self._job_path(job)}/nodes/{validate_name(node, kind='node')}"

    def next_url(self) -> None:
        """Send the next requests to the next service URL (the current one failed)."""
        self._current = (self._current + 1) % len(self.urls)

    @contextmanager
    def stream(self, method: str, path: str, **kwargs: Any) -> Iterator[httpx.Response]:
        """One streamed request to the current URL (no retries: the caller resumes); a refusal raises
        its typed error, a 5xx ServiceUnavailableError."""
        with self._http.stream(method, self.url + path, **kwargs) as response:
            if not response.is_success:
                response.read()
                raise_for(response)
            yield response

    def events(
        self, job: str | None = None, *, after: int | None = None, types: Iterable[str] | None = None
    ) -> Iterator[Event]:
        """The service's events (of `job`, of some `types`) from `after` (None: from now on), as they
        happen; reconnects on its own from the last event seen (client/service/events.py)."""
        return follow(
            self.stream,
            self.next_url,
            None if job is None else validate_name(job, kind="job"),
            after=after,
            types=types,
        )

    def _request(self, method: str, path: str, *, body: BaseModel | None = None, **kwargs: Any) -> httpx.Response:
        """One request, retried on connection errors and 5xx; `body` is sent as the model's JSON.
        Returns a successful response; raises the typed error of a refusal."""
        headers = kwargs["headers"] = dict(kwargs.get("headers") or {})
        if body is not None:
            kwargs["content"] = body.model_dump_json(exclude_unset=True)
            headers["content-type"] = "application/json"
        tracing.inject(headers)  # the service's span for this request joins the caller's trace
        error: Exception | None = None
        for attempt in range(self.retries):
            for _ in self.urls:  # each service URL in turn, from the one that answered last
                try:
                    response = self._http.request(method, self.url + path, **kwargs)
                except httpx.TransportError as exc:
                    error = exc
                else:
                    if response.status_code not in _RETRYABLE_STATUS:
                        raise_for(response)
                        return response
                    error = ServiceUnavailableError(f"{self.url} answered {response.status_code}")
                self.next_url()
            if attempt + 1 < self.retries:
                time.sleep(self.backoff * (2**attempt) * (0.5 + random.random()))
        raise ServiceUnavailableError(
            f"{method} {path} failed at {', '.join(self.urls)} after {self.retries} tries: {error}"
        ) from error

    def _call(
        self, method: str, path: str, *, parse: Callable[[Any], T], body: BaseModel | None = None, **kwargs: Any
    ) -> T:
        """`_request`, with the answer's JSON parsed by `parse`."""
        return parse(self._request(method, path, body=body, **kwargs).json())

    def ping(self) -> None:
        """Whether the service answers (`GET /healthz`, open to every caller): ServiceUnavailableError if not."""
        self._request("GET", "/healthz")

    # -- jobs and attempts ---------------------------------------------------------------------

    def put_job(
        self,
        job: str,
        nodes: list[str],
        *,
        storage_root: str | None = None,
        local_root: str | None = None,
        retention: dict[str, Any] | None = None,
        parent: ForkPoint | None = None,
        parent_token: str | None = None,
    ) -> JobInfo:
        """Declare or update a job. A fork (`parent`) declared with a job token shows the right to read
        its parent with `parent_token` (the parent's token, or the admin token)."""
        fields: dict[str, Any] = {"nodes": nodes, "storage_root": storage_root, "local_root": local_root}
        fields["parent"] = parent
        if retention is not None:
            fields["retention"] = RetentionSpec.model_validate(retention)
        spec = JobSpec.model_validate(fields)
        headers = {} if parent_token is None else {"X-Ckptstore-Parent-Token": parent_token}
        return self._call("PUT", self._job_path(job), body=spec, parse=JobInfo.model_validate, headers=headers)

    def get_job(self, job: str) -> JobInfo:
        return self._call("GET", self._job_path(job), parse=JobInfo.model_validate)

    def lineage(self, job: str) -> Lineage:
        return self._call("GET", f"{self._job_path(job)}/lineage", parse=Lineage.model_validate)

    def list_jobs(self, *, limit: int = 100, offset: int = 0) -> list[JobInfo]:
        return self._call(
            "GET",
            "/v1/jobs",
            params={"limit": limit, "offset": offset},
            parse=lambda rows: [JobInfo.model_validate(r) for r in rows],
        )

    def delete_job(self, job: str) -> None:
        self._request("DELETE", self._job_path(job))

    def start_attempt(
        self, job: str, node: str, *, resumed_from: Position | None = None, at_least: int | None = None
    ) -> str:
        """Register a process start; returns its attempt id (every older attempt is fenced). `at_least`
        numbers it at least so (raising the node's counter in one request)."""
        fields: dict[str, Any] = {"resumed_from": PositionBody.of(resumed_from)}
        if at_least is not None:
            fields["at_least"] = at_least
        return self._call(
            "POST",
            self._node_path(job, node) + "/attempts",
            body=AttemptRequest.model_validate(fields),
            headers={"Idempotency-Key": uuid.uuid4().hex},  # a retry after a lost answer gets the same attempt
            parse=lambda b: AttemptInfo.model_validate(b).attempt,
        )

    def start_node(self, job: str, node: str, start: StartRequest) -> NodeStart:
        """A node's start in one request: a new attempt and the node's part of the last-good answer, or
        why the service registered nothing (`ckptstore.server.routes.attempts.start_node`)."""
        path, key = self._node_path(job, node) + "/start", uuid.uuid4().hex  # a retry gets the same attempt
        return self._call("POST", path, body=start, headers={"Idempotency-Key": key}, parse=NodeStart.model_validate)

    def report_resume(
        self, job: str, node: str, attempt: str, *, resumed_from: Position | None, skipped: list[SkippedCopy]
    ) -> AttemptInfo:
        """Record where this attempt resumed (its part verified there) and which copies it skipped."""
        body = ResumeReport(resumed_from=PositionBody.of(resumed_from), skipped=skipped)
        return self._call(
            "PUT",
            self._node_path(job, node) + f"/attempts/{attempt_number(validate_attempt(attempt))}",
            body=body,
            parse=AttemptInfo.model_validate,
        )

    def report_audit(self, job: str, node: str, attempt: str, audit: ResumeAudit) -> AttemptInfo:
        """Record this attempt's resume audit (the service says it as `resume.audited`)."""
        return self._call(
            "PUT",
            self._node_path(job, node) + f"/attempts/{attempt_number(validate_attempt(attempt))}/audit",
            body=audit,
            parse=AttemptInfo.model_validate,
        )

    def advice(self, job: str) -> Advice:
        """The job's goodput and recommended checkpoint interval, from its own records."""
        return self._call("GET", self._job_path(job) + "/advice", parse=Advice.model_validate)

    def resume_agreement(self, job: str, *, wait_s: float = 0) -> ResumeAgreement:
        """The job's restore agreement; with `wait_s`, the service answers once every node agreed (or the
        resume position moved), or as it stands after that long: one request instead of a poll each second."""
        read_s = (self._http.timeout.read or 0) + wait_s
        return self._call(
            "GET",
            self._job_path(job) + "/resume-agreement",
            params={"wait_s": round(wait_s, 3)},
            timeout=httpx.Timeout(**(self._http.timeout.as_dict() | {"read": read_s})),
            parse=ResumeAgreement.model_validate,
        )

    def list_attempts(
        self, job: str, *, node: str | None = None, limit: int = 1000, offset: int = 0
    ) -> list[AttemptInfo]:
        """One page of the job's attempts in the order they started (`operations.iter_attempts`: all)."""
        params: dict[str, str | int] = {"limit": limit, "offset": offset} | ({"node": node} if node else {})
        return self._call(
            "GET",
            self._job_path(job) + "/attempts",
            params=params,
            parse=lambda rows: [AttemptInfo.model_validate(r) for r in rows],
        )

    # -- checkpoints ---------------------------------------------------------------------------

    def commit(self, ref: CheckpointRef, *, metrics: dict[str, float] | None = None) -> CheckpointRecord:
        """Record a copy the core committed (idempotent: a re-post of the same commit is fine); raises
        the typed error of a refusal. Sent as a batch of one: the route every commit of this client takes."""
        (answer,) = self.commit_many(ref.key.job, [Commit(ref, metrics or {})])
        if isinstance(answer, Exception):
            raise answer
        return answer

    def commit_many(self, job: str, commits: Sequence[Commit]) -> list[CheckpointRecord | Exception]:
        """Record several copies of `job` in order, in as few requests as the limits allow: for each, its record
        or the typed error it got alone (FencedError, CommitConflictError, ...). Raises only when the
        service could record nothing (ServiceUnavailableError)."""
        answers: list[CheckpointRecord | Exception] = []
        for chunk in batches([commit_request(c) for c in commits]):
            outcomes = self._call(
                "POST",
                self._job_path(job) + "/checkpoints/batch",
                body=CommitBatch(commits=chunk),
                parse=lambda rows: [CommitOutcome.model_validate(r) for r in rows],
            )
            answers += [answer(outcome) for outcome in outcomes]
        return answers

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
            self._job_path(job) + "/checkpoints",
            params=params,
            parse=lambda rows: [CheckpointRecord.model_validate(r) for r in rows],
        )

    def mark(
        self, copy: CopyKey, state: MarkState, *, cause: MarkCause, reason: str | None = None, every_tier: bool = False
    ) -> list[CheckpointRecord]:
        """Mark a copy (with `every_tier`, its attempt's copies on every tier) corrupt, missing or deleted;
        `cause` says which part of ckptstore found it so (it decides the event type)."""
        body = MarkRequest(
            epoch=copy.position.epoch,
            batch=copy.position.batch,
            attempt=copy.attempt,
            tier=None if every_tier else copy.tier,
            state=state,
            cause=cause,
            reason=None if reason is None else reason[:1000],
        )
        return self._call(
            "POST",
            self._node_path(copy.job, copy.node) + "/checkpoints/mark",
            body=body,
            parse=lambda rows: [CheckpointRecord.model_validate(r) for r in rows],
        )

    def last_good_epoch(self, job: str, *, max_epoch: int | None = None, node: str | None = None) -> LastGood:
        """The job's last good epoch and resume position; `nodes` holds every node's part of it, or only
        `node`'s (a restoring node asks for its own: a 4,096-node job's whole answer is 820 KB)."""
        params: dict[str, Any] = {} if max_epoch is None else {"max_epoch": max_epoch}
        if node is not None:
            params["node"] = node
        return self._call("GET", self._job_path(job) + "/last-good-epoch", params=params, parse=LastGood.model_validate)

    def request_checkpoint(self, job: str, *, reason: str | None = None) -> CheckpointRequestInfo:
        """Ask every running node of `job` to save at its next step; an earlier request still pending is
        answered instead (`coalesced`)."""
        body = CheckpointRequestBody(reason=reason)
        path = self._job_path(job) + "/checkpoint-requests"
        return self._call("POST", path, body=body, parse=CheckpointRequestInfo.model_validate)

    def latest_checkpoint_request(self, job: str) -> CheckpointRequestInfo | None:
        """The job's newest checkpoint request and the nodes it still waits for; None when it has none."""
        path = self._job_path(job) + "/checkpoint-requests/latest"
        try:
            return self._call("GET", path, parse=CheckpointRequestInfo.model_validate)
        except CheckpointNotFoundError:
            return None

    def presigned_urls(self, job: str, node: str, wanted: UrlsRequest) -> SignedUrls:
        """Short-lived URLs to the node's objects, signed by the service (`ckptstore.client.service.signed_urls`)."""
        return self._call("POST", self._node_path(job, node) + "/urls", body=wanted, parse=SignedUrls.model_validate)

    def register_blob_server(self, job: str, node: str, url: str, token: str) -> BlobServerInfo:
        """Say where `node`'s peer blob server answers now (`ckptstore.client.peers`)."""
        body = BlobServerRegistration(url=url, token=token)
        path = self._node_path(job, node) + "/blob-server"
        return self._call("PUT", path, body=body, parse=BlobServerInfo.model_validate)

    def blob_servers(self, job: str) -> dict[str, BlobServerInfo]:
        """Each node's registered peer blob server, by node name."""
        path = self._job_path(job) + "/blob-servers"
        return self._call("GET", path, parse=lambda rows: {r["node"]: BlobServerInfo.model_validate(r) for r in rows})

    def retention_plan(self, job: str) -> RetentionPlan:
        return self._call("GET", self._job_path(job) + "/gc-plan", parse=RetentionPlan.model_validate)

    # -- health and stats ----------------------------------------------------------------------

    def report_health(self, job: str, node: str, report: AccessReport) -> NodeHealth:
        body = HealthReport(
            cp_accessible=report.ok,
            latency_ms=report.latency_ms,
            error=None if report.error is None else report.error[:2000],
        )
        return self._call("PUT", self._node_path(job, node) + "/health", body=body, parse=NodeHealth.model_validate)

    def health(self, job: str, *, probe: bool = False) -> JobHealth:
        return self._call(
            "GET", self._job_path(job) + "/health", params={"probe": str(probe).lower()}, parse=JobHealth.model_validate
        )

    def report_stats(
        self, job: str, node: str, action: StatsAction, seconds: float, *, nbytes: int | None = None
    ) -> None:
        body = StatsReport(node=node, action=action, seconds=seconds, bytes=nbytes)
        self._request("POST", self._job_path(job) + "/stats", body=body)

    def stats(self, job: str) -> StatsSummary:
        return self._call("GET", self._job_path(job) + "/stats", parse=StatsSummary.model_validate)
