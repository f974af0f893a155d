"""schemathesis hooks for tests/test_service_fuzz.py (imported there; the CLI loads it through
SCHEMATHESIS_HOOKS): a generated `wait_s` of up to 60 s would hold `GET …/resume-agreement` past the
fuzzer's request timeout, so it is cut to one second — the held path is still taken; and `GET
/v1/events` is asked for its JSON page, since its default, an endless event stream, only ends at the
fuzzer's timeout (8 s a call: 15 calls were two minutes; tests/test_events.py drives the stream)."""

from __future__ import annotations

from typing import Any

import schemathesis

HELD_AT_MOST_S = 1.0


@schemathesis.hook
def map_query(context: Any, query: dict[str, Any] | None) -> dict[str, Any] | None:
    wait = None if query is None else query.get("wait_s")
    if isinstance(wait, (int, float)) and not isinstance(wait, bool) and wait > HELD_AT_MOST_S:
        query = {**query, "wait_s": HELD_AT_MOST_S}  # type: ignore[dict-item]
    if context.operation is not None and context.operation.path == "/v1/events":
        query = {**(query or {}), "format": "json"}
    return query
