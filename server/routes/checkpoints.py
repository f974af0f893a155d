"""Checkpoints: record commits, list and mark records, and answer "what is the last good epoch?"."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from ckptstore.position import POSITION_LIMIT
from ckptstore.schema import CheckpointRecord, CheckpointState, CommitRequest, LastGood, MarkRequest
from server import records
from server.db import Database
from server.deps import DbDep, JobName, NodeName
from server.errors import COMMON_ERRORS, error_responses
from server.metrics import METRICS

router = APIRouter(prefix="/v1/jobs/{job}", tags=["checkpoints"], responses=COMMON_ERRORS | error_responses(409))


@router.post(
    "/nodes/{node}/checkpoints",
    status_code=201,
    response_model=CheckpointRecord,
    responses={200: {"model": CheckpointRecord, "description": "identical commit already recorded"}},
)
def commit(job: JobName, node: NodeName, body: CommitRequest, db: DbDep, response: Response) -> CheckpointRecord:
    """Record a committed checkpoint. Identical re-posts answer 200; other content 409 conflict; an
    attempt older than the node's newest 409 fenced; a location not built from the key parts 422."""
    with db.write() as session:
        record, created = records.commit_checkpoint(session, records.lock_job(session, job), node, body)
    response.status_code = 201 if created else 200
    METRICS.commits.labels("created" if created else "repeated").inc()
    return record


@router.get("/checkpoints", response_model=list[CheckpointRecord])
def list_checkpoints(
    job: JobName,
    db: DbDep,
    node: str | None = None,
    epoch: Annotated[int | None, Query(ge=0, lt=POSITION_LIMIT)] = None,
    state: CheckpointState | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> list[CheckpointRecord]:
    with db.read() as session:
        return records.list_checkpoints(
            session, records.find_job(session, job), node=node, epoch=epoch, state=state, limit=limit, offset=offset
        )


@router.post("/nodes/{node}/checkpoints/mark", response_model=list[CheckpointRecord])
def mark(job: JobName, node: NodeName, body: MarkRequest, db: DbDep) -> list[CheckpointRecord]:
    """Mark a node's checkpoint corrupt or deleted; its position stops counting as good."""
    with db.write() as session:
        return records.mark_checkpoint(session, records.lock_job(session, job), node, body)


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
        return row.version, records.last_good(session, row, max_epoch=max_epoch).model_dump_json().encode()
