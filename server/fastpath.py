"""The hot read path: cached last-good answers served before FastAPI routing.

Sits innermost (auth, body limit, trusted hosts and metrics still wrap it). On a cache hit for
`GET /v1/jobs/{job}/last-good-epoch[?max_epoch=N]` whose job version is unchanged, it answers with
the cached bytes; anything else — a miss, a bad name, other parameters, a database error — goes to
the FastAPI route, which computes the answer and fills the cache (or answers the error).
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Receive, Scope, Send

from ckptstore.errors import InvalidNameError
from ckptstore.names import validate_name
from server.metrics import METRICS

__all__ = ["LastGoodFastPath", "LAST_GOOD_ROUTE"]

LAST_GOOD_ROUTE = "/v1/jobs/{job}/last-good-epoch"
_PATH = re.compile(r"/v1/jobs/([^/]+)/last-good-epoch\Z")
_QUERY = re.compile(rb"(?:max_epoch=([0-9]{1,10}))?\Z")
_HEADERS = [(b"content-type", b"application/json")]


class LastGoodFastPath:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET":
            body = self._cached(scope)
            if body is not None:
                METRICS.last_good_queries.inc()
                scope["ckptstore_route"] = LAST_GOOD_ROUTE
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": _HEADERS + [(b"content-length", str(len(body)).encode())],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)

    @staticmethod
    def _cached(scope: Scope) -> bytes | None:
        path = _PATH.match(scope["path"])
        query = _QUERY.match(scope["query_string"])
        if path is None or query is None:
            return None
        try:  # scope["path"] is decoded once already, as the route's path parameter is
            job = validate_name(path.group(1), kind="job")
        except InvalidNameError:
            return None
        max_epoch = None if query.group(1) is None else int(query.group(1))
        state = scope["app"].state
        try:
            version = state.versions.version(job)
        except state.db.errors:  # the database is away: the route answers (503) through the app's handlers
            return None
        return None if version is None else state.answers.get((job, max_epoch), version)
