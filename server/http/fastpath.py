"""The hot paths, answered before FastAPI routing: cached last-good answers, commits and attempt
registrations.

Both sit innermost (auth, body limit, trusted hosts and metrics still wrap them).
- `CachedReads`: on a cache hit for `GET /v1/jobs/{job}/last-good-epoch[?max_epoch=N][&node=N]` or
  `GET /v1/jobs/{job}` whose job version is unchanged, it answers with the cached bytes; anything
  else — a miss, a bad name, other parameters, a database error — goes to the FastAPI route, which
  computes the answer and fills the cache (or answers the error). Every node of a restart storm
  reads the job (33 KB of node names at 4,096 nodes) and its own part of the last-good answer.
- `WriteFastPath`: a well-formed `POST …/checkpoints/batch` (the Python client's only commit route),
  `…/nodes/{node}/checkpoints`, `…/attempts` or `…/start` runs the same entry point as its route
  (`ckptstore.server.records.writes`) in the group commit; a refusal is answered by the app's own exception handlers;
  `ckptstore_fast_path_total` counts what it answered. Anything it does not understand — a
  bad name, a body that does not validate, another content type, a bad Idempotency-Key — goes to
  the route with the body replayed, which answers it as always. Routing, dependency resolution
  and response re-validation were half of a commit's time on the event loop.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckptstore.errors import InvalidNameError
from ckptstore.names import NAME_PATTERN, validate_name
from ckptstore.server.metrics import METRICS
from ckptstore.server.records.batching import WriteBatcher
from ckptstore.server.records.writes import (
    IDEMPOTENCY_KEY,
    answer_start,
    commit_status,
    outcome,
    record_commits,
    register_attempt,
)
from ckptstore.wire.schema import AttemptRequest, CommitBatch, CommitOutcome, CommitRequest, NodeCommit, StartRequest

__all__ = [
    "CachedReads",
    "WriteFastPath",
    "JOB_ROUTE",
    "LAST_GOOD_ROUTE",
    "COMMIT_ROUTE",
    "BATCH_ROUTE",
    "ATTEMPT_ROUTE",
    "START_ROUTE",
]

JOB_ROUTE = "/v1/jobs/{job}"
LAST_GOOD_ROUTE = "/v1/jobs/{job}/last-good-epoch"
_JOB_PATH = re.compile(r"/v1/jobs/([^/]+)\Z")
_PATH = re.compile(r"/v1/jobs/([^/]+)/last-good-epoch\Z")
_NODE = NAME_PATTERN.encode()
_QUERY = re.compile(rb"(?:max_epoch=([0-9]{1,10})(?:&node=(%s))?|node=(%s))?\Z" % (_NODE, _NODE))
_HEADERS = [(b"content-type", b"application/json")]
_WRITE = re.compile(r"/v1/jobs/([^/]+)/(?:nodes/([^/]+)/(checkpoints|attempts|start)|checkpoints/(batch))\Z")
COMMIT_ROUTE = "/v1/jobs/{job}/nodes/{node}/checkpoints"
BATCH_ROUTE = "/v1/jobs/{job}/checkpoints/batch"
ATTEMPT_ROUTE = "/v1/jobs/{job}/nodes/{node}/attempts"
START_ROUTE = "/v1/jobs/{job}/nodes/{node}/start"
_KEY = re.compile(IDEMPOTENCY_KEY)
_JSON_TYPES = (
    b"application/json",
    b"application/json; charset=utf-8",
)  # others: the route (ckptstore.server.http.origin)
_OUTCOMES = TypeAdapter(list[CommitOutcome])
_Answer = tuple[int, bytes]  # status, JSON body


class CachedReads:
    """Cached job and last-good answers, sent without routing (module docstring)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET":
            hit = self._cached(scope)
            if hit is not None:
                route, body = scope["ckptstore_route"], hit
                if route == LAST_GOOD_ROUTE:
                    METRICS.last_good_queries.inc()
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
        """The cached answer to this request (and its route in `scope["ckptstore_route"]`), or None."""
        state = scope["app"].state
        whole = _JOB_PATH.match(scope["path"])
        key_rest: tuple[int | None, str | None]
        if whole is not None and not scope["query_string"]:
            route, cache, name, key_rest = JOB_ROUTE, state.job_answers, whole.group(1), (None, None)
        else:
            path, query = _PATH.match(scope["path"]), _QUERY.match(scope["query_string"])
            if path is None or query is None:
                return None
            asked = query.group(2) or query.group(3)
            try:
                node = None if asked is None else validate_name(asked.decode(), kind="node")
            except InvalidNameError:
                return None
            max_epoch = None if query.group(1) is None else int(query.group(1))
            route, cache, name, key_rest = LAST_GOOD_ROUTE, state.answers, path.group(1), (max_epoch, node)
        try:  # scope["path"] is decoded once already, as the route's path parameter is
            job = validate_name(name, kind="job")
            version = state.versions.version(job)
        except InvalidNameError:
            return None
        except state.db.errors:  # the database is away: the route answers (503) through the app's handlers
            return None
        body = None if version is None else cache.get((job, *key_rest), version)
        if body is not None:
            scope["ckptstore_route"] = route
        return body


