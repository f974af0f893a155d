"""Webhook deliveries: each webhook's events are POSTed in log order, signed, at least once.

A webhook keeps a cursor in the database (every event up to it was delivered, or given up on
after `webhook_retry_seconds`); the event after it is retried with exponential backoff until it is
delivered, so deliveries stay in order and a service restart resumes where the last one stopped.
One service process at a time delivers a given webhook: it holds a lease row that it renews while
working and releases on shutdown (another process takes over once a dead one's lease runs out).
The same thread trims the event log to its window.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from urllib.parse import urlsplit

import httpx
from sqlalchemy import delete, or_, select, update
from sqlalchemy.orm import Session

from ckptstore.events import Event, sign
from server.db import Database
from server.errors import ApiError
from server.events import events_after, prune
from server.models import Delivery, Webhook
from server.settings import Settings

__all__ = ["WebhookDispatcher", "check_webhook_url", "LEASE_SECONDS", "backoff_seconds"]

log = logging.getLogger("ckptstore.server")
LEASE_SECONDS = 15.0
MAX_BACKOFF_S = 300.0
PRUNE_EVERY_S = 60.0


def check_webhook_url(url: str, settings: Settings) -> str:
    """`url` if it is http(s) to a host `CKPTSTORE_WEBHOOK_HOSTS` lists (host or host:port); else 403."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ApiError.invalid("a webhook URL is http:// or https:// with a host")
    allowed = settings.webhook_host_list
    names = {parts.hostname.lower(), f"{parts.hostname.lower()}:{parts.port}" if parts.port else ""}
    if not allowed or not names & allowed:
        raise ApiError(
            403, "forbidden", f"webhooks may not target {parts.hostname!r}: it is not in CKPTSTORE_WEBHOOK_HOSTS"
        )
    return url


def backoff_seconds(attempts: int) -> float:
    """Wait before try number `attempts` + 1: 1 s, 2 s, 4 s, ... up to MAX_BACKOFF_S."""
    return min(2.0 ** max(attempts - 1, 0), MAX_BACKOFF_S)


class WebhookDispatcher:
    """This process's delivery thread (see module docstring)."""

    def __init__(self, db: Database, settings: Settings):
        self.db, self.settings = db, settings
        self.owner = uuid.uuid4().hex
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._http = httpx.Client(timeout=settings.webhook_timeout_seconds, follow_redirects=False)
        self._pruned_at = 0.0
        self._thread = threading.Thread(target=self._run, name="ckptstore-webhooks", daemon=True)
        self._thread.start()

    def wake(self, _newest: int | None = None) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        try:
            with self.db.write() as session:
                session.execute(update(Webhook).where(Webhook.lease_owner == self.owner).values(lease_until=0.0))
        except self.db.errors as exc:  # the database is away: the lease simply runs out
            log.warning("could not release webhook leases: %s", type(exc).__name__)
        self._http.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            busy = False
            try:
                self._trim_log()
                for name in self._leased_webhooks():
                    busy |= self._deliver_next(name)
            except self.db.errors as exc:
                log.warning("webhook deliveries paused: database error %s", type(exc).__name__)
            if not busy:
                self._wake.wait(timeout=self.settings.webhook_poll_seconds)
                self._wake.clear()

    def _trim_log(self) -> None:
        now = time.time()
        if now - self._pruned_at < PRUNE_EVERY_S:
            return
        self._pruned_at = now
        keep = self.settings.events_keep_seconds
        with self.db.write() as session:
            dropped = prune(session, keep_seconds=keep, keep_rows=self.settings.events_keep_rows, now=now)
            session.execute(delete(Delivery).where(Delivery.next_attempt_at < now - keep, Delivery.status != "pending"))
        if dropped:
            log.info("event log: %d events older than its window dropped", dropped)

    def _leased_webhooks(self) -> list[str]:
        """The webhooks this process delivers now: free leases taken, its own renewed when half run out
        (a write only then: with no webhook, polling costs one read)."""
        now = time.time()
        with self.db.read() as session:
            leases = session.execute(select(Webhook.name, Webhook.lease_owner, Webhook.lease_until)).all()
        mine = [name for name, owner, until in leases if owner == self.owner and until > now + LEASE_SECONDS / 2]
        due = [name for name, owner, until in leases if until < now or (owner == self.owner and name not in mine)]
        if not due:
            return mine
        with self.db.write() as session:
            session.execute(
                update(Webhook)
                .where(Webhook.name.in_(due), or_(Webhook.lease_owner == self.owner, Webhook.lease_until < now))
                .values(lease_owner=self.owner, lease_until=now + LEASE_SECONDS)
            )
            return list(session.scalars(select(Webhook.name).where(Webhook.lease_owner == self.owner)))

    def _deliver_next(self, name: str) -> bool:
        """Try the webhook's next event, if one is due; whether there was work (more may follow)."""
        now = time.time()
        with self.db.write() as session:
            hook = session.get(Webhook, name)
            if hook is None or hook.lease_owner != self.owner:
                return False
            event = self._next_event(session, hook)
            if event is None:
                return False
            delivery = session.get(Delivery, (name, event.id))
            if delivery is None:
                delivery = Delivery(
                    webhook=name, event_id=event.id, type=event.type, status="pending", attempts=0, next_attempt_at=now
                )
                session.add(delivery)
            if delivery.next_attempt_at > now:
                return False
            url, secret = hook.url, hook.secret
        error = self._post(url, secret, event)
        with self.db.write() as session:
            hook, delivery = session.get(Webhook, name), session.get(Delivery, (name, event.id))
            if hook is None or delivery is None:  # deleted meanwhile
                return False
            self._record(hook, delivery, event, error, time.time())
        return error is None

    def _next_event(self, session: Session, hook: Webhook) -> Event | None:
        """The first event after the cursor this webhook wants; the cursor moves past the others."""
        wanted = frozenset(hook.events)
        while True:
            events = events_after(session, hook.cursor, job=hook.job, limit=200)
            for event in events:
                if event.type in wanted:
                    return event
                hook.cursor = event.id
            if len(events) < 200:
                return None

    def _post(self, url: str, secret: str, event: Event) -> str | None:
        """POST the signed event; None when the receiver took it (2xx), else what went wrong."""
        try:
            check_webhook_url(url, self.settings)
        except ApiError as exc:
            return exc.detail
        body = event.model_dump_json().encode()
        timestamp = str(int(time.time()))
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "ckptstore-webhooks",
            "X-Ckptstore-Event": event.type,
            "X-Ckptstore-Delivery": str(event.id),
            "X-Ckptstore-Timestamp": timestamp,
            "X-Ckptstore-Signature": sign(secret, timestamp, body),
        }
        try:
            response = self._http.post(url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"[:500]
        if response.is_success:
            return None
        return f"receiver answered {response.status_code}"

    def _record(self, hook: Webhook, delivery: Delivery, event: Event, error: str | None, now: float) -> None:
        delivery.attempts += 1
        delivery.last_attempt_at = now
        if error is None:
            delivery.status, delivery.delivered_at, delivery.last_error = "delivered", now, None
            hook.cursor = event.id
            return
        delivery.last_error = error
        if now - event.time > self.settings.webhook_retry_seconds:
            delivery.status = "failed"
            hook.cursor = event.id  # given up on: the next event's turn
            log.warning(
                "webhook %s: event %d given up after %d tries: %s", hook.name, event.id, delivery.attempts, error
            )
        else:
            delivery.next_attempt_at = now + backoff_seconds(delivery.attempts)
