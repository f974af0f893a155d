"""Cross-site requests and DNS rebinding: which Host names the service answers, and which requests
may change state.

A web page the operator visits can make the browser send requests to the service — the service
cannot tell them from the operator's own unless it checks. So:
- A request whose `Host` is not an accepted name is refused (400). Bound to loopback with no token,
  the default accepts loopback names only, so a DNS name rebound to 127.0.0.1 gets nothing.
- A request that changes state (POST, PUT, PATCH, DELETE) with an `Origin` header naming another
  origin than the `Host` it was sent to is refused (403): browsers send `Origin` on every
  cross-origin non-GET request (a sandboxed page's `null` included).
- POST, PUT and PATCH under /v1 must say `Content-Type: application/json` (422 otherwise): a
  "simple" cross-site request (form-encoded or text/plain, which needs no CORS preflight) cannot.
The dashboard's own sign-in form posts form-encoded data same-site, which the Origin rule admits.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from ckptstore.server.errors import send_error

__all__ = ["RequestGuard", "LOOPBACK_NAMES", "host_name"]

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})


def host_name(host: str) -> str:
    """The name part of a Host header value (no port; IPv6 without brackets), lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class RequestGuard:
    """Enforces the rules of the module docstring; `allowed_hosts` None accepts any Host."""

    def __init__(self, app: ASGIApp, allowed_hosts: frozenset[str] | None):
        self.app = app
        self.allowed_hosts = allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        host = host_name(headers.get("host", ""))
        if self.allowed_hosts is not None and host not in self.allowed_hosts:
            await send_error(send, 400, "invalid", "this Host is not served here (CKPTSTORE_TRUSTED_HOSTS)")
            return
        method = scope["method"]
        if method in _STATE_CHANGING:
            origin = headers.get("origin")
            if origin is not None and urlsplit(origin).netloc.lower() != headers.get("host", "").strip().lower():
                await send_error(send, 403, "forbidden", "cross-site requests may not change anything")
                return
            content_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if method in _WITH_BODY and scope["path"].startswith("/v1/") and content_type != "application/json":
                await send_error(send, 422, "invalid", "requests that change state must send application/json")
                return
        await self.app(scope, receive, send)
