"""What goes over the wire for `ServiceClient`, and back: error answers as typed errors, commit
bodies, and commits split into batch requests the service accepts."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import httpx

from ckptstore.errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    FencedError,
    RequestRejectedError,
    ServiceUnavailableError,
)
from ckptstore.report import CheckpointRef
from ckptstore.wire.schema import COMMIT_BATCH_LIMIT, CheckpointRecord, CommitOutcome, NodeCommit

__all__ = ["recordable", "Commit", "raise_for", "error_for", "commit_request", "batches", "answer", "BATCH_BYTES"]

log = logging.getLogger("ckptstore.client")
BATCH_BYTES = 256 * 1024


def recordable(metrics: Mapping[str, float]) -> dict[str, float]:
    """The metrics that can be recorded: JSON has no NaN or infinity, so those are left out, said once each."""
    kept = {}
    for name, value in metrics.items():
        if math.isfinite(value):
            kept[name] = float(value)
        else:
            log.warning("metric %r is %s: not recorded (JSON has no such number); the checkpoint is saved", name, value)
    return kept


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
    """A copy to record (`ref.key` names it, tier included) and the metrics to keep with it."""

    ref: CheckpointRef
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, ref: CheckpointRef) -> Commit:
        """The commit of a copy found on storage, with the metrics its manifest carries."""
        metrics = ref.manifest.metadata.get("metrics", {})
        numbers = metrics.items() if isinstance(metrics, dict) else ()
        return cls(ref, {k: float(v) for k, v in numbers if isinstance(v, (int, float)) and not isinstance(v, bool)})


def commit_request(commit: Commit) -> NodeCommit:
    """The wire body of one commit (its node named, as the batch route takes it)."""
    ref = commit.ref
    return NodeCommit(
        node=ref.key.node,
        epoch=ref.key.position.epoch,
        batch=ref.key.position.batch,
        attempt=ref.key.attempt,
        step=ref.manifest.step,
        location=ref.location,
        bytes=ref.bytes,
        checksums=ref.checksums,
        metrics=commit.metrics,
        tier=ref.key.tier,
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
