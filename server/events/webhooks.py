"""Webhook deliveries: each webhook's events are POSTed in log order, signed, at least once.

A webhook keeps a cursor in the database (every event up to it was delivered, or given up on
after `webhook_retry_seconds`); the event after it is retried with exponential backoff until it is
delivered, so deliveries stay in order and a service restart resumes where the last one stopped.
One service process at a time delivers a given webhook: it holds a lease row that it renews while
working and releases on shutdown (another process takes over once a dead one's lease runs out).

Webhooks never wait for each other: each leased webhook's next delivery runs on a pool thread (one
in flight per webhook, so its order holds), and each POST has a total deadline
(`webhook_timeout_seconds`) whatever the receiver does — a receiver that trickles its answer is cut
off at it, and no answer's body is ever read. The dispatcher's own thread hands out deliveries
and trims the event log: events a webhook has not been given yet stay (up to
`events_keep_undelivered_rows`); past that bound they go, and each one a webhook wanted is recorded
as a `failed` delivery saying why.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.orm import Session

from ckptstore.server.db.engine import Database
from ckptstore.server.db.models import Delivery, Webhook
from ckptstore.server.errors import ApiError
from ckptstore.server.events.log import events_after, out_of_window, prune
from ckptstore.server.settings import Settings
from ckptstore.wire.events import Event, sign

__all__ = ["WebhookDispatcher", "check_webhook_url", "LEASE_SECONDS", "backoff_seconds"]

log = logging.getLogger("ckptstore.server")
# httpx and httpcore log every request at INFO with the whole URL — a webhook's path and query are
# its receiver's secrets. In the service's process they say warnings only; ours name the webhook.
for _chatty in ("httpx", "httpcore"):
    logging.getLogger(_chatty).setLevel(logging.WARNING)
LEASE_SECONDS = 15.0
MAX_BACKOFF_S = 300.0
PRUNE_EVERY_S = 60.0
DELIVERY_THREADS = 8
TRIMMED = "trimmed from the event log before it was delivered (CKPTSTORE_EVENTS_KEEP_UNDELIVERED_ROWS)"


def check_webhook_url(url: str, settings: Settings) -> str:
    """`url` if it is http(s) to a host `CKPTSTORE_WEBHOOK_HOSTS` lists (host or host:port), else 403;
    422 for a URL that does not parse plainly: non-ASCII, a bad port or IPv6 host, or credentials
    (`user:pw@`: they would reach logs, and parsers disagree on where such a host ends)."""
    if not url.isascii():
        raise ApiError.invalid("a webhook URL is ASCII (punycode a host name, percent-encode a path)")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (parsing it is the check: a bad port raises)
    except ValueError as exc:
        raise ApiError.invalid(f"the webhook URL does not parse: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ApiError.invalid("a webhook URL is http:// or https:// with a host")
    if "@" in parts.netloc or "\\" in url:
        raise ApiError.invalid("a webhook URL may not carry credentials (user:password@host): use its secret")
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
        self._pool = ThreadPoolExecutor(DELIVERY_THREADS, thread_name_prefix="ckptstore-webhook")
        self._in_flight: dict[str, Future[bool]] = {}  # one delivery at a time per webhook: its order holds
        self._pruned_at = 0.0
        self._thread = threading.Thread(target=self._run, name="ckptstore-webhooks", daemon=True)
        self._thread.start()

    def wake(self, _newest: int | None = None) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        self._pool.shutdown(wait=True, cancel_futures=True)
        try:
            with self.db.write() as session:
                session.execute(update(Webhook).where(Webhook.lease_owner == self.owner).values(lease_until=0.0))
        except self.db.errors as exc:  # the database is away: the lease simply runs out
            log.warning("could not release webhook leases: %s", type(exc).__name__)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if time.time() - self._pruned_at >= PRUNE_EVERY_S:
                    self.trim_log()
                for name in self._leased_webhooks():
                    if name not in self._in_flight:
                        future = self._in_flight[name] = self._pool.submit(self._deliver_next, name)
                        future.add_done_callback(functools.partial(self._delivered, name))
            except self.db.errors as exc:
                log.warning("webhook deliveries paused: database error %s", type(exc).__name__)
            self._wake.wait(timeout=self.settings.webhook_poll_seconds)
            self._wake.clear()

    def _delivered(self, name: str, done: Future[bool]) -> None:
        """A delivery ended: the webhook may take its next one (at once, when there was work)."""
        self._in_flight.pop(name, None)
        if done.cancelled():
            return
        error = done.exception()
        if error is not None:
            log.warning("webhook %s: delivery failed: %s", name, type(error).__name__)
        elif done.result():
            self._wake.set()

    def trim_log(self, now: float | None = None) -> int:
        """Trim the event log to its window, keeping what a webhook has not been given yet (up to
        `events_keep_undelivered_rows`); each event trimmed past that bound that a webhook wanted
        is recorded as its `failed` delivery, saying why. Returns the events dropped."""
        now = time.time() if now is None else now
        self._pruned_at = now
        keep = self.settings.events_keep_seconds
        with self.db.write() as session:
            through = out_of_window(
                session,
                keep_seconds=keep,
                keep_rows=self.settings.events_keep_rows,
                now=now,
                keep_after=session.scalar(select(func.min(Webhook.cursor))),
                most_rows=self.settings.events_keep_undelivered_rows,
            )
            lost = self._fail_undelivered(session, through, now)
            dropped = prune(session, through)
            session.execute(delete(Delivery).where(Delivery.next_attempt_at < now - keep, Delivery.status != "pending"))
        if dropped:
            log.info("event log: %d events older than its window dropped", dropped)
        if lost:
            log.warning("event log: %d events trimmed before their webhooks had them: marked failed", lost)
        return dropped

    def _fail_undelivered(self, session: Session, through: int, now: float) -> int:
        """Before the log drops events up to `through`: each one a webhook wanted and has not been given
        becomes a `failed` delivery (TRIMMED), and the webhook goes on after them. How many."""
        lost = 0
        for hook in session.scalars(select(Webhook).where(Webhook.cursor < through)):
            wanted = frozenset(hook.events)
            while True:
                page = [e for e in events_after(session, hook.cursor, job=hook.job, limit=200) if e.id <= through]
                for event in page:
                    hook.cursor = event.id
                    if event.type not in wanted:
                        continue
                    lost += 1
                    delivery = session.get(Delivery, (hook.name, event.id)) or Delivery(
                        webhook=hook.name, event_id=event.id, type=event.type, attempts=0, next_attempt_at=now
                    )
                    delivery.status, delivery.last_error = "failed", TRIMMED
                    session.add(delivery)
                if len(page) < 200:
                    break
            hook.cursor = max(hook.cursor, through)
        return lost

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
        """POST the signed event; None when the receiver took it (2xx), else what went wrong. The POST
        has a total deadline (`webhook_timeout_seconds`): past it, its connection is closed under it;
        the answer's body is never read."""
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
        deadline = self.settings.webhook_timeout_seconds
        client = httpx.Client(timeout=deadline, follow_redirects=False)
        answered: list[int | Exception] = []

        def send() -> None:
            try:
                with client.stream("POST", url, content=body, headers=headers) as response:
                    answered.append(response.status_code)
            except httpx.HTTPError as exc:
                answered.append(exc)

        sender = threading.Thread(target=send, name="ckptstore-webhook-post", daemon=True)
        sender.start()
        sender.join(deadline)
        client.close()  # cuts a receiver off mid-answer: its connection goes
        if not answered:
            return f"no answer within {deadline:g} s"
        status = answered[0]
        if isinstance(status, Exception):
            return f"{type(status).__name__}: {status}"[:500]
        return None if 200 <= status < 300 else f"receiver answered {status}"

    def _record(self, hook: Webhook, delivery: Delivery, event: Event, error: str | None, now: float) -> None:
        delivery.attempts += 1
        delivery.last_attempt_at = now
        if error is None:
            delivery.status, delivery.delivered_at, delivery.last_error = "delivered", now, None
            hook.cursor = max(hook.cursor, event.id)  # a trim meanwhile may have moved it further
            return
        if delivery.status == "failed":
            return  # trimmed from the log while this try was in flight: that stays its reason
        delivery.last_error = error
        if now - event.time > self.settings.webhook_retry_seconds:
            delivery.status = "failed"
            hook.cursor = max(hook.cursor, event.id)  # given up on: the next event's turn
            log.warning(
                "webhook %s: event %d given up after %d tries: %s", hook.name, event.id, delivery.attempts, error
            )
        else:
            delivery.next_attempt_at = now + backoff_seconds(delivery.attempts)
