"""Webhooks: subscribe a URL to event types (admin token); see each delivery's tries."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Path, Query, Response
from sqlalchemy import select
from sqlalchemy.orm import Session

from ckptstore.names import NAME_JSON_SCHEMA
from ckptstore.server.db.models import Delivery, Webhook
from ckptstore.server.deps import DbDep, SettingsDep
from ckptstore.server.errors import COMMON_ERRORS, ApiError, error_responses
from ckptstore.server.events.log import newest_event_id
from ckptstore.server.events.webhooks import check_webhook_url
from ckptstore.wire.events import DeliveryInfo, WebhookInfo, WebhookSpec

__all__ = ["router"]

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"], responses=COMMON_ERRORS | error_responses(403))
WebhookName = Annotated[str, Path(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", json_schema_extra=NAME_JSON_SCHEMA)]


def _info(hook: Webhook) -> WebhookInfo:
    shown = {name: getattr(hook, name) for name in ("name", "url", "events", "job", "created_at", "updated_at")}
    return WebhookInfo(delivered_through=hook.cursor, **shown)


@router.put("/{name}", status_code=201, response_model=WebhookInfo, responses={200: {"model": WebhookInfo}})
def put_webhook(
    name: WebhookName, body: WebhookSpec, db: DbDep, settings: SettingsDep, response: Response
) -> WebhookInfo:
    """Create or replace a webhook: events from now on (a new one) are POSTed to `url`, signed with
    `secret`. The URL's host must be in CKPTSTORE_WEBHOOK_HOSTS (403 otherwise)."""
    check_webhook_url(body.url, settings)
    now = time.time()
    with db.write() as session:
        hook = session.get(Webhook, name)
        created = hook is None
        if hook is None:
            hook = Webhook(name=name, cursor=newest_event_id(session), lease_until=0.0, created_at=now)
            session.add(hook)
        hook.url, hook.events, hook.job, hook.secret, hook.updated_at = (
            body.url,
            list(body.events),
            body.job,
            body.secret,
            now,
        )
        session.flush()
        response.status_code = 201 if created else 200
        return _info(hook)


@router.get("", response_model=list[WebhookInfo])
def list_webhooks(db: DbDep) -> list[WebhookInfo]:
    with db.read() as session:
        return [_info(h) for h in session.scalars(select(Webhook).order_by(Webhook.name))]


def _find(session: Session, name: str) -> Webhook:
    hook = session.get(Webhook, name)
    if hook is None:
        raise ApiError.not_found(f"no webhook {name!r}")
    return hook


@router.get("/{name}", response_model=WebhookInfo)
def get_webhook(name: WebhookName, db: DbDep) -> WebhookInfo:
    with db.read() as session:
        return _info(_find(session, name))


@router.delete("/{name}", status_code=204)
def delete_webhook(name: WebhookName, db: DbDep) -> Response:
    """Stop delivering (deliveries not made yet are dropped)."""
    with db.write() as session:
        session.delete(_find(session, name))
    return Response(status_code=204)


@router.get("/{name}/deliveries", response_model=list[DeliveryInfo])
def deliveries(name: WebhookName, db: DbDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[DeliveryInfo]:
    """The newest deliveries first: status (pending, delivered, failed), tries, the last error."""
    with db.read() as session:
        _find(session, name)
        rows = session.scalars(
            select(Delivery).where(Delivery.webhook == name).order_by(Delivery.event_id.desc()).limit(limit)
        )
        return [
            DeliveryInfo(
                event_id=row.event_id,
                type=row.type,
                status=row.status,
                attempts=row.attempts,
                last_error=row.last_error,
                last_attempt_at=row.last_attempt_at,
                next_attempt_at=row.next_attempt_at if row.status == "pending" else None,
                delivered_at=row.delivered_at,
            )
            for row in rows
        ]
