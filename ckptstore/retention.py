"""Retention as a pure function: which checkpoints may be deleted now.

Invariant: never the last good epoch, the resume position or anything newer; decisions are made
per position, so a position still needed keeps every node's part. How positions count: `keep_last`
keeps the newest N good positions, mid-epoch ones included, and the last good epoch is kept besides;
so with `keep_last=3` and a save every few batches at most 4 good positions stay (plus those the
`keep_every`/`keep_best` rules keep, and positions newer than the resume position, still being written). Uncommitted leftovers go only once older
than the grace period (a writer may still be at work); superseded attempts only once the attempt
that superseded them is that old (until then they are the fallback if it proves corrupt).
The service applies this with its knowledge of good positions; the client and CLI execute it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from ckptstore.copykey import CopyKey
from ckptstore.names import newest_attempts
from ckptstore.position import Position

__all__ = ["RetentionPolicy", "Candidate", "Deletion", "good_positions", "protected", "plan_deletions"]


@dataclass(frozen=True)
class RetentionPolicy:
    """What to keep below the protected range; with no keep_* rule set, every committed position stays."""

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: Literal["min", "max"] = "min"
    grace_seconds: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every", "keep_best"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if (self.keep_best is None) != (self.best_metric is None):
            raise ValueError("keep_best and best_metric go together")
        if self.best_mode not in ("min", "max") or self.grace_seconds < 0:
            raise ValueError("best_mode must be 'min' or 'max' and grace_seconds non-negative")

    @property
    def prunes(self) -> bool:
        return any(v is not None for v in (self.keep_last, self.keep_every, self.keep_best))


@dataclass(frozen=True)
class Candidate:
    """One node's attempt at one position (`key`; its tier does not count here), as storage or the service knows it."""

    key: CopyKey
    committed: bool
    modified: float | None = None
    metric: float | None = None


@dataclass(frozen=True)
class Deletion:
    """A checkpoint attempt that may be deleted, and why: `retention`, `superseded` or `uncommitted`."""

    key: CopyKey
    reason: Literal["retention", "superseded", "uncommitted"]


def good_positions(candidates: Iterable[Candidate], expected_nodes: Collection[str]) -> set[Position]:
    """Positions where every expected node has a committed checkpoint."""
    nodes_at: dict[Position, set[str]] = {}
    for c in candidates:
        if c.committed:
            nodes_at.setdefault(c.key.position, set()).add(c.key.node)
    expected = set(expected_nodes)
    return {p for p, nodes in nodes_at.items() if expected and expected <= nodes}


def protected(good: Collection[Position]) -> tuple[Position | None, Position | None]:
    """(the last good epoch's end, the resume position): retention never deletes either, nor anything
    newer than the resume position; (None, None) when nothing is good."""
    if not good:
        return None, None
    ends = [p for p in good if p.is_end_of_epoch]
    return (max(ends) if ends else None), max(good)


def _kept_positions(good: Sequence[Position], metrics: dict[Position, float], policy: RetentionPolicy) -> set[Position]:
    kept: set[Position] = set()
    if policy.keep_last:
        kept.update(good[-policy.keep_last :])
    if policy.keep_every:
        kept.update(p for p in good if p.is_end_of_epoch and p.epoch % policy.keep_every == 0)
    if policy.keep_best:
        scored = [p for p in good if p in metrics]
        scored.sort(key=lambda p: metrics[p], reverse=policy.best_mode == "max")
        kept.update(scored[: policy.keep_best])
    return kept


def plan_deletions(
    candidates: Iterable[Candidate], *, good: Collection[Position], policy: RetentionPolicy, now: float
) -> list[Deletion]:
    """Checkpoint attempts that may be deleted now under `policy`, ordered by position, node, attempt."""
    candidates = list(candidates)
    last_epoch, resume = protected(good)
    ordered_good = sorted(good)
    metrics: dict[Position, float] = {}
    for c in sorted(candidates, key=lambda c: c.key.node):
        if c.committed and c.metric is not None:
            metrics.setdefault(c.key.position, c.metric)
    kept = _kept_positions(ordered_good, metrics, policy)
    droppable = {
        c.key.position
        for c in candidates
        if policy.prunes
        and resume is not None
        and c.key.position < resume
        and c.key.position != last_epoch
        and c.key.position not in kept
    }
    newest = newest_attempts(
        (c for c in candidates if c.committed),
        group=lambda c: (c.key.node, c.key.position),
        attempt=lambda c: c.key.attempt,
    )

    def old_enough(c: Candidate) -> bool:
        return c.modified is not None and now - c.modified >= policy.grace_seconds

    deletions = []
    for c in candidates:
        superseding = newest.get((c.key.node, c.key.position))
        if c.key.position in droppable:
            deletions.append(Deletion(c.key, "retention"))
        elif not c.committed and old_enough(c):
            deletions.append(Deletion(c.key, "uncommitted"))
        # An older attempt stays a fallback until the newer one has been committed for the grace period.
        elif c.committed and superseding is not None and superseding is not c and old_enough(superseding):
            deletions.append(Deletion(c.key, "superseded"))
    return sorted(deletions, key=lambda d: (d.key.position, d.key.node, d.key.attempt_order))
