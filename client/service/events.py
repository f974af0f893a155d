"""Following the service's event stream (`GET /v1/events`, Server-Sent Events) from Python: events
one at a time, reconnecting on its own from the last id seen, so nothing is missed or repeated."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx

from ckptstore.errors import ServiceUnavailableError
from ckptstore.wire.events import Event

__all__ = ["follow", "parse_sse", "Stream"]

# How a follower opens one streamed request: (method, path, **httpx options) → the response, as a context.
Stream = Callable[..., AbstractContextManager[httpx.Response]]

log = logging.getLogger("ckptstore.client")
READ_TIMEOUT_S = 90.0  # several heartbeats: a silent connection is a dead one
RECONNECT_S = (0.5, 10.0)


def parse_sse(lines: Iterable[str]) -> Iterator[tuple[str, str, str]]:
    """(id, event, data) per Server-Sent Event in `lines`; comments (heartbeats) are skipped."""
    fields: dict[str, list[str]] = {}
    for line in lines:
        if not line:
            if "data" in fields:
                yield (
                    "".join(fields.get("id", [""])),
                    "".join(fields.get("event", ["message"])),
                    "\n".join(fields["data"]),
                )
            fields = {}
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        fields.setdefault(name, []).append(value[1:] if value.startswith(" ") else value)


def follow(
    stream: Stream,
    next_url: Callable[[], None],
    job: str | None = None,
    *,
    after: int | None = None,
    types: Iterable[str] | None = None,
    reconnect: bool = True,
) -> Iterator[Event]:
    """Events from `after` (None: from now on), of one job and some types where given, over `stream`
    (`ServiceClient.stream`). A dropped connection is reopened (at the next service URL: `next_url`)
    from the last id seen; with `reconnect` False it raises ServiceUnavailableError instead."""
    params: dict[str, str] = {}
    if job is not None:
        params["job"] = job
    if types:
        params["types"] = ",".join(types)
    last = after
    wait = RECONNECT_S[0]
    while True:
        headers = {} if last is None else {"Last-Event-ID": str(last)}
        try:
            for event in _events(stream, params, headers):
                wait = RECONNECT_S[0]
                if isinstance(event, int):
                    last = event  # a reset: go on from the oldest event the log still has
                    continue
                last = event.id
                yield event
        except (httpx.TransportError, ServiceUnavailableError) as exc:
            if not reconnect:
                raise ServiceUnavailableError(f"event stream lost: {exc}") from exc
            log.info("event stream lost (%s); reconnecting in %.1f s", type(exc).__name__, wait)
            next_url()
            time.sleep(wait)
            wait = min(wait * 2, RECONNECT_S[1])


def _events(stream: Stream, params: dict[str, str], headers: dict[str, Any]) -> Iterator[Event | int]:
    """The events of one connection; for a `reset`, the id to go on after."""
    timeout = httpx.Timeout(10.0, read=READ_TIMEOUT_S)
    with stream("GET", "/v1/events", params=params, headers=headers, timeout=timeout) as response:
        for event_id, kind, data in parse_sse(response.iter_lines()):
            if kind == "reset":
                log.warning("events left the service's log before they were read: %s", data)
                yield int(event_id)
                continue
            yield Event.model_validate(json.loads(data))
    raise ServiceUnavailableError("the service closed the event stream")
