"""The commit protocol: how a checkpoint's bytes become a committed checkpoint, and how a failed
attempt is cleared away.

Invariant (commit): every blob the manifest names is fully written — and, on local disk, fsynced
together with its directories — before the manifest is published; the manifest is published atomically (local: temp
file, fsync, rename, fsync of the directory; object stores: a single PUT). A prefix without a
manifest that parses and verifies is not committed, whatever else it holds, so a crash at any
instant leaves either the whole checkpoint or an uncommitted leftover that retention removes.

NOTE: each attempt writes its manifest under its own prefix (`ckptstore.format.layout`), so no two writers
share a manifest; blobs are named by their content, so two writers of one blob write the same bytes.
Nothing here needs a create-only precondition (the GCS emulator ignores them).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Collection, Iterator, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

import numpy as np

from ckptstore.blobs import Examined, blob_id, examine, held_blobs, mark_foreign_pools, pool_lock, tensor_probe
from ckptstore.collector import collector_paused
from ckptstore.copykey import CopyKey
from ckptstore.errors import CorruptCheckpointError
from ckptstore.format.codec import Codec, blob_items, encode
from ckptstore.format.crc import Buffer, byte_view, checksum, crc_combine, format_crc
from ckptstore.format.layout import BLOB_TEMP_PREFIX, MANIFEST_NAME, blob_key, blob_pool, parse_blob_key, plain_blob_key
from ckptstore.format.manifest import Manifest, ShardRecord, TensorRecord, TensorTable
from ckptstore.format.shard import ShardPlan, TensorSlot, iter_shard_chunks, plan_shards
from ckptstore.format.verify import checked_plain
from ckptstore.storage.filesystem import Storage

__all__ = ["commit_checkpoint", "copy_checkpoint", "discard_uncommitted"]

log = logging.getLogger("ckptstore")
_DIRECTORY_LEVELS = 3  # <job>/<node>/<position>/ above the attempt prefix may be new too
_POOL_LEVELS = 2  # <job>/<node>/ above a new pool
_LARGE = 1 << 20  # from this size a tensor is checksummed (and its shard hashed) by a helper thread while written


def commit_checkpoint(
    storage: Storage,
    copy: CopyKey,
    arrays: Mapping[str, np.ndarray],
    *,
    step: int | None,
    metadata: dict[str, Any],
    shard_size: int,
    concurrency: int,
    bases: Sequence[Manifest] = (),
    damaged: Collection[str] = (),
    codec: Codec | None = None,
) -> Manifest:
    """Write what of `arrays` the `bases` (committed copies on this storage) do not hold — in blobs not
    known to be `damaged` — as blobs in the node's pool (through `codec` where it pays), make them
    durable, then publish the manifest."""
    key = copy.relpath
    with collector_paused():
        examined = examine(arrays, bases, damaged=damaged, concurrency=concurrency)
        changed = {name: array for name, array in arrays.items() if name not in examined.unchanged}
        plans = plan_shards(changed, shard_size) if changed or not arrays else []
    storage.make_prefix(key)
    with pool_lock(storage, copy.job, copy.node):
        try:
            held = held_blobs(bases, damaged)
            written, crcs = _write_blobs(storage, copy, plans, changed, examined, held, concurrency, codec)
            # Blobs and the copy's folder must be durable before the manifest names them.
            storage.sync_directory(key, up_to=_DIRECTORY_LEVELS)
            with collector_paused():
                manifest = _manifest(copy, arrays, examined, plans, written, crcs, step=step, metadata=metadata)
                encoded = manifest.to_json()
            mark_foreign_pools(storage, manifest)
            storage.publish_object(f"{key}/{MANIFEST_NAME}", encoded)
        except BaseException:
            discard_uncommitted(storage, key)
            raise
    return manifest


def _manifest(
    copy: CopyKey,
    arrays: Mapping[str, np.ndarray],
    examined: Examined,
    plans: Sequence[ShardPlan],
    written: Sequence[ShardRecord],
    crcs: dict[str, int],
    *,
    step: int | None,
    metadata: dict[str, Any],
) -> Manifest:
    shards: list[ShardRecord] = []
    index: dict[str, int] = {}

    def place(shard: ShardRecord) -> int:
        if shard.file not in index:
            index[shard.file] = len(shards)
            shards.append(shard)
        return index[shard.file]

    slots: dict[str, tuple[TensorSlot, int]] = {}
    for plan, record in zip(plans, written):
        shard_index = place(record)
        slots.update((slot.name, (slot, shard_index)) for slot in plan.slots)
    unchanged, probes, hashes = examined.unchanged, examined.probes, examined.hashes
    tensors = []
    for name, array in arrays.items():
        kept = unchanged.get(name)
        if kept is not None:
            tensors.append(kept[0]._replace(shard=place(kept[1])))
            continue
        slot, shard_index = slots[name]
        probe = probes[name] if name in probes else tensor_probe(array)
        crc = format_crc(crcs[name])
        tensors.append(
            TensorRecord(name, slot.dtype, slot.shape, shard_index, slot.begin, slot.end, crc, hashes[name], probe)
        )
    return Manifest(
        job=copy.job,
        node=copy.node,
        epoch=copy.position.epoch,
        batch=copy.position.batch,
        attempt=copy.attempt,
        step=step,
        created_at=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        metadata=metadata,
        shards=tuple(shards),
        tensor_table=TensorTable.of(tensors),
    )


def _write_blobs(
    storage: Storage,
    copy: CopyKey,
    plans: Sequence[ShardPlan],
    arrays: Mapping[str, np.ndarray],
    examined: Examined,
    held: Mapping[str, ShardRecord],
    concurrency: int,
    codec: Codec | None,
) -> tuple[list[ShardRecord], dict[str, int]]:
    """Write each planned shard as a blob of the copy's node (but those the bases hold already), encoded
    where `codec` is on and it pays."""
    staged = _Staging(storage)
    helper = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="ckptstore-sums")

    def identity_of(shard: ShardPlan) -> str:
        return blob_id(shard.header, (examined.hash_of(slot.name, arrays[slot.name]) for slot in shard.slots))

    def write(plan: ShardPlan) -> tuple[ShardRecord, dict[str, int]]:
        crcs: dict[str, int] = {}
        shard_crc = 0

        def checked() -> Iterator[tuple[str | None, memoryview]]:
            """The shard's chunks, each checksummed; a large tensor's CRC32C is computed by a helper thread
            while the chunk is being written, and joins the shard's by `crc_combine`, not by a second pass
            over its bytes."""
            nonlocal shard_crc
            for name, chunk in iter_shard_chunks(plan, arrays):
                if name is None:
                    shard_crc = checksum(chunk, shard_crc)
                elif len(chunk) < _LARGE:
                    crcs[name] = checksum(chunk)
                    shard_crc = checksum(chunk, shard_crc)
                else:
                    pending = helper.submit(checksum, chunk)
                    yield name, chunk
                    crcs[name] = pending.result()
                    shard_crc = crc_combine(shard_crc, crcs[name], len(chunk))
                    continue
                yield name, chunk

        def plain(final: str, identity: str) -> ShardRecord:  # the blob as written (read after `checked`)
            return ShardRecord(file=final, bytes=plan.size, crc32c=format_crc(shard_crc), blob=identity)

        if codec is None and storage.is_local:
            # Named after the write: the disk is busy from the first byte while a helper hashes large tensors.
            large = any(slot.end - slot.begin >= _LARGE for slot in plan.slots)
            hashing = helper.submit(identity_of, plan) if large else None
            temp = staged.unnamed(blob_pool(copy.job, copy.node))
            storage.write_object(temp, (chunk for _, chunk in checked()), plan.size)
            identity = identity_of(plan) if hashing is None else hashing.result()
            final = blob_key(copy.job, copy.node, identity)
            if final in held:
                staged.drop(temp)
                return held[final], crcs
            staged.name(temp, final)
            return plain(final, identity), crcs
        identity = identity_of(plan)
        final = blob_key(copy.job, copy.node, identity)
        if final in held:
            for _ in checked():
                pass  # the bytes are there: only their checksums are needed
            return held[final], crcs
        if codec is None:
            storage.write_object(final, (chunk for _, chunk in checked()), plan.size)
            return plain(final, identity), crcs
        encoded = encode(
            ((chunk, 1 if name is None else arrays[name].itemsize) for name, chunk in checked()), plan.size
        )
        record = plain(final, identity)
        if encoded is None:
            storage.write_object(
                staged.place(final), (chunk for _, chunk in iter_shard_chunks(plan, arrays)), plan.size
            )
            return record, crcs
        stored = _encoded(record, encoded, codec)
        storage.write_object(staged.place(stored.file), [encoded], len(encoded))
        return stored, crcs

    try:
        with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(plans)))) as pool:
            results = list(pool.map(write, plans))
            staged.commit(pool)
    finally:
        helper.shutdown(wait=True)
    crcs = {name: crc for _, part in results for name, crc in part.items()}
    return [record for record, _ in results], crcs


def _encoded(record: ShardRecord, encoded: bytes, codec: Codec) -> ShardRecord:
    """The record of the blob `record` stored as `encoded`."""
    owner = parse_blob_key(record.file)
    assert owner is not None and record.blob is not None, "only blobs are stored encoded"
    return record.model_copy(
        update={
            "file": blob_key(owner[0], owner[1], record.blob, encoded=True),
            "codec": codec,
            "stored_bytes": len(encoded),
            "stored_crc32c": format_crc(checksum(encoded)),
        }
    )


class _Staging:
    """Blobs on their way into a pool: local files are written under a temporary name, fsynced together,
    then renamed into place (two writers of one blob never see each other's half); object stores are
    written in place, since a PUT appears whole or not at all."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self.moves: list[tuple[str, str]] = []
        self.pools: set[str] = set()

    def place(self, final: str) -> str:
        """Where to write the blob `final` now."""
        if not self.storage.is_local:
            return final
        temp = self.unnamed(final.rsplit("/", 1)[0])
        self.name(temp, final)
        return temp

    def unnamed(self, pool: str) -> str:
        """A temporary name in `pool` (local storage) for a blob whose name is known once it is written."""
        if pool not in self.pools:
            self.storage.make_prefix(pool)
            self.pools.add(pool)
        return f"{pool}/{BLOB_TEMP_PREFIX}{secrets.token_hex(8)}"

    def name(self, temp: str, final: str) -> None:
        """The blob written at `temp` goes into place as `final` at commit."""
        self.moves.append((temp, final))

    def drop(self, temp: str) -> None:
        """The blob written at `temp` is not needed (its pool holds it already)."""
        self.storage.remove_file(temp)

    def commit(self, pool: Executor) -> None:
        """Make the staged blobs durable under their own names."""
        if not self.moves:
            return
        self.storage.sync_files([temp for temp, _ in self.moves], pool)
        for temp, final in self.moves:
            self.storage.rename(temp, final)
        for directory in sorted(self.pools):
            self.storage.sync_directory(directory, up_to=_POOL_LEVELS)


def copy_checkpoint(
    source: Storage,
    target: Storage,
    key: str,
    manifest: Manifest,
    *,
    concurrency: int,
    held: Mapping[str, ShardRecord] | None = None,
    codec: Codec | None = None,
) -> Manifest:
    """Copy a committed checkpoint's shards from `source` to `target` (but the blobs in `held`, by plain
    key, which `target` holds for a committed copy already) and commit it there; returns its manifest
    there, which differs from `manifest` only in how blobs are stored.

    A blob stored as the target stores blobs (`codec`) streams through, its size and CRC32C checked on
    the way: one that does not match raises CorruptCheckpointError before its upload completes. Any
    other is read whole, checked and decoded, and stored through `codec` where that pays. Nothing is
    committed unless every shard arrived.
    """
    source_location = source.path(key)
    copy = manifest.key()
    staged = _Staging(target)
    held = held or {}

    def damaged(shard: ShardRecord, missing: bool = False) -> CorruptCheckpointError:
        state = "is missing" if missing else "does not match its manifest"
        return CorruptCheckpointError(
            f"shard {shard.file} of {source_location} {state}",
            location=source_location,
            file=shard.file,
            missing=missing,
        )

    def stream(shard: ShardRecord) -> Iterator[memoryview | bytes]:
        crc = size = 0
        try:
            for chunk in source.iter_object(shard.key(key)):
                crc, size = checksum(chunk, crc), size + len(chunk)
                yield chunk
        except FileNotFoundError as exc:
            raise damaged(shard, missing=True) from exc
        if size != shard.stored_size or format_crc(crc) != shard.stored_crc:
            raise damaged(shard)

    def transcoded(shard: ShardRecord) -> tuple[ShardRecord, Buffer]:
        try:
            plain = checked_plain(shard, source.read_object(shard.key(key)), manifest)
        except FileNotFoundError as exc:
            raise damaged(shard, missing=True) from exc
        except CorruptCheckpointError:
            raise damaged(shard) from None
        encoded = None if codec is None else encode(blob_items(plain), shard.bytes)
        if codec is None or encoded is None:
            return shard.plain(), plain
        return _encoded(shard.plain(), encoded, codec), encoded

    def send(shard: ShardRecord) -> tuple[ShardRecord, str | None]:
        """The shard's record on the target, and where it was written (None: held there already)."""
        if shard.blob is not None and (plain_blob_key(shard.file) or shard.file) in held:
            return held[plain_blob_key(shard.file) or shard.file], None
        if shard.blob is None or shard.codec == codec:
            destination = shard.key(key) if shard.blob is None else staged.place(shard.file)
            target.write_object(destination, stream(shard), shard.stored_size)
            return shard, destination
        record, data = transcoded(shard)
        destination = staged.place(record.file)
        target.write_object(destination, [byte_view(data)], record.stored_size)
        return record, destination

    target.make_prefix(key)
    with pool_lock(target, copy.job, copy.node):
        try:
            with ThreadPoolExecutor(max_workers=min(concurrency, max(1, len(manifest.shards)))) as pool:
                sent = list(pool.map(send, manifest.shards))
                target.sync_files(
                    [where for (record, where) in sent if where is not None and record.blob is None], pool
                )
                staged.commit(pool)
            target.sync_directory(key, up_to=_DIRECTORY_LEVELS)
            arrived = manifest.model_copy(update={"shards": tuple(record for record, _ in sent)})
            mark_foreign_pools(target, arrived)
            target.publish_object(f"{key}/{MANIFEST_NAME}", arrived.to_json())
        except BaseException:
            discard_uncommitted(target, key)
            raise
    return arrived


def discard_uncommitted(storage: Storage, key: str) -> None:
    """Remove the prefix at `key` unless it holds a manifest (best effort: retention finds leftovers)."""
    try:
        if storage.size(f"{key}/{MANIFEST_NAME}") is None:
            storage.remove_prefix(key)
    except Exception:
        log.warning("could not remove the uncommitted prefix %s", storage.path(key))
