"""schemathesis hooks for tests/test_service_fuzz.py (imported there; the CLI loads it through
SCHEMATHESIS_HOOKS): a generated `wait_s` of up to 60 s would hold `GET …/resume-agreement` past the
fuzzer's request timeout, so it is cut to one second — the held path is still taken."""

from __future__ import annotations

from typing import Any

import schemathesis

HELD_AT_MOST_S = 1.0


@schemathesis.hook
def map_query(context: Any, query: dict[str, Any] | None) -> dict[str, Any] | None:
    wait = None if query is None else query.get("wait_s")
    if isinstance(wait, (int, float)) and not isinstance(wait, bool) and wait > HELD_AT_MOST_S:
        query = {**query, "wait_s": HELD_AT_MOST_S}  # type: ignore[dict-item]
    return query
