"""Store: save, load, list, verify and delete checkpoints under one fsspec storage root.

A thin facade: every public method validates job, node, position and attempt before any storage
call, so a bad name never reaches the filesystem, then hands over to the module that owns the
behaviour — `commit` (the commit protocol), `verify` (verified reads), `listing` (what exists),
`storage` (the backend and its error boundary).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Literal

import numpy as np

from ckptstore import listing
from ckptstore.commit import commit_checkpoint, copy_checkpoint
from ckptstore.deferred import read_deferred
from ckptstore.errors import CheckpointNotFoundError, CommitConflictError, CorruptCheckpointError, InvalidNameError
from ckptstore.layout import MANIFEST_NAME, PROBE_DIR, checkpoint_key, normalize_root, position_key
from ckptstore.manifest import Manifest, ManifestError, parse_manifest
from ckptstore.names import new_offline_attempt, validate_attempt, validate_name
from ckptstore.position import Position
from ckptstore.report import AccessReport, CheckpointInfo, CheckpointRef, LoadedCheckpoint, VerifyReport
from ckptstore.shard import prepare_arrays
from ckptstore.storage import Storage, open_storage
from ckptstore.verify import Problem, read_verified, scan_shards

__all__ = ["Store", "DEFAULT_SHARD_SIZE", "DEFAULT_CONCURRENCY"]

log = logging.getLogger("ckptstore")

DEFAULT_SHARD_SIZE = 64 << 20  # bench/RESULTS.md: the best save and load ratios on local disk and S3
DEFAULT_CONCURRENCY = 4


class Store:
    """Checkpoints of many jobs and nodes under one storage root (any fsspec URL)."""

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        shard_size: int = DEFAULT_SHARD_SIZE,
        concurrency: int = DEFAULT_CONCURRENCY,
    ):
        if shard_size < 1 or concurrency < 1:
            raise ValueError("shard_size and concurrency must be positive")
        self.url = normalize_root(url)
        self.shard_size = shard_size
        self.concurrency = concurrency
        self._storage: Storage = open_storage(self.url, storage_options)

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    @property
    def is_local(self) -> bool:
        """Whether the root is on a local filesystem (reads can go straight to where the bytes belong)."""
        return self._storage.is_local

    def location(self, job: str, node: str, epoch: int, *, attempt: str | int, batch: int | None = None) -> str:
        """The full location of a checkpoint prefix (what the service expects in a commit)."""
        return f"{self.url}/{checkpoint_key(job, node, Position(epoch, batch), attempt)}"

    # -- save ----------------------------------------------------------------------------------

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
        if attempt is not None:
            attempt = validate_attempt(attempt)
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        metadata = dict(metadata or {})
        json.dumps(metadata, allow_nan=False)  # fail before writing anything if it cannot be stored
        prepared = prepare_arrays(arrays)
        for parent, name, kind in (("", job, "job"), (job, node, "node")):
            twin = listing.case_twin(self._storage, parent, name)
            if twin is not None:
                raise InvalidNameError(
                    f"{kind} {name!r} differs from {twin!r} under {self.url} only by case: on case-insensitive "
                    "storage they would share one folder"
                )
        if attempt is None:
            attempt = self.next_attempt(job, node)
        key = checkpoint_key(job, node, position, attempt)
        if self._storage.size(f"{key}/{MANIFEST_NAME}") is not None:
            raise CommitConflictError(
                f"{job}/{node} {position} attempt {attempt} is already committed at {self.url}/{key}"
            )
        manifest = commit_checkpoint(
            self._storage,
            key,
            prepared,
            job=job,
            node=node,
            position=position,
            attempt=attempt,
            step=step,
            metadata=metadata,
            shard_size=self.shard_size,
            concurrency=self.concurrency,
        )
        return CheckpointRef.of(f"{self.url}/{key}", manifest)

    def copy_from(
        self,
        source: Store,
        job: str,
        node: str,
        epoch: int,
        *,
        batch: int | None = None,
        attempt: str | int | None = None,
        verify: Literal["full", "sizes"] = "full",
    ) -> CheckpointRef:
        """Copy a committed checkpoint of `source` here byte for byte (newest attempt by default).

        Shards are checked against their checksums as they stream through and committed here in the
        same order as a save; on arrival the copy is verified: every shard read back (`full`), or
        every shard's size and the manifest read back (`sizes`: for replication, whose shards were
        just CRC-checked on their way). Copying onto an identical committed copy is a no-op; onto a
        different one, CommitConflictError.
        """
        position = Position(epoch, batch)
        attempt_id, manifest = next(source._committed(job, node, position, attempt), (None, None))
        if manifest is None or attempt_id is None:
            raise CheckpointNotFoundError(f"no committed checkpoint for {job}/{node} {position} under {source.url}")
        key = checkpoint_key(job, node, position, attempt_id)
        location = f"{self.url}/{key}"
        if self._storage.size(f"{key}/{MANIFEST_NAME}") is None:
            copy_checkpoint(source._storage, self._storage, key, manifest, concurrency=self.concurrency)
        elif next(self._committed(job, node, position, attempt_id), (None, None))[1] != manifest:
            raise CommitConflictError(f"{location} is already committed with other content")
        problems = self._arrival_problems(job, node, position, attempt_id, manifest, full=verify == "full")
        if problems:
            raise CorruptCheckpointError(f"the copy at {location} does not verify: {problems[0]}", location=location)
        return CheckpointRef.of(location, manifest)

    def _arrival_problems(
        self, job: str, node: str, position: Position, attempt: str, manifest: Manifest, *, full: bool
    ) -> list[str]:
        if full:
            report = self.verify(job, node, position.epoch, batch=position.batch, attempt=attempt)
            return [p.detail for p in report.problems]
        key = checkpoint_key(job, node, position, attempt)
        if self.manifest(job, node, position.epoch, batch=position.batch, attempt=attempt) != manifest:
            return ["its manifest reads back different"]
        sizes = {s.file: self._storage.size(f"{key}/{s.file}") for s in manifest.shards}
        return [
            f"shard {s.file} has {sizes[s.file]} of {s.bytes} bytes"
            for s in manifest.shards
            if sizes[s.file] != s.bytes
        ]

    # -- load ----------------------------------------------------------------------------------

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
        return dict(self.read(job, node, epoch, batch=batch, attempt=attempt, names=names).arrays)

    def read(
        self,
        job: str,
        node: str,
        epoch: int,
        *,
        batch: int | None = None,
        attempt: str | int | None = None,
        names: Sequence[str] | None = None,
    ) -> LoadedCheckpoint:
        """`load`, with the manifest and location of the copy that was read."""
        position = Position(epoch, batch)
        first_error: CorruptCheckpointError | None = None
        for attempt_id, manifest in self._committed(job, node, position, attempt):
            key = checkpoint_key(job, node, position, attempt_id)
            location = f"{self.url}/{key}"
            try:
                arrays = read_verified(
                    self._storage, key, manifest, location=location, names=names, concurrency=self.concurrency
                )
            except CorruptCheckpointError as exc:
                if attempt is not None:
                    raise
                log.warning("%s; trying an older attempt", exc)
                first_error = first_error or exc
                continue
            return LoadedCheckpoint(arrays, manifest, location)
        if first_error is not None:
            raise first_error
        raise CheckpointNotFoundError(f"no committed checkpoint for {job}/{node} {position} under {self.url}")

    def attempts(self, job: str, node: str, epoch: int, *, batch: int | None = None) -> list[str]:
        """The attempt prefixes stored at a position, committed or not, oldest first."""
        return listing.stored_attempts(self._storage, job, node, Position(epoch, batch))

    def read_attempt(
        self, job: str, node: str, epoch: int, *, attempt: str, batch: int | None = None, deferred: bool = False
    ) -> LoadedCheckpoint:
        """One attempt's checkpoint, verified, with no fallback; `deferred`: its tensors are read when
        used (`ckptstore.deferred`: straight into a model's memory) where the store is local.

        Raises CheckpointNotFoundError when the prefix holds no manifest (not committed), and
        CorruptCheckpointError when its manifest or its bytes do not verify.
        """
        position = Position(epoch, batch)
        key = checkpoint_key(job, node, position, attempt)
        location = f"{self.url}/{key}"
        try:
            data = self._storage.read_object(f"{key}/{MANIFEST_NAME}")
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{location} holds no manifest: it is not committed") from None
        try:
            manifest = parse_manifest(bytes(data), expect=(job, node, position, validate_attempt(attempt)))
        except ManifestError as exc:
            raise CorruptCheckpointError(
                f"the manifest of {location} does not verify: {exc}", location=location, file=MANIFEST_NAME
            ) from None
        read = read_deferred if deferred else read_verified
        arrays = read(self._storage, key, manifest, location=location, concurrency=self.concurrency)
        return LoadedCheckpoint(arrays, manifest, location)

    def manifest(
        self, job: str, node: str, epoch: int, *, batch: int | None = None, attempt: str | int | None = None
    ) -> Manifest:
        """The committed manifest of a checkpoint (newest committed attempt by default)."""
        position = Position(epoch, batch)
        for _, manifest in self._committed(job, node, position, attempt):
            return manifest
        raise CheckpointNotFoundError(f"no committed checkpoint for {job}/{node} {position} under {self.url}")

    def _committed(
        self, job: str, node: str, position: Position, attempt: str | int | None
    ) -> Iterator[tuple[str, Manifest]]:
        return listing.committed_manifests(self._storage, job, node, position, attempt)

    def _stored_attempts(
        self, job: str, node: str, position: Position, attempt: str | int | None
    ) -> tuple[str, list[str]]:
        """The position's key and its attempt prefixes on storage (just `attempt` if given), oldest first."""
        wanted = None if attempt is None else validate_attempt(attempt)
        attempts = [a for a in listing.stored_attempts(self._storage, job, node, position) if wanted in (None, a)]
        if not attempts:
            raise CheckpointNotFoundError(f"nothing stored for {job}/{node} {position} under {self.url}")
        return position_key(job, node, position), attempts

    # -- listing -------------------------------------------------------------------------------

    def list_jobs(self) -> list[str]:
        """Job folders under the root (names that pass validation), sorted."""
        return listing.valid_names(self._storage, "", "job", exclude=PROBE_DIR)

    def list_nodes(self, job: str) -> list[str]:
        """Node folders of a job on storage, sorted."""
        return listing.valid_names(self._storage, validate_name(job, kind="job"), "node")

    def list_checkpoints(self, job: str, node: str) -> list[CheckpointInfo]:
        """Every attempt prefix of a node on storage, committed or not, ordered by position and attempt."""
        return listing.list_checkpoints(self._storage, self.url, job, node, concurrency=self.concurrency)

    def list_positions(self, job: str, node: str) -> list[Position]:
        """Positions with at least one committed attempt, ascending."""
        return sorted({info.position for info in self.list_checkpoints(job, node) if info.committed})

    def list_epochs(self, job: str, node: str) -> list[int]:
        """Epochs with a committed end-of-epoch checkpoint, ascending."""
        return [p.epoch for p in self.list_positions(job, node) if p.is_end_of_epoch]

    def latest(self, job: str, node: str) -> Position | None:
        """The highest committed position, or None."""
        positions = self.list_positions(job, node)
        return positions[-1] if positions else None

    def next_attempt(self, job: str, node: str) -> str:
        """An offline attempt id: the highest attempt number on storage for this node + 1, random suffix."""
        return new_offline_attempt(self.highest_attempt(job, node))

    def highest_attempt(self, job: str, node: str) -> int:
        """The highest attempt number stored for a node at any position (0 when there is none)."""
        return listing.highest_attempt(self._storage, job, node)

    # -- verify and delete ---------------------------------------------------------------------

    def verify(
        self, job: str, node: str, epoch: int, *, batch: int | None = None, attempt: str | int | None = None
    ) -> VerifyReport:
        """Check every shard's size and checksum; reports problems, never raises for corruption.

        Raises CheckpointNotFoundError only when no attempt of that position exists at all, and
        StorageUnavailableError when storage cannot be read now.
        """
        position = Position(epoch, batch)
        _, attempts = self._stored_attempts(job, node, position, attempt)
        committed = dict(self._committed(job, node, position, attempt))
        chosen = next((a for a in reversed(attempts) if a in committed), attempts[-1])
        key = checkpoint_key(job, node, position, chosen)
        location = f"{self.url}/{key}"
        manifest = committed.get(chosen)
        if manifest is None:
            problem = Problem("unreadable_manifest", MANIFEST_NAME, "no manifest that parses and verifies")
            return VerifyReport(location, position, chosen, committed=False, problems=(problem,))
        problems, _, checked = scan_shards(self._storage, key, manifest, concurrency=self.concurrency)
        return VerifyReport(location, position, chosen, committed=True, problems=tuple(problems), bytes_checked=checked)

    def delete(
        self, job: str, node: str, epoch: int, *, batch: int | None = None, attempt: str | int | None = None
    ) -> list[str]:
        """Delete one attempt (or every attempt) of a position; returns the deleted locations.

        The manifest goes first, so a crash mid-delete leaves an uncommitted leftover, never a
        committed checkpoint with missing shards.
        """
        position = Position(epoch, batch)
        prefix, attempts = self._stored_attempts(job, node, position, attempt)
        for attempt_id in attempts:
            self._refuse_foreign(f"{prefix}/{attempt_id}", (job, node, position, attempt_id))
        deleted = []
        for attempt_id in attempts:
            key = f"{prefix}/{attempt_id}"
            self._storage.remove_file(f"{key}/{MANIFEST_NAME}")
            self._storage.remove_prefix(key)
            deleted.append(f"{self.url}/{key}")
        self._storage.remove_empty_directory(prefix)
        return deleted

    def _refuse_foreign(self, key: str, owner: tuple[str, str, Position, str]) -> None:
        """Refuse to delete a prefix that leads outside the root (a symbolic link on the way) or whose
        manifest names another job, node, position or attempt: it is not this checkpoint's to delete."""
        location = f"{self.url}/{key}"
        if self._storage.escapes(key):
            raise InvalidNameError(f"refusing to delete {location}: it leads outside {self.url} (a symbolic link)")
        if listing.manifest_owner(self._storage, key) not in (None, owner):
            raise InvalidNameError(f"refusing to delete {location}: its manifest belongs to another checkpoint")

    # -- health --------------------------------------------------------------------------------

    def accessible(self, *, timeout: float = 10.0) -> AccessReport:
        """cp_accessible: write, read back and delete a probe object; never raises."""
        relpath = f"{PROBE_DIR}/{secrets.token_hex(8)}"
        payload = b"ckptstore probe " + secrets.token_bytes(16)

        def probe() -> None:
            self._storage.make_prefix(PROBE_DIR)
            self._storage.publish_object(relpath, payload)
            try:
                if bytes(self._storage.read_object(relpath)) != payload:
                    raise OSError("probe object read back different bytes")
            finally:
                self._storage.remove_file(relpath)

        started = time.perf_counter()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            pool.submit(probe).result(timeout=timeout)
        except FutureTimeout:
            return AccessReport(ok=False, latency_ms=None, error=f"storage did not answer within {timeout:g} s")
        except Exception as exc:  # any failure means "not accessible"; the text says why
            return AccessReport(ok=False, latency_ms=None, error=f"{type(exc).__name__}: {exc}")
        finally:
            pool.shutdown(wait=False)
        return AccessReport(ok=True, latency_ms=round((time.perf_counter() - started) * 1000, 3))
