"""One page of a list endpoint."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Page", "PAGE_LIMIT"]

PAGE_LIMIT = 10_000


@dataclass(frozen=True)
class Page:
    """At most `limit` rows after skipping `offset`, in the endpoint's stable order."""

    limit: int
    offset: int
