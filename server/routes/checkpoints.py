"""Checkpoints: record commits, list and mark records, and answer "what is the last good epoch?"."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ckptstore.position import POSITION_LIMIT
from ckptstore.schema import (
    CheckpointRecord,
    CheckpointState,
    CommitBatch,
    CommitOutcome,
    CommitRequest,
    ErrorBody,
    LastGood,
    MarkRequest,
    NodeCommit,
)
from server import records
from server.db import Database
from server.deps import DbDep, JobName, NodeName, PageDep, WritesDep
from server.errors import COMMON_ERRORS, ApiError, error_responses
from server.last_good import last_good
from server.metrics import METRICS

router = APIRouter(prefix="/v1/jobs/{job}", tags=["checkpoints"], responses=COMMON_ERRORS | error_responses(409))


@router.post(
    "/nodes/{node}/checkpoints",
    status_code=201,
    response_model=CheckpointRecord,
    responses={200: {"model": CheckpointRecord, "description": "identical commit already recorded"}},
)
async def commit(
    job: JobName, node: NodeName, body: CommitRequest, writes: WritesDep, response: Response
) -> CheckpointRecord:
    """Record a committed checkpoint. Identical re-posts answer 200; other content 409 conflict; an
    attempt older than the node's newest 409 fenced; a location not built from the key parts 422.
    Well-formed commits are answered before routing (`server.fastpath`), with the same functions."""
    record, created = await writes.run(job, recording(job, node, body), defers_inserts=True)
    response.status_code = commit_status(created)
    return record


def recording(job: str, node: str, body: CommitRequest) -> Callable[[Session], tuple[CheckpointRecord, bool]]:
    """The group-commit write that records `node`'s commit `body` in `job`."""
    return lambda session: records.commit_checkpoint(session, records.lock_job(session, job), node, body)


def commit_status(created: bool) -> int:
    """Count a recorded commit; its status: 201 new, 200 an identical re-post."""
    METRICS.commits.labels("created" if created else "repeated").inc()
    return 201 if created else 200


@router.post("/checkpoints/batch", response_model=list[CommitOutcome])
async def commit_batch(job: JobName, body: CommitBatch, writes: WritesDep) -> list[CommitOutcome]:
    """Record several commits of the job, in order, in one group transaction: each gets the answer it
    would have had alone (201, 200, 409, 404 or 422 in `status`); the request fails only as a whole
    (503) when nothing could be recorded."""

    def recorder(commit: NodeCommit) -> Callable[[Session], tuple[CheckpointRecord, bool]]:
        return recording(job, commit.node, CommitRequest.model_validate(commit.model_dump(exclude={"node"})))

    futures = [
        asyncio.wrap_future(writes.submit(job, recorder(commit), defers_inserts=True)) for commit in body.commits
    ]
    return [_outcome(answer) for answer in await asyncio.gather(*futures, return_exceptions=True)]


def _outcome(answer: tuple[CheckpointRecord, bool] | BaseException) -> CommitOutcome:
    if isinstance(answer, ApiError):
        return CommitOutcome(
            status=answer.status, error=ErrorBody.model_validate({"error": answer.code, "detail": answer.detail})
        )
    if isinstance(answer, IntegrityError):
        detail = "a concurrent request changed the same record; retry"
        return CommitOutcome(status=409, error=ErrorBody(error="conflict", detail=detail))
    if isinstance(answer, BaseException):
        raise answer  # the batch failed as a whole (the database away: 503)
    record, created = answer
    return CommitOutcome(status=commit_status(created), record=record)


@router.get("/checkpoints", response_model=list[CheckpointRecord])
def list_checkpoints(
    job: JobName,
    db: DbDep,
    page: PageDep,
    node: str | None = None,
    epoch: Annotated[int | None, Query(ge=0, lt=POSITION_LIMIT)] = None,
    state: CheckpointState | None = None,
) -> list[CheckpointRecord]:
    """The job's records in (epoch, batch, node, attempt) order, a page at a time."""
    with db.read() as session:
        return records.list_checkpoints(
            session, records.find_job(session, job), node=node, epoch=epoch, state=state, page=page
        )


@router.post("/nodes/{node}/checkpoints/mark", response_model=list[CheckpointRecord])
async def mark(job: JobName, node: NodeName, body: MarkRequest, writes: WritesDep) -> list[CheckpointRecord]:
    """Mark a node's copy corrupt, missing or deleted; the judge re-decides its position."""
    return await writes.run(
        job, lambda session: records.mark_checkpoint(session, records.lock_job(session, job), node, body)
    )


@router.get("/last-good-epoch", response_model=LastGood)
async def last_good_epoch(
    job: JobName, request: Request, max_epoch: Annotated[int | None, Query(ge=0, lt=POSITION_LIMIT)] = None
) -> Response:
    """The last good epoch, the resume position, each node's part of it, and why newer positions are not good.

    Cache hits are answered before routing (`server.fastpath`); this computes the answer and caches it.
    """
    METRICS.last_good_queries.inc()
    version, body = await asyncio.to_thread(_compute_last_good, request.app.state.db, job, max_epoch)
    request.app.state.answers.put((job, max_epoch), version, body)
    return Response(body, media_type="application/json")


def _compute_last_good(db: Database, job: str, max_epoch: int | None) -> tuple[int, bytes]:
    with db.read() as session:
        row = records.find_job(session, job)
        return row.version, last_good(session, row, max_epoch=max_epoch).model_dump_json().encode()
