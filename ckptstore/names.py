"""Validation of job and node names and attempt ids: the only user text that becomes a storage key.

Invariant: a value that passes here is one path segment that cannot escape its storage root.
Names are checked after percent-decoding (repeatedly, so double-encoded forms are caught too),
and must also be valid as given, so `%2e%2e` and `job%2Fx` never reach storage.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Hashable, Iterable
from typing import Literal, TypeVar
from urllib.parse import unquote

from ckptstore.errors import InvalidNameError

__all__ = [
    "NAME_PATTERN",
    "NAME_JSON_SCHEMA",
    "validate_name",
    "validate_attempt",
    "attempt_sort_key",
    "attempt_number",
    "new_offline_attempt",
    "newest_attempts",
    "ATTEMPT_LIMIT",
    "ACCEPTED_ATTEMPT_LIMIT",
    "Tier",
    "TIERS",
]

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_NAME_RE = re.compile(NAME_PATTERN + r"\Z")
# The same rule for OpenAPI documents and request generators, '..' excluded without look-ahead.
NAME_JSON_SCHEMA = {"pattern": r"^[A-Za-z0-9](?:[A-Za-z0-9_-]|\.[A-Za-z0-9_-])*\.?$", "maxLength": 128}
_ATTEMPT_RE = re.compile(r"([1-9][0-9]{0,9})(?:-([0-9a-f]{8}))?\Z")
# Attempt numbers a counter hands out stay below ATTEMPT_LIMIT. Numbers that come from outside — a
# commit's attempt, a registration's `at_least`, an id found on storage by reindex or offline
# numbering — count only below ACCEPTED_ATTEMPT_LIMIT, a tenth of it: no request or planted folder
# can bring a node's counter near its end, so it can always go on (90 % of its numbers stay).
ATTEMPT_LIMIT = 10**9
ACCEPTED_ATTEMPT_LIMIT = 10**8
_MAX_DECODE_ROUNDS = 4
Tier = Literal["local", "peer", "durable"]
# The tiers of a copy, nearest first: the node's own disk, another node's disk (peer replicas), storage.
TIERS: tuple[Tier, ...] = ("local", "peer", "durable")
T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


def _fully_decoded(value: str) -> str:
    for _ in range(_MAX_DECODE_ROUNDS):
        decoded = unquote(value)
        if decoded == value:
            return value
        value = decoded
    return value


def validate_name(value: object, *, kind: str = "job or node") -> str:
    """Return `value` if it is a valid job or node name, else raise InvalidNameError.

    `kind` ("job", "node") only shapes the message.
    """
    if not isinstance(value, str):
        raise InvalidNameError(f"{kind} name must be a string, got {type(value).__name__}")
    decoded = _fully_decoded(value)
    for candidate in (value, decoded):
        if not _NAME_RE.match(candidate) or ".." in candidate:
            shown = value if len(value) <= 64 else value[:64] + "…"
            raise InvalidNameError(
                f"invalid {kind} name {shown!r}: use 1-128 characters [A-Za-z0-9._-], "
                "starting with a letter or digit, without '..' or percent-encoding"
            )
    return value


def validate_attempt(value: object) -> str:
    """Return the attempt id as its canonical string ("3" or "3-1a2b3c4d").

    Service attempts are positive integers; offline attempts add an 8-hex-digit suffix.
    """
    if isinstance(value, bool):
        raise InvalidNameError(f"invalid attempt {value!r}")
    if isinstance(value, int):
        value = str(value)
    if not isinstance(value, str) or not _ATTEMPT_RE.match(value):
        raise InvalidNameError(
            f"invalid attempt {value!r}: expected a positive integer, optionally '-' and 8 hex digits"
        )
    return value


def attempt_sort_key(attempt: str) -> tuple[int, str]:
    """Order attempts newest-last: by number, then by offline suffix (a plain service number first)."""
    match = _ATTEMPT_RE.match(attempt)
    if match is None:
        raise InvalidNameError(f"invalid attempt {attempt!r}")
    return int(match.group(1)), match.group(2) or ""


def attempt_number(attempt: str) -> int:
    """The numeric part of an attempt id."""
    return attempt_sort_key(attempt)[0]


def new_offline_attempt(highest_on_storage: int) -> str:
    """An attempt id for a start without the service: next number plus a random suffix."""
    return f"{min(highest_on_storage, ACCEPTED_ATTEMPT_LIMIT - 1) + 1}-{secrets.token_hex(4)}"


def newest_attempts(items: Iterable[T], *, group: Callable[[T], K], attempt: Callable[[T], str]) -> dict[K, T]:
    """The item with the newest attempt in each group: for one (node, position) the newest attempt counts."""
    newest: dict[K, T] = {}
    for item in items:
        key = group(item)
        current = newest.get(key)
        if current is None or attempt_sort_key(attempt(item)) > attempt_sort_key(attempt(current)):
            newest[key] = item
    return newest
