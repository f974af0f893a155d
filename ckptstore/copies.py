"""Copies across tiers: find the nearest intact copy of one node's checkpoint at a position.

A copy (`CopyKey`) is one committed attempt of one node's checkpoint at one position on one tier.
Tiers are named, nearest first (`local`, `peer`, then `durable`). Invariant: `read_nearest_intact` returns a
checkpoint only after every byte of it verified (but with `one_pass`: its sizes, the bytes as they are
read into place, `ckptstore.deferred`); each copy it passes over is reported (`Skipped`:
`corrupt` or `missing`, with the reason) so the caller can mark it and no later restart trips on
it. A storage outage is not a verdict on a copy: it propagates as StorageUnavailableError — but a
peer's (`peer` tier: another node's disk, one source among several): a peer that dies is passed over.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal

from ckptstore.copykey import CopyKey
from ckptstore.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageUnavailableError
from ckptstore.names import TIERS, Tier
from ckptstore.position import Position
from ckptstore.report import LoadedCheckpoint
from ckptstore.store import Store

__all__ = ["Skipped", "Restored", "NoIntactCopyError", "read_nearest_intact"]

log = logging.getLogger("ckptstore")


@dataclass(frozen=True)
class Skipped:
    """A copy restore passed over, and why: `corrupt` (its bytes or manifest do not verify) or
    `missing` (its files, or the whole copy, are gone)."""

    copy: CopyKey
    state: Literal["corrupt", "missing"]
    reason: str

    def __str__(self) -> str:
        return f"{self.copy} {self.state}: {self.reason}"


@dataclass(frozen=True)
class Restored:
    """The copy restore read (verified), and the copies it skipped on the way."""

    copy: CopyKey
    checkpoint: LoadedCheckpoint
    skipped: tuple[Skipped, ...] = ()


class NoIntactCopyError(CheckpointNotFoundError):
    """No copy of a node's checkpoint at a position verified; `skipped` names each one tried and why."""

    def __init__(self, message: str, skipped: tuple[Skipped, ...]):
        details = "; ".join(str(s) for s in skipped) or "no committed copy on any tier"
        super().__init__(f"{message}: {details}")
        self.skipped = skipped


def read_nearest_intact(
    tiers: Mapping[Tier, Store],
    job: str,
    node: str,
    position: Position,
    *,
    deferred: bool = False,
    one_pass: bool = False,
    exclude: Collection[CopyKey] = (),
) -> Restored:
    """The nearest intact copy of `node`'s checkpoint at `position`: tiers in `TIERS` order, newest
    attempt first within a tier, but those in `exclude`, every byte verified before it is returned
    (`deferred`, `one_pass`: see `Store.read_copy`).

    Raises NoIntactCopyError (a CheckpointNotFoundError) naming every copy tried when none verifies.
    """
    skipped: list[Skipped] = []
    for tier in TIERS:
        store = tiers.get(tier)
        if store is None:
            continue
        try:
            copies = store.copies(job, node, position)
        except StorageUnavailableError as exc:
            if tier != "peer":
                raise
            log.warning("the peer that holds %s/%s's copies went away (%s): not read", job, node, exc)
            continue
        for copy in reversed(copies):
            if copy in exclude:
                continue
            try:
                loaded = store.read_copy(copy, deferred=deferred, one_pass=one_pass)
            except CorruptCheckpointError as exc:
                skipped.append(Skipped(copy, "missing" if exc.missing else "corrupt", str(exc)))
                continue
            except CheckpointNotFoundError:
                continue  # an uncommitted leftover, not a copy
            except StorageUnavailableError as exc:
                if tier != "peer":
                    raise
                skipped.append(Skipped(copy, "missing", f"the peer that holds it went away: {exc}"))
                break  # a peer that dies mid-transfer is not asked for its older copies
            return Restored(copy, loaded, tuple(skipped))
    raise NoIntactCopyError(f"no intact copy of {job}/{node} at {position}", tuple(skipped))