class WriteFastPath:
    """Well-formed commits (single and batch), attempt registrations and starts, recorded without routing
    (module docstring)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = _WRITE.match(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        headers = dict(scope["headers"]) if match else {}
        if match is None or headers.get(b"content-type") not in _JSON_TYPES:
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:  # the client left, or the body limit answered already
            return
        write = _parse_write(match, body, headers)
        if write is None:
            await self.app(scope, _replay(body, receive), send)
            return
        route, run = write
        scope["ckptstore_route"] = route
        try:
            status, payload = await run(scope["app"].state)
        except Exception as exc:
            await _answer_error(scope, receive, send, exc)
            return
        METRICS.fast_path.labels(route).inc()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": _HEADERS + [(b"content-length", str(len(payload)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})


def _parse_write(
    match: re.Match[str], body: bytes, headers: dict[bytes, bytes]
) -> tuple[str, Callable[[Any], Awaitable[_Answer]]] | None:
    """The route template and the write of a well-formed request; None for the route to answer."""
    job, node, kind, batch = match.groups()
    try:
        job = validate_name(job, kind="job")
        if batch is not None:
            commits = CommitBatch.model_validate_json(body).commits
            return BATCH_ROUTE, lambda state: _record_batch(state.writes, job, commits)
        node = validate_name(node, kind="node")
        if kind == "checkpoints":
            commit = CommitRequest.model_validate_json(body)
            return COMMIT_ROUTE, lambda state: _record_one(state.writes, job, node, commit)
        start = StartRequest.model_validate_json(body) if kind == "start" else None
        attempt = AttemptRequest.model_validate_json(body) if kind == "attempts" and body else None
    except (InvalidNameError, ValidationError):
        return None
    key = headers.get(b"idempotency-key")
    key_text = None if key is None else key.decode("latin-1")
    if key_text is not None and _KEY.match(key_text) is None:
        return None

    async def register(state: Any) -> _Answer:
        if start is not None:
            return 200, (await answer_start(state, job, node, start, key_text)).model_dump_json().encode()
        return 201, (await register_attempt(state.writes, job, node, attempt, key_text)).model_dump_json().encode()

    return (ATTEMPT_ROUTE if start is None else START_ROUTE), register


async def _record_one(writes: WriteBatcher, job: str, node: str, commit: CommitRequest) -> _Answer:
    (answer,) = await record_commits(writes, job, [(node, commit)])
    if isinstance(answer, BaseException):
        raise answer  # answered by the app's own handler for it
    record, created = answer
    return commit_status(created), record.model_dump_json().encode()


async def _record_batch(writes: WriteBatcher, job: str, commits: list[NodeCommit]) -> _Answer:
    answers = await record_commits(writes, job, [(commit.node, commit) for commit in commits])
    return 200, _OUTCOMES.dump_json([outcome(answer) for answer in answers])


async def _read_body(receive: Receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` for the route: the body already read, then whatever comes next (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


async def _answer_error(scope: Scope, receive: Receive, send: Send, exc: Exception) -> None:
    """Answer `exc` with the app's own exception handler for it (as the route's would be)."""
    handlers = scope["app"].exception_handlers
    handler = next((handlers[cls] for cls in type(exc).__mro__ if cls in handlers), None)
    if handler is None:
        raise exc
    response = await handler(Request(scope, receive), exc)
    await response(scope, receive, send)
