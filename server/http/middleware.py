"""ASGI middleware: the request body limit, and request metrics + logs (auth: server/http/auth.py).

Logs carry method, route, status and latency — never headers, bodies or storage credentials.
"""

from __future__ import annotations

import json
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckptstore.server.errors import send_error
from ckptstore.server.metrics import METRICS

__all__ = ["BodyLimit", "RequestMetrics"]

log = logging.getLogger("ckptstore.server")


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
