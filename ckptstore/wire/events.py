"""Events on the wire: their types, the event body, webhook subscriptions and deliveries, and the
webhook signature (made by the service, checked by receivers with `verify_signature`)."""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from ckptstore.wire.schema import Name, PositionBody

__all__ = [
    "EventType",
    "EVENT_TYPES",
    "Event",
    "EventPage",
    "WebhookSpec",
    "WebhookInfo",
    "DeliveryInfo",
    "sign",
    "verify_signature",
    "SIGNATURE_TOLERANCE_S",
]

EventType = Literal[
    "job.declared",
    "job.updated",
    "job.deleted",
    "attempt.started",
    "resume.audited",
    "checkpoint.committed",
    "position.good",
    "copy.marked",
    "replicas.disagreed",
    "replication.done",
    "replication.lagging",
    "health.changed",
    "node.fenced",
    "checkpoint.requested",
    "retention.deleted",
]
EVENT_TYPES: tuple[str, ...] = get_args(EventType)
SIGNATURE_TOLERANCE_S = 300.0


class Event(BaseModel):
    """One change the service recorded. `id` grows with every event (commit order); `job`, `node` and
    `position` are set where they apply; `data` depends on `type` (docs/rest.md, "Events")."""

    id: int
    type: EventType
    time: float
    job: str | None = None
    node: str | None = None
    position: PositionBody | None = None
    data: dict[str, Any] = Field(default_factory=dict)


class EventPage(BaseModel):
    """`GET /v1/events?format=json`: events after `after`, the id to ask after next, and whether
    events after `after` already left the log (`reset`: they are lost to this reader)."""

    events: list[Event]
    last_id: int
    reset: bool


class WebhookSpec(BaseModel):
    """PUT /v1/webhooks/{name}: where to POST which events (of one job, or of every job), and the
    secret their signatures are made with."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=1, max_length=2048)
    events: list[EventType] = Field(min_length=1, max_length=len(EVENT_TYPES))
    job: Name | None = None
    secret: str = Field(min_length=16, max_length=256)


class WebhookInfo(BaseModel):
    """A webhook as the service answers it: never its secret."""

    name: str
    url: str
    events: list[EventType]
    job: str | None
    delivered_through: int  # events up to this id were delivered or given up on
    created_at: float
    updated_at: float


class DeliveryInfo(BaseModel):
    event_id: int
    type: EventType
    status: Literal["pending", "delivered", "failed"]
    attempts: int
    last_error: str | None
    last_attempt_at: float | None
    next_attempt_at: float | None
    delivered_at: float | None


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """The `X-Ckptstore-Signature` value: `sha256=` + hex HMAC-SHA256(secret, "<timestamp>.<body>")."""
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def verify_signature(
    secret: str, timestamp: str | None, body: bytes, signature: str | None, *, now: float | None = None
) -> bool:
    """Whether a delivery is genuine: the signature matches (compared in constant time) and the
    timestamp is within SIGNATURE_TOLERANCE_S of `now` (a replayed old delivery fails)."""
    if not (isinstance(timestamp, str) and isinstance(signature, str) and timestamp.isascii() and signature.isascii()):
        return False  # a missing or non-ASCII header is a forged request, not an error
    try:
        age = abs((time.time() if now is None else now) - float(timestamp))
    except ValueError:
        return False
    expected = sign(secret, timestamp, body).encode()
    return age <= SIGNATURE_TOLERANCE_S and hmac.compare_digest(expected, signature.encode())
