"""ASGI middleware: bearer-token auth, request body limit, and request metrics + logs.

Auth protects every route but /healthz and /readyz, so a new route is protected by default. The
dashboard's pages (`/`, `/ui/…`) check their own session cookie instead (server/ui.py): a browser
cannot send a bearer header on navigation.
Logs carry method, route, status and latency — never headers, bodies or storage credentials.
"""

from __future__ import annotations

import hmac
import json
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.metrics import METRICS

__all__ = ["TokenAuth", "BodyLimit", "RequestMetrics", "OPEN_PATHS", "is_dashboard_path"]

OPEN_PATHS = frozenset({"/healthz", "/readyz"})


def is_dashboard_path(path: str) -> bool:
    """The web dashboard's routes, which authenticate by session cookie (server/ui.py)."""
    return path == "/" or path.startswith("/ui/")


log = logging.getLogger("ckptstore.server")


async def send_error(send: Send, status: int, code: str, detail: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"error": code, "detail": detail}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
    METRICS.refused.labels(code).inc()


class TokenAuth:
    """With tokens configured, requests must carry `Authorization: Bearer <token>`.

    The admin token reaches every route; a job's token reaches only `/v1/jobs/<job>` and below
    (403 elsewhere). Tokens are compared with `hmac.compare_digest`, every one of them, every time.
    """

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
        if not (path == f"/v1/jobs/{job}" or path.startswith(f"/v1/jobs/{job}/")):
            await send_error(send, 403, "forbidden", "this token is for another job")
            return
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuse request bodies over `limit` bytes with 413, whether declared or streamed."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and (not value.isdigit() or int(value) > self.limit):
                await send_error(send, 413, "too_large", f"request bodies are limited to {self.limit} bytes")
                return
        received = 0
        answered = False

        async def limited() -> Message:
            nonlocal received, answered
            message = await receive()
            if message["type"] == "http.request" and not answered:
                received += len(message.get("body", b""))
                if received > self.limit:
                    # Answer now; the app sees a disconnect and whatever it sends is dropped below.
                    answered = True
                    await send_error(send, 413, "too_large", f"request bodies are limited to {self.limit} bytes")
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not answered:
                await send(message)

        try:
            await self.app(scope, limited, guarded_send)
        except Exception:
            if not answered:
                raise


class RequestMetrics:
    """Count and time requests by route template (not raw path, which would leak names into labels)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def capture(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            template = scope.get("ckptstore_route") or getattr(scope.get("route"), "path", "unmatched")
            elapsed = time.perf_counter() - started
            METRICS.requests.labels(scope["method"], template, str(status)).inc()
            METRICS.latency.labels(scope["method"], template).observe(elapsed)
            if log.isEnabledFor(logging.INFO):
                log.info(
                    json.dumps(
                        {"method": scope["method"], "route": template, "status": status, "ms": round(elapsed * 1000, 2)}
                    )
                )
