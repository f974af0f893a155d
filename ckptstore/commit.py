"""The commit protocol: how a checkpoint's bytes become a committed checkpoint, and how a failed
attempt is cleared away.

Invariant (commit): every shard is fully written — and, on local disk, fsynced together with its
directories — before the manifest is published; the manifest is published atomically (local: temp
file, fsync, rename, fsync of the directory; object stores: a single PUT). A prefix without a
manifest that parses and verifies is not committed, whatever else it holds, so a crash at any
instant leaves either the whole checkpoint or an uncommitted leftover that retention removes.

NOTE: each attempt writes under its own prefix (`ckptstore.layout`), so no two writers share a
manifest and nothing here needs a create-only precondition (the GCS emulator ignores them).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

import numpy as np

from ckptstore.copykey import CopyKey
from ckptstore.crc import checksum, format_crc
from ckptstore.errors import CorruptCheckpointError
from ckptstore.layout import MANIFEST_NAME, shard_name
from ckptstore.manifest import Manifest, ShardRecord, TensorRecord
from ckptstore.shard import ShardPlan, iter_shard_chunks, plan_shards
from ckptstore.storage import Storage

__all__ = ["commit_checkpoint", "copy_checkpoint", "discard_uncommitted"]

log = logging.getLogger("ckptstore")
_DIRECTORY_LEVELS = 3  # <job>/<node>/<position>/ above the attempt prefix may be new too


def commit_checkpoint(
    storage: Storage,
    copy: CopyKey,
    arrays: Mapping[str, np.ndarray],
    *,
    step: int | None,
    metadata: dict[str, Any],
    shard_size: int,
    concurrency: int,
) -> Manifest:
    """Write `arrays` as the copy's shards, make them durable, then publish its manifest."""
    key = copy.relpath
    plans = plan_shards(arrays, shard_size)
    storage.make_prefix(key)
    try:
        shards, crcs = _write_shards(storage, key, plans, arrays, concurrency)
        # Shard entries (and the new directories) must be durable before the manifest names them.
        storage.sync_directory(key, up_to=_DIRECTORY_LEVELS)
        slots = {slot.name: slot for plan in plans for slot in plan.slots}
        manifest = Manifest(
            job=copy.job,
            node=copy.node,
            epoch=copy.position.epoch,
            batch=copy.position.batch,
            attempt=copy.attempt,
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
                for name in arrays
            ),
        )
        storage.publish_object(f"{key}/{MANIFEST_NAME}", manifest.to_json())
    except BaseException:
        discard_uncommitted(storage, key)
        raise
    return manifest


def _write_shards(
    storage: Storage, key: str, plans: Sequence[ShardPlan], arrays: Mapping[str, np.ndarray], concurrency: int
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

        storage.write_object(f"{key}/{shard_name(plan.index)}", chunks(), plan.size)
        return ShardRecord(file=shard_name(plan.index), bytes=plan.size, crc32c=format_crc(shard_crc)), crcs

    with ThreadPoolExecutor(max_workers=min(concurrency, len(plans))) as pool:
        results = list(pool.map(write, plans))
        storage.sync_files([f"{key}/{record.file}" for record, _ in results], pool)
    crcs = {name: crc for _, part in results for name, crc in part.items()}
    return [record for record, _ in results], crcs


def copy_checkpoint(source: Storage, target: Storage, key: str, manifest: Manifest, *, concurrency: int) -> None:
    """Stream a committed checkpoint's shards from `source` to `target` and commit it there.

    Each shard's size and CRC32C are checked as it streams through; a shard that does not match
    raises CorruptCheckpointError before its upload completes, and nothing is committed.
    """
    source_location = source.path(key)

    def copy(shard: ShardRecord) -> str:
        relpath = f"{key}/{shard.file}"

        def chunks() -> Iterator[memoryview | bytes]:
            crc = size = 0
            try:
                for chunk in source.iter_object(relpath):
                    crc, size = checksum(chunk, crc), size + len(chunk)
                    yield chunk
            except FileNotFoundError as exc:
                raise CorruptCheckpointError(
                    f"shard {shard.file} of {source_location} is missing",
                    location=source_location,
                    file=shard.file,
                    missing=True,
                ) from exc
            if size != shard.bytes or format_crc(crc) != shard.crc32c:
                raise CorruptCheckpointError(
                    f"shard {shard.file} of {source_location} does not match its manifest",
                    location=source_location,
                    file=shard.file,
                )

        target.write_object(relpath, chunks(), shard.bytes)
        return relpath

    target.make_prefix(key)
    try:
        with ThreadPoolExecutor(max_workers=min(concurrency, max(1, len(manifest.shards)))) as pool:
            target.sync_files(list(pool.map(copy, manifest.shards)), pool)
        target.sync_directory(key, up_to=_DIRECTORY_LEVELS)
        target.publish_object(f"{key}/{MANIFEST_NAME}", manifest.to_json())
    except BaseException:
        discard_uncommitted(target, key)
        raise


def discard_uncommitted(storage: Storage, key: str) -> None:
    """Remove the prefix at `key` unless it holds a manifest (best effort: retention finds leftovers)."""
    try:
        if storage.size(f"{key}/{MANIFEST_NAME}") is None:
            storage.remove_prefix(key)
    except Exception:
        log.warning("could not remove the uncommitted prefix %s", storage.path(key))
