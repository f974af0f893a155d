"""Forks: a job that starts from another job's checkpoint (`fork_from="job@epoch[.bBATCH]"`).

The fork is declared with the job (`parent` on `PUT /v1/jobs/{job}`, set once), and applies only
while the job has no checkpoint of its own: a node then resumes from the parent's copy of the same
node at the fork point (verified, nearest tier first; none intact is an error, never a fresh start),
and each tier that holds that copy takes it as the base of the node's first save there, which so
writes only the tensors that changed (`ckptstore.blobs`). A restart of the fork resumes the fork.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ckptstore import Position, Store
from ckptstore.copies import Restored, read_nearest_intact
from ckptstore.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckptstore.names import Tier, validate_name
from ckptstore.wire.schema import ForkPoint, PositionBody

__all__ = ["parse_fork_point", "restore_fork"]

_FORK_RE = re.compile(r"(?P<job>[^@]+)@(?P<epoch>[0-9]{1,10})(?:\.b(?P<batch>[0-9]{1,10}))?\Z")


def parse_fork_point(text: str) -> ForkPoint:
    """`job@epoch` or `job@epoch.bBATCH` (as positions print); ValueError in one line otherwise."""
    match = _FORK_RE.match(text)
    if match is None:
        raise ValueError(f"fork_from must look like 'job@epoch' or 'job@epoch.bBATCH', got {text!r}")
    batch = match.group("batch")
    position = PositionBody(epoch=int(match.group("epoch")), batch=None if batch is None else int(batch))
    return ForkPoint(job=validate_name(match.group("job"), kind="job"), position=position)


def restore_fork(tiers: Mapping[Tier, Store], job: str, node: str, parent: ForkPoint) -> Restored:
    """The parent's copy of `node` at the fork point, verified; each tier holding it becomes the base of
    `job`'s first save there. Raises NoIntactCopyError (a CheckpointNotFoundError) when none verifies."""
    position: Position = parent.position.to_position()
    restored = read_nearest_intact(tiers, parent.job, node, position, deferred=True)
    for tier, store in tiers.items():
        try:
            store.fork(job, node, store.manifest(restored.copy.on(tier)))
        except (CheckpointNotFoundError, CorruptCheckpointError):
            continue  # this tier's first save writes everything
    return restored
