"""Store: save, load, list, verify and delete checkpoints under one fsspec storage root (one tier).

Two faces over the same code. DESIGN's API (`save`, `load`, `verify`, `delete`, …) takes a job, a
node, an epoch and `batch=`, as users write them; the layers above (client, command line) name a
copy once with a `CopyKey` and use the methods that take one (`write`, `read_copy`, `manifest`,
`verify_copy`, `delete_copy`, `copy_from`). Either way names, positions and attempts are validated
before any storage call, so a bad name never reaches the filesystem; then the module that owns the
behaviour takes over — `commit` (the commit protocol), `verify` (verified reads), `listing` (what
exists), `storage` (the backend and its error boundary).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from ckptstore import blobs
from ckptstore.commit import commit_checkpoint, copy_checkpoint
from ckptstore.copykey import CopyKey
from ckptstore.deferred import read_deferred
from ckptstore.errors import CheckpointNotFoundError, CommitConflictError, CorruptCheckpointError
from ckptstore.format.codec import Codec, check_codec
from ckptstore.format.layout import DRAWN_NEXT_NAME, MANIFEST_NAME, PROBE_DIR, normalize_root, position_key
from ckptstore.format.manifest import Manifest, ManifestError, parse_manifest
from ckptstore.format.shard import prepare_arrays
from ckptstore.format.verify import Problem, read_verified, scan_shards, size_problems
from ckptstore.names import Tier, new_offline_attempt, validate_attempt, validate_name
from ckptstore.position import Position
from ckptstore.report import AccessReport, CheckpointInfo, CheckpointRef, LoadedCheckpoint, VerifyReport
from ckptstore.storage import listing
from ckptstore.storage.filesystem import Storage, open_storage
from ckptstore.storage.probe import probe_access

__all__ = ["Store", "DEFAULT_SHARD_SIZE", "DEFAULT_CONCURRENCY"]

log = logging.getLogger("ckptstore")

DEFAULT_SHARD_SIZE = 64 << 20  # bench/RESULTS.md: the best save and load ratios on local disk and S3
DEFAULT_CONCURRENCY = 4


class Store:
    """Checkpoints of many jobs and nodes under one storage root (any fsspec URL), the copies of one tier;
    `codec` (default off) stores the blobs it writes encoded where that pays (`ckptstore.format.codec`);
    `storage`: the root already opened (a node's presigned data path, `ckptstore.client.service.presigned`)."""

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        shard_size: int = DEFAULT_SHARD_SIZE,
        concurrency: int = DEFAULT_CONCURRENCY,
        tier: Tier = "durable",
        codec: Codec | None = None,
        storage: Storage | None = None,
    ):
        if shard_size < 1 or concurrency < 1:
            raise ValueError("shard_size and concurrency must be positive")
        self.codec, self.tier = check_codec(codec), tier
        self.url, self.shard_size, self.concurrency = normalize_root(url), shard_size, concurrency
        self._storage: Storage = storage or open_storage(self.url, storage_options)
        self._bases = blobs.Bases()

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    @property
    def is_local(self) -> bool:
        """Whether the root is on a local filesystem (reads can go straight to where the bytes belong)."""
        return self._storage.is_local

    def key(self, job: str, node: str, position: Position, attempt: str | int) -> CopyKey:
        """The key of a copy on this store's tier (validated)."""
        return CopyKey(job, node, position, validate_attempt(attempt), self.tier)

    def location(self, key: CopyKey) -> str:
        """The full location of a copy's prefix here (what the service expects in a commit)."""
        return key.location(self.url)

    # -- DESIGN's API --------------------------------------------------------------------------

    def save(
        self,
        job: str,
        node: str,
        epoch: int,
        arrays: Mapping[str, Any],
        *,
        attempt: str | int | None = None,
        batch: int | None = None,
        step: int | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> CheckpointRef:
        """Write and commit one node's checkpoint; returns where it is and its checksums.

        `attempt=None` takes an offline attempt id (highest on storage + 1, random suffix).
        Raises CommitConflictError if this attempt already committed this position.
        """
        position = Position(epoch, batch)
        validate_name(job, kind="job")
        validate_name(node, kind="node")
        attempt = self.next_attempt(job, node) if attempt is None else validate_attempt(attempt)
        return self.write(self.key(job, node, position, attempt), arrays, step=step, metadata=metadata)

    def load(
        self,
        job: str,
        node: str,
        epoch: int,
        *,
        batch: int | None = None,
        attempt: str | int | None = None,
        names: Sequence[str] | None = None,
    ) -> dict[str, np.ndarray]:
        """Read a committed checkpoint, verified; arrays are read-only views on the read buffers.

        `names` reads only those tensors' byte ranges. `attempt=None` takes the newest attempt
        that verifies (an older one only if the newest is corrupt, with a warning).
        """
        return dict(self.read(job, node, Position(epoch, batch), attempt=attempt, names=names).arrays)

    def list_positions(self, job: str, node: str) -> list[Position]:
        """Positions with at least one committed attempt, ascending."""
        return sorted({info.key.position for info in self.list_checkpoints(job, node) if info.committed})

    def list_epochs(self, job: str, node: str) -> list[int]:
        """Epochs with a committed end-of-epoch checkpoint, ascending."""
        return [p.epoch for p in self.list_positions(job, node) if p.is_end_of_epoch]

    def latest(self, job: str, node: str) -> Position | None:
        """The highest committed position, or None."""
        return max(self.list_positions(job, node), default=None)

    def verify(
        self, job: str, node: str, epoch: int, *, batch: int | None = None, attempt: str | int | None = None
    ) -> VerifyReport:
        """Check every shard's size and checksum of a position's newest committed attempt (or `attempt`);
        reports problems, never raises for corruption (CheckpointNotFoundError only when no attempt of
        the position exists, StorageUnavailableError when storage cannot be read now)."""
        position = Position(epoch, batch)
        stored = self._stored(job, node, position, attempt)
        committed = {m.attempt for m in self._committed(job, node, position, None)}
        return self.verify_copy(next((k for k in reversed(stored) if k.attempt in committed), stored[-1]))

    def delete(
        self, job: str, node: str, epoch: int, *, batch: int | None = None, attempt: str | int | None = None
    ) -> list[str]:
        """Delete one attempt (or every attempt) of a position; returns the deleted locations."""
        stored = self._stored(job, node, Position(epoch, batch), attempt)
        for key in stored:
            listing.refuse_foreign(self._storage, key, self.location(key))
        return [self._delete(key) for key in stored]

    def accessible(self, *, timeout: float = 10.0) -> AccessReport:
        """cp_accessible: write, read back and delete a probe object; never raises. A failure says what
        kind it is (`ckptstore.storage.failures`), so a start can tell a misconfiguration from an outage."""
        return probe_access(self._storage, timeout=timeout)

    # -- by copy -------------------------------------------------------------------------------

    def write(
        self,
        key: CopyKey,
        arrays: Mapping[str, Any],
        *,
        step: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        bases: Sequence[Manifest] = (),
    ) -> CheckpointRef:
        """Write and commit the copy `key` here. Raises CommitConflictError if it is already committed.

        Tensors equal to the node's newest committed copy here (or to one of `bases`: committed copies
        on this root, a fork's parent) are not written again: the manifest points at their blobs."""
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        metadata = dict(metadata or {})
        json.dumps(metadata, allow_nan=False)  # fail before writing anything if it cannot be stored
        prepared = prepare_arrays(arrays)
        listing.refuse_case_twins(self._storage, key)
        if self._storage.size(f"{key.relpath}/{MANIFEST_NAME}") is not None:
            raise CommitConflictError(f"{key} is already committed at {self.location(key)}")
        manifest = commit_checkpoint(
            self._storage,
            key,
            prepared,
            step=step,
            metadata=metadata,
            shard_size=self.shard_size,
            concurrency=self.concurrency,
            bases=[*self._bases.base(self._storage, key.job, key.node, self._newest), *bases],
            damaged=self._bases.damaged,
            codec=self.codec,
        )
        self._bases.wrote(manifest)
        return CheckpointRef.of(self.location(key), manifest, self.tier)

    def read(
        self,
        job: str,
        node: str,
        position: Position,
        *,
        attempt: str | int | None = None,
        names: Sequence[str] | None = None,
    ) -> LoadedCheckpoint:
        """A position's newest attempt that verifies (or just `attempt`), with its manifest and location."""
        wanted = None if attempt is None else validate_attempt(attempt)
        first_error: CorruptCheckpointError | None = None
        for manifest in self._committed(job, node, position, wanted):
            key = manifest.key(self.tier)
            location = self.location(key)
            try:
                arrays = read_verified(
                    self._storage, key.relpath, manifest, location=location, names=names, concurrency=self.concurrency
                )
            except CorruptCheckpointError as exc:
                self._bases.mark_damaged(exc.file)
                if wanted is not None:
                    raise
                log.warning("%s; trying an older attempt", exc)
                first_error = first_error or exc
                continue
            return LoadedCheckpoint(arrays, manifest, location)
        if first_error is not None:
            raise first_error
        raise CheckpointNotFoundError(f"no committed checkpoint for {job}/{node} {position} under {self.url}")

    def copies(self, job: str, node: str, position: Position) -> list[CopyKey]:
        """The attempt prefixes stored at a position here, committed or not, oldest first."""
        return [self.key(job, node, position, a) for a in listing.stored_attempts(self._storage, job, node, position)]

    def manifest(self, key: CopyKey) -> Manifest:
        """The copy's manifest, verified against its path: CheckpointNotFoundError when the prefix holds
        none (not committed), CorruptCheckpointError when it does not parse and verify."""
        location = self.location(key)
        try:
            data = self._storage.read_object(f"{key.relpath}/{MANIFEST_NAME}")
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{location} holds no manifest: it is not committed") from None
        try:
            return parse_manifest(bytes(data), expect=key)
        except ManifestError as exc:
            raise CorruptCheckpointError(
                f"the manifest of {location} does not verify: {exc}", location=location, file=MANIFEST_NAME
            ) from None

    def record_drawn_next(self, key: CopyKey, record: Mapping[str, Any]) -> None:
        """Keep beside the committed copy `key` what its run drew right after it (the resume proof's late
        record, client/audit/proof.py): published atomically, never part of the copy's checksums."""
        if self._storage.size(f"{key.relpath}/{MANIFEST_NAME}") is None:
            raise CheckpointNotFoundError(f"{self.location(key)} holds no manifest: nothing to record beside")
        self._storage.publish_object(f"{key.relpath}/{DRAWN_NEXT_NAME}", json.dumps(record).encode())

    def drawn_next(self, key: CopyKey) -> dict[str, Any] | None:
        """What the run of copy `key` drew right after it (`record_drawn_next`), or None: not recorded (the
        run ended, or was killed, before it drew), or unreadable — never trusted then."""
        try:
            record = json.loads(bytes(self._storage.read_object(f"{key.relpath}/{DRAWN_NEXT_NAME}")))
        except FileNotFoundError:
            return None
        except ValueError:
            log.warning("%s/%s does not parse: not used", self.location(key), DRAWN_NEXT_NAME)
            return None
        return record if isinstance(record, dict) else None

    def read_copy(self, key: CopyKey, *, deferred: bool = False, one_pass: bool = False) -> LoadedCheckpoint:
        """One copy, verified, with no fallback; `deferred`: its tensors are read when used
        (`ckptstore.deferred`: straight into a model's memory, checked `one_pass`) where the store is local.

        Raises CheckpointNotFoundError when the prefix holds no manifest (not committed), and
        CorruptCheckpointError when its manifest or its bytes do not verify.
        """
        manifest = self.manifest(key)
        location = self.location(key)
        read = functools.partial(read_deferred, one_pass=one_pass) if deferred else read_verified
        try:
            arrays = read(self._storage, key.relpath, manifest, location=location, concurrency=self.concurrency)
        except CorruptCheckpointError as exc:
            self._bases.mark_damaged(exc.file)
            raise
        return LoadedCheckpoint(arrays, manifest, location)

    def verify_copy(self, key: CopyKey) -> VerifyReport:
        """Check every shard's size and checksum of one copy; reports problems, never raises for corruption.
        A copy of which nothing is left is reported `missing`."""
        location = self.location(key)
        manifest = next(self._committed(key.job, key.node, key.position, key.attempt), None)
        if manifest is None and key not in self.copies(key.job, key.node, key.position):
            return VerifyReport(key, location, committed=False)
        if manifest is None:
            problem = Problem("unreadable_manifest", MANIFEST_NAME, "no manifest that parses and verifies")
            return VerifyReport(key, location, committed=False, problems=(problem,))
        problems, _, checked = scan_shards(self._storage, key.relpath, manifest, concurrency=self.concurrency)
        self._bases.mark_damaged(*(problem.file for problem in problems))
        return VerifyReport(key, location, committed=True, problems=tuple(problems), bytes_checked=checked)

    def delete_copy(self, key: CopyKey) -> str:
        """Delete one copy; returns its location. The manifest goes first, so a crash mid-delete leaves an
        uncommitted leftover, never a committed checkpoint with missing shards."""
        listing.refuse_foreign(self._storage, key, self.location(key))
        return self._delete(key)

    def _delete(self, key: CopyKey) -> str:
        try:
            released = blobs.referenced([self.manifest(key)])
        except (CheckpointNotFoundError, CorruptCheckpointError):
            released = set()
        self._storage.remove_file(f"{key.relpath}/{MANIFEST_NAME}")
        self._storage.remove_prefix(key.relpath)
        self._storage.remove_empty_directory(position_key(key.job, key.node, key.position))
        if released:
            blobs.collect(self._storage, key.job, key.node, self._manifests, released=released, older_than=-math.inf)
        return self.location(key)

    def fork(self, job: str, node: str, parent: Manifest) -> None:
        """Take `parent` (a committed copy here, of another job) as the base of `node`'s next save of `job`."""
        self._bases.adopt(validate_name(job, kind="job"), validate_name(node, kind="node"), parent)

    def collect_blobs(self, job: str, node: str, *, grace_seconds: float, now: float | None = None) -> list[str]:
        """Delete the blobs of a node's pool that no committed copy references and that were written
        more than `grace_seconds` ago (what a crash or a kill left behind); returns their locations."""
        older_than = (time.time() if now is None else now) - grace_seconds
        return [
            f"{self.url}/{k}" for k in blobs.collect(self._storage, job, node, self._manifests, older_than=older_than)
        ]

    def _manifests(self, job: str, node: str) -> list[Manifest]:  # the node's committed copies, oldest first
        return [info.manifest for info in self.list_checkpoints(job, node) if info.manifest is not None]

    def _newest(self, job: str, node: str) -> list[Manifest]:  # its newest committed copy, if any
        return listing.newest_manifest(self._storage, job, node)

    def copy_from(self, source: Store, key: CopyKey, *, verify: Literal["full", "sizes"] = "full") -> CheckpointRef:
        """Copy the committed copy `key` of `source` here, each blob stored as this store stores blobs
        (`codec`: byte for byte where both agree, else decoded and encoded again), checked against its
        checksums on the way and committed in a save's order; on arrival verified: every shard read back
        (`full`), or sizes and manifest (`sizes`: replication's, whose shards were just CRC-checked).
        Onto a committed copy of the same checkpoint: a no-op; of another, CommitConflictError."""
        source_manifest = source.manifest(key.on(source.tier))
        target = key.on(self.tier)
        location = self.location(target)
        if self._storage.size(f"{target.relpath}/{MANIFEST_NAME}") is None:
            base = self._bases.base(self._storage, key.job, key.node, self._newest)
            held = blobs.held_blobs(base, self._bases.damaged)
            manifest = copy_checkpoint(
                source._storage,
                self._storage,
                target.relpath,
                source_manifest,
                held=held,
                codec=self.codec,
                concurrency=self.concurrency,
            )
            self._bases.wrote(manifest)
        else:
            manifest = self.manifest(target)
            if manifest.plain() != source_manifest.plain():
                raise CommitConflictError(f"{location} is already committed with other content")
        problems = self._arrival_problems(target, manifest, full=verify == "full")
        if problems:
            raise CorruptCheckpointError(f"the copy at {location} does not verify: {problems[0]}", location=location)
        drawn = source.drawn_next(key.on(source.tier))
        if drawn is not None:
            self.record_drawn_next(target, drawn)
        return CheckpointRef.of(location, manifest, self.tier)

    def _arrival_problems(self, key: CopyKey, manifest: Manifest, *, full: bool) -> list[str]:
        if full:
            return [p.detail for p in self.verify_copy(key).problems]
        if self.manifest(key) != manifest:
            return ["its manifest reads back different"]
        return [p.detail for p in size_problems(self._storage, key.relpath, manifest)]

    def _committed(self, job: str, node: str, position: Position, attempt: str | None) -> Iterator[Manifest]:
        return listing.committed_manifests(self._storage, job, node, position, attempt)

    def _stored(self, job: str, node: str, position: Position, attempt: str | int | None) -> list[CopyKey]:
        """The copies stored at a position (just `attempt`'s if given), oldest first; CheckpointNotFoundError if none."""
        wanted = None if attempt is None else validate_attempt(attempt)
        found = [key for key in self.copies(job, node, position) if wanted in (None, key.attempt)]
        if not found:
            raise CheckpointNotFoundError(f"nothing stored for {job}/{node} {position} under {self.url}")
        return found

    # -- listing -------------------------------------------------------------------------------

    def list_jobs(self) -> list[str]:
        """Job folders under the root (names that pass validation), sorted."""
        return listing.valid_names(self._storage, "", "job", exclude=PROBE_DIR)

    def list_nodes(self, job: str) -> list[str]:
        """Node folders of a job on storage, sorted."""
        return listing.valid_names(self._storage, validate_name(job, kind="job"), "node")

    def list_checkpoints(self, job: str, node: str, *, skip: Collection[CopyKey] = ()) -> list[CheckpointInfo]:
        """Every attempt prefix of a node on storage, committed or not, ordered by position and attempt —
        but the copies in `skip` (whose manifests are not read: what a caller knows already)."""
        storage, tier, concurrency = self._storage, self.tier, self.concurrency
        return listing.list_checkpoints(storage, self.url, job, node, tier=tier, concurrency=concurrency, skip=skip)

    def next_attempt(self, job: str, node: str) -> str:
        """An offline attempt id: the highest attempt number on storage for this node + 1, random suffix."""
        return new_offline_attempt(self.highest_attempt(job, node))

    def manifest_keys(self, job: str, node: str) -> list[CopyKey]:  # one listing, no manifest read
        return listing.manifest_keys(self._storage, job, node, tier=self.tier)

    def exists(self) -> bool:
        """Whether the root is there at all (a folder, a bucket prefix with objects)."""
        return self._storage.exists("")

    def highest_attempt(self, job: str, node: str) -> int:
        """The highest attempt number stored for a node at any position (0 when there is none)."""
        return listing.highest_attempt(self._storage, job, node)
