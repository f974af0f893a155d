"""CopyKey: the name of one copy — one attempt of one node's checkpoint at one position on one tier.

Every layer names a copy with it: the core (where its files lie under a storage root), the client
(what it saved, replicates, restores, marks) and the service (what a record is about). Built once,
from validated parts, so no layer splits or rebuilds a position on the way down.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ckptstore.errors import InvalidNameError
from ckptstore.format.layout import checkpoint_key, normalize_root
from ckptstore.names import TIERS, Tier, attempt_sort_key, validate_attempt, validate_name
from ckptstore.position import Position

__all__ = ["CopyKey"]


@dataclass(frozen=True, slots=True)
class CopyKey:
    """One copy: `attempt` (its canonical id) of `node`'s checkpoint of `job` at `position`, on `tier`."""

    job: str
    node: str
    position: Position
    attempt: str
    tier: Tier = "durable"

    def __post_init__(self) -> None:
        validate_name(self.job, kind="job")
        validate_name(self.node, kind="node")
        if not isinstance(self.position, Position):
            raise InvalidNameError(f"position must be a Position, got {self.position!r}")
        object.__setattr__(self, "attempt", validate_attempt(self.attempt))
        if self.tier not in TIERS:
            raise InvalidNameError(f"tier must be one of {', '.join(TIERS)}, got {self.tier!r}")

    @property
    def relpath(self) -> str:
        """Where the copy's files lie below its storage root (the same on every tier)."""
        return checkpoint_key(self.job, self.node, self.position, self.attempt)

    def location(self, root: str) -> str:
        """The copy's full location under the storage root `root`."""
        return f"{normalize_root(root)}/{self.relpath}"

    def on(self, tier: Tier) -> CopyKey:
        """The same checkpoint's copy on another tier."""
        return replace(self, tier=tier)

    def is_copy_of(self, other: CopyKey) -> bool:
        """Whether both name the same attempt's checkpoint (on any tier)."""
        return self.on("durable") == other.on("durable")

    @property
    def attempt_order(self) -> tuple[int, str]:
        """Orders attempts newest last (`ckptstore.names.attempt_sort_key`)."""
        return attempt_sort_key(self.attempt)

    def __str__(self) -> str:
        return f"{self.node} {self.position} attempt {self.attempt} ({self.tier})"
