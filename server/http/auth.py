"""Who may do what: bearer tokens for the REST API, and the dashboard's session cookie.

The admin token (`CKPTSTORE_TOKEN`) reaches every route; a job's token (`CKPTSTORE_JOB_TOKENS`)
reaches only `/v1/jobs/<job>` and below (403 elsewhere). Every route but /healthz and /readyz is
protected, so a new route is protected by default. Tokens are compared with
`hmac.compare_digest`, every one of them, every time, so timing does not tell which matched.
The dashboard's pages (`/`, `/ui/…`) authenticate by session cookie instead (a browser cannot send a
bearer header on navigation): with any token configured — admin or per-job — the dashboard is
closed until a sign-in; a job token's session sees only its job. A session cookie holds its scope,
expiry and a nonce, signed with a key derived from the tokens — never a token; it expires after
`CKPTSTORE_SESSION_SECONDS` and signing out revokes its nonce in the database (every replica
sees it).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from http.cookies import SimpleCookie

from fastapi import Request
from sqlalchemy import delete
from starlette.types import ASGIApp, Receive, Scope, Send

from ckptstore.server.db.engine import Database
from ckptstore.server.db.models import RevokedSession
from ckptstore.server.errors import send_error
from ckptstore.server.settings import Settings

__all__ = [
    "OPEN_PATHS",
    "SESSION_COOKIE",
    "TokenAuth",
    "LoginRequired",
    "NotYourJob",
    "Viewer",
    "EVERYONE",
    "Session",
    "is_dashboard_path",
    "scope_of",
    "new_session",
    "read_session",
    "session_cookie",
    "require_session",
    "session_revoked",
    "revoke_session",
    "admin_token",
]

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
SESSION_COOKIE = "ckptstore_session"


def is_dashboard_path(path: str) -> bool:
    """The web dashboard's routes, which authenticate by session cookie."""
    return path == "/" or path.startswith("/ui/")


class TokenAuth:
    """With tokens configured, REST requests must carry `Authorization: Bearer <token>` (see module docstring)."""

    def __init__(self, app: ASGIApp, token: str | None, job_tokens: dict[str, str] | None = None):
        self.app = app
        self.token = token.encode() if token else None
        self.job_tokens = {job: secret.encode() for job, secret in (job_tokens or {}).items()}
        self.enabled = self.token is not None or bool(self.job_tokens)

    def _job_of(self, supplied: bytes) -> str | None:
        """The job whose token `supplied` is (all compared, so timing does not tell which matched)."""
        matched = None
        for job, secret in self.job_tokens.items():
            if hmac.compare_digest(supplied, secret):
                matched = job
        return matched

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if not self.enabled or scope["type"] != "http" or path in OPEN_PATHS or is_dashboard_path(path):
            await self.app(scope, receive, send)
            return
        supplied = b""
        for name, value in scope["headers"]:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                supplied = value[7:].strip()
        if self.token is not None and hmac.compare_digest(supplied, self.token):
            await self.app(scope, receive, send)
            return
        job = self._job_of(supplied) if supplied else None
        if job is None:
            await send_error(
                send, 401, "unauthorized", "a valid bearer token is required", {"WWW-Authenticate": "Bearer"}
            )
            return
        # The caller is that job's token holder: the event stream shows only its job's events
        # (server/routes/events.py), a fork's declaration needs a right to its parent (routes/jobs.py).
        scope.setdefault("state", {})["token_job"] = job
        if path != "/v1/events" and not (path == f"/v1/jobs/{job}" or path.startswith(f"/v1/jobs/{job}/")):
            await send_error(send, 403, "forbidden", "this token is for another job")
            return
        await self.app(scope, receive, send)


class LoginRequired(Exception):
    """A page was asked for without a valid session while a token is configured."""


class NotYourJob(Exception):
    """A session scoped to one job asked for another job's page."""


