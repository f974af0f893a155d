"""Attempts: a process start gets its number; where it resumed (and what it skipped); the restore
agreement; the job's restart history."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, TypeVar

from fastapi import APIRouter, Header, Path, Query, Request
from sqlalchemy.orm import Session

from ckptstore.position import POSITION_LIMIT
from ckptstore.server.db.models import Attempt, Job
from ckptstore.server.deps import AgreementsDep, DbDep, JobName, NodeName, PageDep, WritesDep
from ckptstore.server.errors import COMMON_ERRORS, error_responses
from ckptstore.server.records import restarts, rules
from ckptstore.server.records.agreement import WAIT_LIMIT_S
from ckptstore.server.records.batching import WriteBatcher
from ckptstore.server.records.writes import IDEMPOTENCY_KEY, answer_start, register_attempt
from ckptstore.wire.schema import (
    AttemptInfo,
    AttemptRequest,
    NodeStart,
    ResumeAgreement,
    ResumeAudit,
    ResumeReport,
    StartRequest,
)

__all__ = ["router"]

router = APIRouter(prefix="/v1/jobs/{job}", tags=["attempts"], responses=COMMON_ERRORS)
Report = TypeVar("Report", ResumeReport, ResumeAudit)
AttemptNumber = Annotated[int, Path(ge=1, lt=POSITION_LIMIT, description="the attempt's number")]
IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        pattern=IDEMPOTENCY_KEY,
        description="a key the client makes once per start; a retried request with it gets the same attempt",
    ),
]


@router.post("/nodes/{node}/attempts", status_code=201, response_model=AttemptInfo)
async def start_attempt(
    job: JobName, node: NodeName, writes: WritesDep, body: AttemptRequest | None = None, key: IdempotencyKey = None
) -> AttemptInfo:
    """Number a new start of `node` (fencing every older attempt) and record where it resumed from;
    a request repeating an answered one's Idempotency-Key gets that attempt again. Well-formed
    registrations are answered before routing (`ckptstore.server.http.fastpath`), by the same function."""
    return await register_attempt(writes, job, node, body, key)


@router.post("/nodes/{node}/start", response_model=NodeStart)
async def start_node(
    job: JobName, node: NodeName, body: StartRequest, request: Request, key: IdempotencyKey = None
) -> NodeStart:
    """A node's start in one request (a restart storm's nodes each send one): register a new attempt,
    fencing every older one, and answer this node's part of the last-good answer — while the job's
    declaration is the one the node checked and every copy it lists is recorded. Otherwise nothing
    changes and the answer says why: the client then declares, records and registers a request at a
    time. Well-formed starts are answered before routing (`ckptstore.server.http.fastpath`), by the same function."""
    return await answer_start(request.app.state, job, node, body, key)


@router.put("/nodes/{node}/attempts/{attempt}", response_model=AttemptInfo, responses=error_responses(409))
async def report_resume(
    job: JobName, node: NodeName, attempt: AttemptNumber, body: ResumeReport, writes: WritesDep
) -> AttemptInfo:
    """Where this attempt resumed (its part verified there) and which copies it skipped, and why."""
    # every node of a restarting job reports at once: group commit
    return await _change_attempt(writes, job, node, attempt, body, restarts.report_resume)


@router.put("/nodes/{node}/attempts/{attempt}/audit", response_model=AttemptInfo)
async def report_audit(
    job: JobName, node: NodeName, attempt: AttemptNumber, body: ResumeAudit, writes: WritesDep
) -> AttemptInfo:
    """This attempt's resume audit: the saved run's fingerprint against the live one (`resume.audited`)."""
    return await _change_attempt(writes, job, node, attempt, body, restarts.record_audit)


async def _change_attempt(
    writes: WriteBatcher,
    job: str,
    node: str,
    attempt: int,
    body: Report,
    change: Callable[[Session, Job, str, int, Report], Attempt],
) -> AttemptInfo:
    """Apply `change` to the attempt under the job's lock, in the group commit; answer the attempt."""

    def run(session: Session) -> AttemptInfo:
        row = rules.lock_job(session, job)
        return restarts.attempt_info(row, change(session, row, node, attempt, body))

    return await writes.run(job, run)


@router.get("/resume-agreement", response_model=ResumeAgreement)
async def resume_agreement(
    job: JobName,
    agreements: AgreementsDep,
    wait_s: Annotated[
        float, Query(ge=0, le=WAIT_LIMIT_S, description="wait up to this long for the agreement (0: answer at once)")
    ] = 0,
) -> ResumeAgreement:
    """Whether every expected node verified its part of the resume position in this restart (and who is
    waited for); with `wait_s`, answered once agreed or when the wait is over (`ckptstore.server.records.agreement`)."""
    return await agreements.wait(job, wait_s)


@router.get("/attempts", response_model=list[AttemptInfo])
def list_attempts(job: JobName, db: DbDep, page: PageDep, node: str | None = None) -> list[AttemptInfo]:
    """The job's attempts in the order they started, a page at a time."""
    with db.read() as session:
        return restarts.list_attempts(session, rules.find_job(session, job), node=node, page=page)
