"""Checkpoints: record commits, list and mark records, and answer "what is the last good epoch?"."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from ckptstore.position import POSITION_LIMIT
from ckptstore.server.deps import DbDep, JobName, NodeName, PageDep, WritesDep, checked_name
from ckptstore.server.errors import COMMON_ERRORS, error_responses
from ckptstore.server.metrics import METRICS
from ckptstore.server.records import rules
from ckptstore.server.records.answers import last_good_answer
from ckptstore.server.records.writes import commit_status, outcome, record_commits
from ckptstore.wire.schema import (
    CheckpointRecord,
    CheckpointState,
    CommitBatch,
    CommitOutcome,
    CommitRequest,
    LastGood,
    MarkRequest,
)

__all__ = ["router"]

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
    Well-formed commits are answered before routing (`ckptstore.server.http.fastpath`), by the same entry point."""
    (answer,) = await record_commits(writes, job, [(node, body)])
    if isinstance(answer, BaseException):
        raise answer
    record, created = answer
    response.status_code = commit_status(created)
    return record


@router.post("/checkpoints/batch", response_model=list[CommitOutcome])
async def commit_batch(job: JobName, body: CommitBatch, writes: WritesDep) -> list[CommitOutcome]:
    """Record several commits of the job, in order, in one group transaction: each gets the answer it
    would have had alone (201, 200, 409, 404 or 422 in `status`); the request fails only as a whole
    (503) when nothing could be recorded. The route every commit of the Python client takes; well-formed
    batches are answered before routing (`ckptstore.server.http.fastpath`), by the same entry point."""
    answers = await record_commits(writes, job, [(commit.node, commit) for commit in body.commits])
    return [outcome(answer) for answer in answers]


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
        return rules.list_checkpoints(
            session, rules.find_job(session, job), node=node, epoch=epoch, state=state, page=page
        )


@router.post("/nodes/{node}/checkpoints/mark", response_model=list[CheckpointRecord])
async def mark(job: JobName, node: NodeName, body: MarkRequest, writes: WritesDep) -> list[CheckpointRecord]:
    """Mark a node's copy corrupt, missing or deleted; the judge re-decides its position."""
    return await writes.run(
        job, lambda session: rules.mark_checkpoint(session, rules.lock_job(session, job), node, body)
    )


@router.get("/last-good-epoch", response_model=LastGood)
async def last_good_epoch(
    job: JobName,
    request: Request,
    max_epoch: Annotated[int | None, Query(ge=0, lt=POSITION_LIMIT)] = None,
    node: Annotated[
        str | None, Query(description="only this node's part in `nodes` (what a restoring node needs)")
    ] = None,
) -> Response:
    """The last good epoch, the resume position, each node's part of it, and why newer positions are not good.

    Cache hits are answered before routing (`ckptstore.server.http.fastpath`); this computes the answer and caches it.
    """
    METRICS.last_good_queries.inc()
    if node is not None:
        node = checked_name(node, "node")
    return Response(await last_good_answer(request.app.state, job, max_epoch, node), media_type="application/json")