@dataclass(frozen=True)
class Viewer:
    """Who a dashboard request comes from: every job (the admin token, or no token configured), or
    the one job whose token signed in."""

    job: str | None

    def may_see(self, job: str) -> bool:
        return self.job is None or self.job == job


EVERYONE = Viewer(None)


def admin_token(settings: Settings) -> str | None:
    return settings.token.get_secret_value() if settings.token else None


def _session_key(settings: Settings) -> bytes:
    """The key sessions are signed with: derived from every configured token, so changing or
    removing a token ends the sessions it opened (and every replica derives the same key)."""
    material = [admin_token(settings) or ""] + sorted(
        f"{j}={t.get_secret_value()}" for j, t in settings.job_tokens.items()
    )
    return hashlib.sha256(b"ckptstore dashboard session\0" + "\0".join(material).encode()).digest()


def _sign(settings: Settings, payload: str) -> str:
    return hmac.new(_session_key(settings), payload.encode(), hashlib.sha256).hexdigest()


def scope_of(settings: Settings, supplied: str) -> Viewer | None:
    """The viewer a token signs in as: every job for the admin token, its job for a job token."""
    matched = None
    admin = admin_token(settings)
    if admin is not None and hmac.compare_digest(supplied.encode(), admin.encode()):
        matched = EVERYONE
    for job, secret in settings.job_tokens.items():  # all compared, so timing does not tell which matched
        if hmac.compare_digest(supplied.encode(), secret.get_secret_value().encode()):
            matched = matched or Viewer(job)
    return matched


def new_session(settings: Settings, viewer: Viewer, now: float) -> str:
    """A cookie value `<scope>.<expires>.<nonce>.<signature>`: no token in it, valid until it expires
    or is signed out (its nonce revoked)."""
    payload = f"{viewer.job or '*'}.{int(now + settings.session_seconds)}.{secrets.token_hex(16)}"
    return f"{payload}.{_sign(settings, payload)}"


@dataclass(frozen=True)
class Session:
    viewer: Viewer
    expires: int
    nonce: str


def read_session(settings: Settings, value: str, now: float) -> Session | None:
    """The session a cookie value stands for, if its signature holds, it has not expired, and its
    job still has a token (revocation is checked by the caller, against the database)."""
    parts = value.rsplit(".", 3)
    if len(parts) != 4 or not parts[1].isdigit():
        return None
    scope, expires, nonce, signature = parts
    if not hmac.compare_digest(signature.encode(), _sign(settings, f"{scope}.{expires}.{nonce}").encode()):
        return None
    viewer = EVERYONE if scope == "*" else Viewer(scope)
    if int(expires) <= now or (viewer.job is not None and viewer.job not in settings.job_tokens):
        return None
    return Session(viewer, int(expires), nonce)


def session_cookie(request: Request) -> str:
    cookie: SimpleCookie = SimpleCookie(request.headers.get("cookie", ""))
    return cookie[SESSION_COOKIE].value if SESSION_COOKIE in cookie else ""


def session_revoked(db: Database, nonce: str) -> bool:
    with db.read() as session:
        return session.get(RevokedSession, nonce) is not None


def revoke_session(db: Database, signed_in: Session, now: float) -> None:
    """Sign out: the session's nonce is refused from now on (rows go once the session would have expired)."""
    with db.write() as session:
        session.execute(delete(RevokedSession).where(RevokedSession.expires_at < now))
        if session.get(RevokedSession, signed_in.nonce) is None:
            session.add(RevokedSession(nonce=signed_in.nonce, expires_at=float(signed_in.expires)))


async def require_session(request: Request) -> Viewer:
    """Dashboard dependency: with any token configured, every page and asset but the sign-in form needs a
    live session; the viewer it returns decides which jobs the pages show."""
    settings: Settings = request.app.state.settings
    if not settings.has_tokens or request.url.path == "/ui/login":
        return EVERYONE
    session = read_session(settings, session_cookie(request), time.time())
    if session is None or await asyncio.to_thread(session_revoked, request.app.state.db, session.nonce):
        raise LoginRequired()
    return session.viewer
