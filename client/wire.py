"""What goes over the wire for `ServiceClient`, and back: error answers as typed errors, commit
bodies, and commits split into batch requests the service accepts."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

from ckptstore.errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    FencedError,
    RequestRejectedError,
    ServiceUnavailableError,
)
from ckptstore.names import Tier
from ckptstore.report import CheckpointRef
from ckptstore.schema import COMMIT_BATCH_LIMIT, CheckpointRecord, CommitOutcome, CommitRequest, NodeCommit

__all__ = ["Commit", "raise_for", "error_for", "commit_request", "batches", "answer", "BATCH_BYTES"]

BATCH_BYTES = 256 * 1024


def raise_for(response: httpx.Response) -> None:
    """Translate an error answer into the typed error it means."""
    if response.is_success:
        return
    try:
        body = response.json()
        code, detail = str(body.get("error", "")), str(body.get("detail", response.text))
    except ValueError:
        code, detail = "", response.text[:500]
    raise error_for(response.status_code, code, detail)


def error_for(status: int, code: str, detail: str) -> Exception:
    """The typed error an answer with this status and error code means."""
    if status >= 500:
        return ServiceUnavailableError(f"service answered {status}: {detail}")
    if status == 409 and code == "fenced":
        return FencedError(detail)
    if status == 409:
        return CommitConflictError(detail)
    if status == 404:
        return CheckpointNotFoundError(detail)
    return RequestRejectedError(status, code or "invalid", detail)


@dataclass(frozen=True)
class Commit:
    """A copy to record: the core's reference, its tier and the metrics to keep with it."""

    ref: CheckpointRef
    tier: Tier = "durable"
    metrics: dict[str, float] = field(default_factory=dict)


def commit_request(commit: Commit) -> CommitRequest:
    ref = commit.ref
    return CommitRequest(
        epoch=ref.position.epoch,
        batch=ref.position.batch,
        attempt=ref.attempt,
        step=ref.manifest.step,
        location=ref.location,
        bytes=ref.bytes,
        checksums=ref.checksums,
        metrics=commit.metrics,
        tier=commit.tier,
    )


def batches(commits: list[NodeCommit]) -> Iterator[list[NodeCommit]]:
    """Runs of at most COMMIT_BATCH_LIMIT commits and about BATCH_BYTES of JSON (the service's body limit is 1 MiB)."""
    chunk: list[NodeCommit] = []
    size = 0
    for commit in commits:
        length = len(commit.model_dump_json())
        if chunk and (len(chunk) == COMMIT_BATCH_LIMIT or size + length > BATCH_BYTES):
            yield chunk
            chunk, size = [], 0
        chunk.append(commit)
        size += length
    if chunk:
        yield chunk


def answer(outcome: CommitOutcome) -> CheckpointRecord | Exception:
    if outcome.record is not None:
        return outcome.record
    error = outcome.error
    return error_for(outcome.status, error.error if error else "", error.detail if error else "no record")
