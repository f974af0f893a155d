"""Presigned URLs: a node's short-lived URLs to its job's objects on S3 or GCS (`ckptstore.server.presign.signer`)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from sqlalchemy import func, select

from ckptstore.format.layout import position_dirname
from ckptstore.server.db.models import Attempt
from ckptstore.server.deps import DbDep, JobName, NodeName
from ckptstore.server.errors import COMMON_ERRORS, ApiError, error_responses
from ckptstore.server.metrics import METRICS
from ckptstore.server.presign.signer import scope, valid_attempt
from ckptstore.server.records import lineage, rules
from ckptstore.wire.presign import SignedUrls, UrlsRequest

__all__ = ["router"]

router = APIRouter(prefix="/v1/jobs/{job}", tags=["urls"], responses=COMMON_ERRORS | error_responses(403, 409))


@router.post("/nodes/{node}/urls", response_model=SignedUrls)
def presigned_urls(job: JobName, node: NodeName, body: UrlsRequest, db: DbDep, request: Request) -> SignedUrls:
    """Short-lived URLs for the node: writes under its current attempt's prefix (blobs of its pool
    create-only), deletes under its own folder, reads and listings under the job and the jobs it was
    forked from. An attempt older than the node's newest registered one is fenced (409) and gets none;
    nothing is signed unless every object asked for is in scope (403)."""
    attempt = None if body.attempt is None else valid_attempt(body.attempt)
    with db.read() as session:
        row = rules.find_job(session, job)
        rules.require_node(session, row, node)
        newest = session.scalar(select(func.max(Attempt.number)).where(Attempt.job_id == row.id, Attempt.node == node))
        ancestors = lineage.lineage(session, row).ancestors
    if attempt is not None and (newest is None or int(attempt) != newest):
        raise ApiError(409, "fenced", f"attempt {attempt} of {node} is not its newest registered attempt ({newest})")
    forked_at = {point.job: position_dirname(point.position.to_position()) for point in ancestors}
    settings = request.app.state.settings
    # A request may ask for a shorter life, never a longer one than the service's configured.
    expires_s = min(body.expires_s or settings.url_expiry_seconds, settings.url_expiry_seconds)
    wanted = [(o, scope(o, job=job, node=node, attempt=attempt, forked_at=forked_at)) for o in body.objects]
    signer = request.app.state.signer
    urls = [signer.sign(row.storage_root, o, expires_s, create_only=create) for o, create in wanted]
    METRICS.presigned_urls.inc(len(urls))
    return SignedUrls(expires_at=time.time() + expires_s, expires_s=expires_s, urls=urls)
