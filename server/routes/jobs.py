"""Jobs: declare (storage root, expected nodes, retention), describe, list and forget."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import APIRouter, Header, Request, Response
from sqlalchemy import select

from ckptstore.server.db.models import Job
from ckptstore.server.deps import DbDep, JobName, PageDep, SettingsDep
from ckptstore.server.errors import COMMON_ERRORS, ApiError, error_responses
from ckptstore.server.records import lineage, rules
from ckptstore.server.settings import Settings
from ckptstore.wire.schema import JobInfo, JobSpec, Lineage

__all__ = ["router"]

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=COMMON_ERRORS | error_responses(403, 409))


@router.put("/{job}", response_model=JobInfo, responses={201: {"model": JobInfo}})
def put_job(
    job: JobName,
    spec: JobSpec,
    db: DbDep,
    settings: SettingsDep,
    request: Request,
    response: Response,
    parent_token: Annotated[str | None, Header(alias="X-Ckptstore-Parent-Token")] = None,
) -> JobInfo:
    """Declare a job or update it; a new node set applies to positions first written after the change.
    Declaring a fork reads its parent's checkpoints: a job token must show a right to the parent too
    (its token, or the admin token, in `X-Ckptstore-Parent-Token`)."""
    if spec.parent is not None and getattr(request.state, "token_job", None) not in (None, spec.parent.job):
        if not _may_read(settings, spec.parent.job, parent_token):
            raise ApiError(
                403,
                "forbidden",
                f"forking from {spec.parent.job!r} reads its checkpoints: send that job's token (or the admin "
                "token) as X-Ckptstore-Parent-Token",
            )
    with db.write() as session:
        row, created = rules.put_job(
            session, job, spec, default_root=settings.default_storage, allowed_roots=settings.allowed_roots
        )
        response.status_code = 201 if created else 200
        return rules.job_info(session, row)


def _may_read(settings: Settings, job: str, token: str | None) -> bool:
    """Whether `token` is the admin token or `job`'s own."""
    if token is None:
        return False
    secrets = [settings.token] if settings.token is not None else []
    secrets += [secret for name, secret in settings.job_tokens.items() if name == job]
    return any(hmac.compare_digest(token.encode(), s.get_secret_value().encode()) for s in secrets)


@router.get("", response_model=list[JobInfo])
def list_jobs(db: DbDep, page: PageDep) -> list[JobInfo]:
    """Jobs by name, a page at a time."""
    with db.read() as session:
        rows = session.scalars(select(Job).order_by(Job.name).limit(page.limit).offset(page.offset))
        return [rules.job_info(session, row) for row in rows]


@router.get("/{job}", response_model=JobInfo)
def get_job(job: JobName, db: DbDep, request: Request) -> Response:
    """The job as declared, with its last good epoch and resume position. The answer is cached per job
    version: repeated reads are answered before routing (`ckptstore.server.http.fastpath`)."""
    with db.read() as session:
        row = rules.find_job(session, job)
        version, body = row.version, rules.job_info(session, row).model_dump_json().encode()
    request.app.state.job_answers.put((job, None, None), version, body)
    return Response(body, media_type="application/json")


@router.get("/{job}/lineage", response_model=Lineage)
def get_lineage(job: JobName, db: DbDep) -> Lineage:
    """The checkpoint this job was forked from, that job's parent and so on, and the jobs forked from it."""
    with db.read() as session:
        return lineage.lineage(session, rules.find_job(session, job))


@router.delete("/{job}", status_code=204)
def delete_job(job: JobName, db: DbDep) -> Response:
    """Forget a job's records (its checkpoints on storage stay; `ckptstore reindex` can bring them back)."""
    with db.write() as session:
        rules.delete_job(session, rules.lock_job(session, job))
    return Response(status_code=204)
