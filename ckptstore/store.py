"""Store: save, load, list, verify and delete checkpoints under one fsspec storage root.

Every public method validates job, node, position and attempt before any storage call, so a
bad name never reaches the filesystem. Commit order (see `storage`): shards → (local) fsync of
files and directories → MANIFEST.json published atomically. Reads never trust a listing cache
and never pick "latest" by time: by position, then attempt.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import datetime, timezone
from typing import Any

import numpy as np

from ckptstore.errors import CheckpointNotFoundError, CommitConflictError, CorruptCheckpointError
from ckptstore.layout import (
    MANIFEST_NAME,
    PROBE_DIR,
    checkpoint_key,
    normalize_root,
    parse_position_dirname,
    position_key,
    shard_name,
)
from ckptstore.manifest import Manifest, ManifestError, ShardRecord, TensorRecord, parse_manifest
from ckptstore.names import attempt_sort_key, new_offline_attempt, validate_attempt, validate_name
from ckptstore.position import Position
from ckptstore.report import AccessReport, CheckpointInfo, CheckpointRef, Problem, VerifyReport
from ckptstore.shard import ShardPlan, checksum, format_crc, iter_shard_chunks, numpy_dtype, plan_shards, prepare_arrays
from ckptstore.storage import Storage, open_storage

__all__ = ["Store", "DEFAULT_SHARD_SIZE", "DEFAULT_CONCURRENCY"]

log = logging.getLogger("ckptstore")

DEFAULT_SHARD_SIZE = 64 << 20  # bench/RESULTS.md: the best save and load ratios on local disk and S3
DEFAULT_CONCURRENCY = 4
Buffer = bytes | np.ndarray


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
        if attempt is None:
            attempt = self.next_attempt(job, node)
        key = checkpoint_key(job, node, position, attempt)
        if self._storage.size(f"{key}/{MANIFEST_NAME}") is not None:
            raise CommitConflictError(
                f"{job}/{node} {position} attempt {attempt} is already committed at {self.url}/{key}"
            )
        plans = plan_shards(prepared, self.shard_size)
        self._storage.make_prefix(key)
        try:
            shards, crcs = self._write_shards(key, plans, prepared)
            # Shard entries (and the new directories) must be durable before the manifest names them.
            self._storage.sync_directory(key, up_to=3)
            slots = {slot.name: slot for plan in plans for slot in plan.slots}
            manifest = Manifest(
                job=job,
                node=node,
                epoch=position.epoch,
                batch=position.batch,
                attempt=attempt,
                step=step,
                created_at=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
                metadata=metadata,
                shards=tuple(shards),
                tensors=tuple(
                    TensorRecord(
                        name=name,
                        dtype=slots[name].dtype,
                        shape=slots[name].shape,
                        shard=slots[name].shard,
                        begin=slots[name].begin,
                        end=slots[name].end,
                        crc32c=format_crc(crcs[name]),
                    )
                    for name in prepared
                ),
            )
            self._storage.publish_object(f"{key}/{MANIFEST_NAME}", manifest.to_json())
        except BaseException:
            self._discard_uncommitted(key)
            raise
        return CheckpointRef.of(f"{self.url}/{key}", manifest)

    def _write_shards(
        self, key: str, plans: Sequence[ShardPlan], arrays: Mapping[str, np.ndarray]
    ) -> tuple[list[ShardRecord], dict[str, int]]:
        def write(plan: ShardPlan) -> tuple[ShardRecord, dict[str, int]]:
            crcs: dict[str, int] = {}
            shard_crc = 0

            def chunks() -> Iterator[memoryview]:
                nonlocal shard_crc
                for name, chunk in iter_shard_chunks(plan, arrays):
                    if name is not None:
                        crcs[name] = checksum(chunk)
                    shard_crc = checksum(chunk, shard_crc)
                    yield chunk

            self._storage.write_object(f"{key}/{shard_name(plan.index)}", chunks(), plan.size)
            return ShardRecord(file=shard_name(plan.index), bytes=plan.size, crc32c=format_crc(shard_crc)), crcs

        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(plans))) as pool:
            results = list(pool.map(write, plans))
            self._storage.sync_files([f"{key}/{record.file}" for record, _ in results], pool)
        crcs = {name: crc for _, part in results for name, crc in part.items()}
        return [record for record, _ in results], crcs

    def copy_from(
        self,
        source: Store,
        job: str,
        node: str,
        epoch: int,
        *,
        batch: int | None = None,
        attempt: str | int | None = None,
    ) -> CheckpointRef:
        """Copy a committed checkpoint of `source` here byte for byte (newest attempt by default).

        Shards are checked against their checksums as they are read, committed here in the same order
        as a save (shards durable, then the manifest), and the copy is verified on arrival. Copying
        onto an identical committed copy is a no-op; onto a different one, CommitConflictError.
        """
        position = Position(epoch, batch)
        attempt_id, manifest = next(source._committed(job, node, position, attempt), (None, None))
        if manifest is None:
            raise CheckpointNotFoundError(f"no committed checkpoint for {job}/{node} {position} under {source.url}")
        key = checkpoint_key(job, node, position, attempt_id)
        location = f"{self.url}/{key}"
        if self._storage.size(f"{key}/{MANIFEST_NAME}") is None:
            self._copy_shards(source, key, manifest)
        elif next(self._committed(job, node, position, attempt_id), (None, None))[1] != manifest:
            raise CommitConflictError(f"{location} is already committed with other content")
        report = self.verify(job, node, epoch, batch=batch, attempt=attempt_id)
        if not report.ok:
            raise CorruptCheckpointError(
                f"the copy at {location} does not verify: {report.problems[0].detail}", location=location
            )
        return CheckpointRef.of(location, manifest)

    def _copy_shards(self, source: Store, key: str, manifest: Manifest) -> None:
        source_location = f"{source.url}/{key}"

        def copy(shard: ShardRecord) -> str:
            relpath = f"{key}/{shard.file}"
            try:
                blob = source._storage.read_object(relpath)
            except FileNotFoundError as exc:
                raise CorruptCheckpointError(f"{source_location} lacks {shard.file}", location=source_location) from exc
            problem = _shard_problem(shard, blob, manifest)
            if problem is not None:
                raise CorruptCheckpointError(f"{problem.detail} in {source_location}", location=source_location)
            self._storage.write_object(relpath, [memoryview(blob).cast("B")], shard.bytes)
            return relpath

        self._storage.make_prefix(key)
        try:
            with ThreadPoolExecutor(max_workers=min(self.concurrency, max(1, len(manifest.shards)))) as pool:
                self._storage.sync_files(list(pool.map(copy, manifest.shards)), pool)
            self._storage.sync_directory(key, up_to=3)
            self._storage.publish_object(f"{key}/{MANIFEST_NAME}", manifest.to_json())
        except BaseException:
            self._discard_uncommitted(key)
            raise

    def _discard_uncommitted(self, key: str) -> None:
        try:
            if self._storage.size(f"{key}/{MANIFEST_NAME}") is None:
                self._storage.remove_prefix(key)
        except Exception:  # best effort: leftovers are found and removed by retention later
            log.warning("could not remove the uncommitted prefix %s/%s", self.url, key)

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
        position = Position(epoch, batch)
        first_error: CorruptCheckpointError | None = None
        for attempt_id, manifest in self._committed(job, node, position, attempt):
            key = checkpoint_key(job, node, position, attempt_id)
            try:
                return self._read_tensors(key, manifest, names)
            except CorruptCheckpointError as exc:
                if attempt is not None:
                    raise
                log.warning("%s; trying an older attempt", exc)
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        raise CheckpointNotFoundError(f"no committed checkpoint for {job}/{node} {position} under {self.url}")

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
        """Committed (attempt, manifest) pairs at a position, newest attempt first."""
        if attempt is not None:
            attempts = [validate_attempt(attempt)]
        else:
            attempts = self._attempts(position_key(job, node, position))[::-1]
        for attempt_id in attempts:
            path = f"{checkpoint_key(job, node, position, attempt_id)}/{MANIFEST_NAME}"
            try:
                data = self._storage.read_object(path)
            except FileNotFoundError:
                continue
            try:
                yield attempt_id, parse_manifest(bytes(data), expect=(job, node, position, attempt_id))
            except ManifestError as exc:
                log.info("%s/%s is not committed: %s", self.url, path, exc)

    def _stored_attempts(
        self, job: str, node: str, position: Position, attempt: str | int | None
    ) -> tuple[str, list[str]]:
        """The position's key and its attempt prefixes on storage (just `attempt` if given), oldest first."""
        wanted = None if attempt is None else validate_attempt(attempt)
        prefix = position_key(job, node, position)
        attempts = [a for a in self._attempts(prefix) if wanted in (None, a)]
        if not attempts:
            raise CheckpointNotFoundError(f"nothing stored for {job}/{node} {position} under {self.url}")
        return prefix, attempts

    def _attempts(self, position_key: str) -> list[str]:
        found = []
        for name in self._storage.list_names(position_key):
            try:
                found.append(validate_attempt(name))
            except ValueError:
                continue
        return sorted(found, key=attempt_sort_key)

    def _read_tensors(self, key: str, manifest: Manifest, names: Sequence[str] | None) -> dict[str, np.ndarray]:
        location = f"{self.url}/{key}"
        if names is None:
            shards = {f"{key}/{shard.file}": shard for shard in manifest.shards}

            def check(relpath: str, blob: Buffer) -> None:
                problem = _shard_problem(shards[relpath], blob, manifest)
                if problem is not None:
                    raise CorruptCheckpointError(
                        f"{problem.detail} in {location}", location=location, file=problem.file
                    )

            blobs = self._storage.read_objects(list(shards), concurrency=self.concurrency, check=check)
            for relpath, shard in shards.items():
                blob = blobs[relpath]
                if isinstance(blob, CorruptCheckpointError):
                    raise blob
                if isinstance(blob, Exception):
                    raise CorruptCheckpointError(
                        f"shard {shard.file} of {location} cannot be read: {blob}", location=location, file=shard.file
                    )
            buffers = [blobs[f"{key}/{shard.file}"] for shard in manifest.shards]
            return {t.name: _as_array(buffers[t.shard], t, t.begin) for t in manifest.tensors}
        wanted = []
        for name in names:
            record = manifest.tensor(name)
            if record is None:
                raise CheckpointNotFoundError(f"tensor {name!r} is not in {location}")
            wanted.append(record)
        files = [manifest.shards[t.shard].file for t in wanted]
        # Empty tensors need no read (an empty range request returns the whole object on S3).
        ranged = [i for i, t in enumerate(wanted) if t.nbytes]
        parts: list[bytes] = [b""] * len(wanted)
        try:
            fetched = self._storage.read_ranges(
                [f"{key}/{files[i]}" for i in ranged],
                [wanted[i].begin for i in ranged],
                [wanted[i].end for i in ranged],
            )
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"a shard of {location} is missing: {exc}", location=location) from exc
        for i, part in zip(ranged, fetched):
            parts[i] = part
        arrays = {}
        for record, file, part in zip(wanted, files, parts):
            if len(part) != record.nbytes or format_crc(checksum(part)) != record.crc32c:
                raise CorruptCheckpointError(
                    f"tensor {record.name!r} in {file} of {location} does not match its checksum",
                    location=location,
                    file=file,
                )
            arrays[record.name] = _as_array(part, record, 0)
        return arrays

    # -- listing -------------------------------------------------------------------------------

    def list_jobs(self) -> list[str]:
        """Job folders under the root (names that pass validation), sorted."""
        return self._valid_names("", "job", exclude=PROBE_DIR)

    def list_nodes(self, job: str) -> list[str]:
        """Node folders of a job on storage, sorted."""
        validate_name(job, kind="job")
        return self._valid_names(job, "node")

    def _valid_names(self, relpath: str, kind: str, exclude: str | None = None) -> list[str]:
        names = []
        for name in self._storage.list_names(relpath):
            try:
                names.append(validate_name(name, kind=kind))
            except ValueError:
                continue
        return sorted(n for n in names if n != exclude)

    def list_checkpoints(self, job: str, node: str) -> list[CheckpointInfo]:
        """Every attempt prefix of a node on storage, committed or not, ordered by position and attempt."""
        validate_name(job, kind="job")
        validate_name(node, kind="node")
        groups: dict[tuple[Position, str], list] = {}
        for stored in self._storage.find(f"{job}/{node}"):
            parts = stored.relpath.split("/")
            if len(parts) != 3:
                continue
            position = parse_position_dirname(parts[0])
            try:
                attempt = validate_attempt(parts[1])
            except ValueError:
                continue
            if position is not None:
                groups.setdefault((position, attempt), []).append(stored)
        manifest_paths = {
            group: f"{checkpoint_key(job, node, group[0], group[1])}/{MANIFEST_NAME}"
            for group, files in groups.items()
            if any(f.relpath.endswith("/" + MANIFEST_NAME) for f in files)
        }
        blobs = self._storage.read_objects(list(manifest_paths.values()), concurrency=self.concurrency)
        infos = []
        for (position, attempt), files in groups.items():
            manifest = None
            blob = blobs.get(manifest_paths.get((position, attempt), ""))
            if blob is not None and not isinstance(blob, Exception):
                try:
                    manifest = parse_manifest(bytes(blob), expect=(job, node, position, attempt))
                except ManifestError:
                    manifest = None
            infos.append(
                CheckpointInfo(
                    node=node,
                    position=position,
                    attempt=attempt,
                    location=f"{self.url}/{checkpoint_key(job, node, position, attempt)}",
                    committed=manifest is not None,
                    bytes=sum(f.size for f in files),
                    modified=max((f.mtime for f in files if f.mtime is not None), default=None),
                    manifest=manifest,
                )
            )
        return sorted(infos, key=lambda i: (i.position, attempt_sort_key(i.attempt)))

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
        validate_name(job, kind="job")
        validate_name(node, kind="node")
        highest = 0
        for posdir in self._storage.list_names(f"{job}/{node}"):
            if parse_position_dirname(posdir) is not None:
                for attempt in self._attempts(f"{job}/{node}/{posdir}"):
                    highest = max(highest, attempt_sort_key(attempt)[0])
        return new_offline_attempt(highest)

    # -- verify and delete ---------------------------------------------------------------------

    def verify(
        self, job: str, node: str, epoch: int, *, batch: int | None = None, attempt: str | int | None = None
    ) -> VerifyReport:
        """Check every shard's size and checksum; reports problems, never raises for corruption.

        Raises CheckpointNotFoundError only when no attempt of that position exists at all.
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
        problems, checked = [], 0
        for shard in manifest.shards:
            try:
                blob = self._storage.read_object(f"{key}/{shard.file}")
            except FileNotFoundError:
                problems.append(Problem("missing_shard", shard.file, f"shard {shard.file} is missing"))
                continue
            checked += len(blob)
            problem = _shard_problem(shard, blob, manifest)
            if problem is not None:
                problems.append(problem)
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
        deleted = []
        for attempt_id in attempts:
            key = f"{prefix}/{attempt_id}"
            self._storage.remove_file(f"{key}/{MANIFEST_NAME}")
            self._storage.remove_prefix(key)
            deleted.append(f"{self.url}/{key}")
        self._storage.remove_empty_directory(prefix)
        return deleted

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


def _shard_problem(shard: ShardRecord, blob: Buffer, manifest: Manifest) -> Problem | None:
    """The first problem with a whole shard's bytes, naming the damaged tensors if any."""
    if len(blob) < shard.bytes:
        return Problem("short_shard", shard.file, f"shard {shard.file} has {len(blob)} of {shard.bytes} bytes")
    if len(blob) > shard.bytes:
        return Problem("size_mismatch", shard.file, f"shard {shard.file} has {len(blob)} bytes, expected {shard.bytes}")
    if format_crc(checksum(blob)) == shard.crc32c:
        return None
    view = memoryview(blob).cast("B")
    damaged = [
        t.name
        for t in manifest.tensors
        if manifest.shards[t.shard] is shard and format_crc(checksum(view[t.begin : t.end])) != t.crc32c
    ]
    where = f"tensors {damaged[:5]}" if damaged else "its header"
    return Problem("checksum_mismatch", shard.file, f"shard {shard.file} does not match its checksum ({where})")


def _as_array(buffer: Buffer, record: TensorRecord, offset: int) -> np.ndarray:
    dtype = numpy_dtype(record.dtype)
    count = record.nbytes // dtype.itemsize
    array = np.frombuffer(buffer, dtype=np.uint8, count=record.nbytes, offset=offset).view(dtype)
    array = array[:count].reshape(record.shape)
    array.flags.writeable = False
    return array
