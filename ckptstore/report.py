"""Result records of the core: what a save produced, what verification found, whether storage works."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ckptstore.copykey import CopyKey
from ckptstore.errors import Failure
from ckptstore.format.manifest import Manifest
from ckptstore.format.verify import Problem
from ckptstore.names import Tier
from ckptstore.storage.failures import PERMANENT

__all__ = ["CheckpointRef", "CheckpointInfo", "LoadedCheckpoint", "Problem", "VerifyReport", "AccessReport"]


@dataclass(frozen=True)
class CheckpointRef:
    """A committed copy: which one, where it is and what it holds (the body of a service commit)."""

    key: CopyKey
    location: str
    bytes: int
    checksums: dict[str, str]
    manifest: Manifest = field(repr=False)

    @classmethod
    def of(cls, location: str, manifest: Manifest, tier: Tier = "durable") -> CheckpointRef:
        """The ref of the committed copy on `tier` at `location` whose manifest is `manifest`."""
        return cls(
            key=manifest.key(tier),
            location=location,
            bytes=manifest.total_bytes,
            checksums={s.file.rsplit("/", 1)[-1]: f"crc32c:{s.crc32c}" for s in manifest.shards},
            manifest=manifest,
        )

    @property
    def shard_locations(self) -> list[str]:
        """Where each of the copy's shards lies, in the manifest's order (blobs may be shared with
        other copies of the node: `ckptstore.blobs`)."""
        root = self.location[: -len(self.key.relpath) - 1]
        return [f"{root}/{shard.key(self.key.relpath)}" for shard in self.manifest.shards]


@dataclass(frozen=True)
class CheckpointInfo:
    """One attempt prefix found on storage, committed or not (input to retention and reindex)."""

    key: CopyKey
    location: str
    committed: bool
    bytes: int
    modified: float | None
    manifest: Manifest | None = field(default=None, repr=False)
    foreign: bool = False  # a manifest that parses but was written for another path: never deleted


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint read and verified: its arrays, its manifest, and where it was read from."""

    arrays: Mapping[str, np.ndarray] = field(repr=False)
    manifest: Manifest = field(repr=False)
    location: str


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of verifying one copy; `ok` when committed and no problem was found."""

    key: CopyKey
    location: str
    committed: bool
    problems: tuple[Problem, ...] = ()
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return self.committed and not self.problems

    @property
    def state(self) -> str:
        """`committed` when ok; `missing` when the copy or all its damaged files are gone; else `corrupt`."""
        if self.ok:
            return "committed"
        if not self.committed and not self.problems:
            return "missing"
        return "missing" if all(p.state == "missing" for p in self.problems) else "corrupt"


@dataclass(frozen=True)
class AccessReport:
    """cp_accessible: whether storage could be written, read back and cleaned up just now; when not,
    the error and its kind (`ckptstore.storage.failures`: None where storage did not answer in time)."""

    ok: bool
    latency_ms: float | None
    error: str | None = None
    failure: Failure | None = None

    @property
    def permanent(self) -> bool:
        """Whether the failure cannot pass by itself (credentials or configuration must change)."""
        return self.failure in PERMANENT
