"""Content-addressed blobs: what a save can take unchanged from an earlier copy, the ids of what it
writes, and which blobs of a node's pool no copy needs any more.

A tensor's content id is XXH3-128 of its bytes (16 GiB/s a core here); a blob's id is XXH3-128 of
its safetensors header followed by the content ids of its tensors in file order, so two blobs with
the same bytes have the same id. A save compares each tensor with its base copies' records (the
node's newest copy on the same root, and a fork's parent): first a probe — XXH3-64 of 16 windows of
256 bytes spread over the tensor, which tells a tensor an optimizer touched from its old self at no
cost — then, only where the probe matches, the full hash. A tensor whose hash matches is not written:
the new manifest points into the base's blob. Version counters and `requires_grad` are not trusted
instead of the hash (`tensor.data.add_()` changes a tensor without counting).

Collection (invariant): a blob is deleted only when no committed manifest of its node — or of a node
that marked the pool as one it points into (a fork: `mark_foreign_pools`) — references it,
and only if a copy that referenced it was deleted in the same call or it is older than the grace
period (a crash's leftover); a node's saves and its collections in one process take turns on the
pool's lock, so a blob written for a manifest not yet published is never collected in between.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from ckptstore.format.layout import (
    BLOB_TEMP_PREFIX,
    MANIFEST_NAME,
    blob_pool,
    parse_blob_key,
    parse_pool_reference,
    plain_blob_key,
    pool_reference,
)
from ckptstore.format.manifest import Manifest, ShardRecord, TensorRecord
from ckptstore.format.shard import dtype_code, tensor_view
from ckptstore.position import Position
from ckptstore.storage.filesystem import Storage
from ckptstore.threads import map_threads

__all__ = [
    "tensor_hash",
    "tensor_probe",
    "blob_id",
    "Examined",
    "examine",
    "Bases",
    "pool_lock",
    "mark_foreign_pools",
    "held_blobs",
    "referenced",
    "collect",
]

log = logging.getLogger("ckptstore")
Committed = Callable[[str, str], list[Manifest]]  # (job, node) → the node's committed manifests
_WINDOWS = 16
_WINDOW_BYTES = 256
_THREADED_BYTES = 256 << 10  # the mean tensor size from which hashing goes to threads
_locks: dict[tuple[str, str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def tensor_hash(array: np.ndarray) -> str:
    """The content id of a tensor's bytes (XXH3-128, hex)."""
    return xxhash.xxh3_128_hexdigest(tensor_view(array))


def tensor_probe(array: np.ndarray) -> str | None:
    """XXH3-64 of the tensor's size and 16 evenly spread windows of its bytes: differs for almost any
    tensor a training step changed; equal probes still need equal hashes to count as unchanged. None
    for a tensor no larger than the windows: its hash costs what a probe would, so it is compared by
    hash alone."""
    size = array.nbytes
    if size <= _WINDOWS * _WINDOW_BYTES:
        return None
    view = tensor_view(array)
    hasher = xxhash.xxh3_64(size.to_bytes(8, "little"))
    stride = (size - _WINDOW_BYTES) // (_WINDOWS - 1)
    for index in range(_WINDOWS):
        hasher.update(view[index * stride : index * stride + _WINDOW_BYTES])
    return hasher.hexdigest()


def blob_id(header: bytes, hashes: Iterable[str]) -> str:
    """A blob's id from its header and its tensors' content ids, in file order."""
    hasher = xxhash.xxh3_128(header)
    for value in hashes:
        hasher.update(bytes.fromhex(value))
    return hasher.hexdigest()


@dataclass
class Examined:
    """A save's tensors against its bases: those unchanged (with the record and shard to reuse), and
    the probes and hashes computed on the way (a changed tensor's hash is computed when it is written)."""

    unchanged: dict[str, tuple[TensorRecord, ShardRecord]] = field(default_factory=dict)
    probes: dict[str, str | None] = field(default_factory=dict)
    hashes: dict[str, str] = field(default_factory=dict)

    def hash_of(self, name: str, array: np.ndarray) -> str:
        if name not in self.hashes:
            self.hashes[name] = tensor_hash(array)
        return self.hashes[name]


def examine(
    arrays: Mapping[str, np.ndarray], bases: Sequence[Manifest], *, damaged: Collection[str], concurrency: int
) -> Examined:
    """Which tensors equal, byte for byte, a tensor of the same name, dtype and shape in a base copy
    (in a blob not known to be `damaged`)."""
    examined = Examined()
    candidates: dict[str, tuple[TensorRecord, ShardRecord]] = {}
    lookups = [(base.tensor, base.shards) for base in bases]
    for name, array in arrays.items():
        code = dtype_code(array.dtype)
        for tensor, shards in lookups:
            record = tensor(name)
            if record is None or record.hash is None or record.dtype != code or record.shape != array.shape:
                continue
            shard = shards[record.shard]
            if shard.file not in damaged:
                candidates[name] = (record, shard)
                break
    for name in candidates:
        examined.probes[name] = tensor_probe(arrays[name])
    matching = [name for name, (record, _) in candidates.items() if record.probe == examined.probes[name]]
    # Threads pay for large tensors only: a small one's hash costs less than handing it to a thread.
    large = sum(arrays[name].nbytes for name in matching) >= _THREADED_BYTES * len(matching)
    workers = concurrency if large else 1
    for name, digest in zip(matching, map_threads(lambda n: tensor_hash(arrays[n]), matching, workers)):
        examined.hashes[name] = digest
        if digest == candidates[name][0].hash:
            examined.unchanged[name] = candidates[name]
    return examined


class Bases:
    """What a store's next saves may point at: per node, the newest committed copy it wrote or copied
    (so a save does not list storage to find it, unless its manifest is gone since) — but no blob a
    read in this process found damaged: a save rewrites those tensors, and since the blob's name is
    its content, the rewrite heals every copy that uses it."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, str], Manifest] = {}
        self.damaged: set[str] = set()

    def mark_damaged(self, *files: str | None) -> None:
        self.damaged.update(f for f in files if f is not None and parse_blob_key(f) is not None)

    def wrote(self, manifest: Manifest) -> None:
        """A copy was written or copied here: each of its blobs is whole now (a damaged one rewritten)."""
        self.damaged.difference_update(shard.file for shard in manifest.shards)
        known = self._known.get((manifest.job, manifest.node))
        if known is not None and (known.job, known.node) != (manifest.job, manifest.node):
            del self._known[(manifest.job, manifest.node)]  # a fork's parent gives way to the fork's own copy
        self.remember(manifest)

    def adopt(self, job: str, node: str, manifest: Manifest) -> None:
        """`manifest` (a fork's parent) is the base of (job, node) until it has a copy of its own."""
        self._known.setdefault((job, node), manifest)

    def remember(self, manifest: Manifest) -> None:
        node = (manifest.job, manifest.node)
        known = self._known.get(node)
        if known is None or _order(known) <= _order(manifest):
            self._known[node] = manifest

    def base(self, storage: Storage, job: str, node: str, committed: Committed) -> list[Manifest]:
        """The node's newest committed copy (`committed(job, node)`: its committed copies, oldest first —
        the newest alone will do), or []."""
        known = self._known.get((job, node))
        if known is not None and storage.size(f"{known.key().relpath}/{MANIFEST_NAME}") is not None:
            return [known]
        found = committed(job, node)
        if found:
            self.remember(found[-1])
        return found[-1:]


def _order(manifest: Manifest) -> tuple[Position, tuple[int, str]]:
    return manifest.position, manifest.key().attempt_order


def pool_lock(storage: Storage, job: str, node: str) -> threading.Lock:
    """The lock a node's saves and collections take turns on, in this process."""
    key = (storage.root, job, node)
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


def mark_foreign_pools(storage: Storage, manifest: Manifest) -> None:
    """Before a manifest that points into another node's pool (a fork's parent) is published, leave a
    marker there, so that pool's collections count this node's copies as users of its blobs."""
    for shard in manifest.shards:
        owner = parse_blob_key(shard.file)
        if owner is not None and owner[:2] != (manifest.job, manifest.node):
            marker = pool_reference(owner[0], owner[1], manifest.job, manifest.node)
            if storage.size(marker) is None:
                storage.make_prefix(marker.rsplit("/", 1)[0])
                storage.publish_object(marker, b"")


def held_blobs(manifests: Iterable[Manifest], damaged: Collection[str] = ()) -> dict[str, ShardRecord]:
    """The blobs the manifests point into, but those known `damaged`, by their plain key (`plain_blob_key`):
    what a save or a copy need not write again, however the blob is stored."""
    return {
        plain_blob_key(shard.file) or shard.file: shard
        for manifest in manifests
        for shard in manifest.shards
        if shard.blob is not None and shard.file not in damaged
    }


def referenced(manifests: Iterable[Manifest]) -> set[str]:
    """The keys of every blob the manifests point into."""
    return {shard.file for manifest in manifests for shard in manifest.shards if shard.blob is not None}


def collect(
    storage: Storage,
    job: str,
    node: str,
    committed: Committed,
    *,
    released: Collection[str] = (),
    older_than: float,
) -> list[str]:
    """Delete the blobs of a node's pool that no committed copy of the node references (`committed(job,
    node)`: their manifests) and that either a deleted copy released or were last written before
    `older_than`; and temporary files of writes that died before `older_than`. Returns the deleted keys.
    A pool reached through a symbolic link out of the root is never collected (a warning says so)."""
    pool = blob_pool(job, node)
    deleted: list[str] = []
    if storage.escapes(pool):
        log.warning("not collecting %s: it leads outside %s (a symbolic link)", storage.path(pool), storage.root)
        return deleted
    with pool_lock(storage, job, node):
        stored_files = storage.find(pool)
        users = {(job, node)} | {user for f in stored_files if (user := parse_pool_reference(f.relpath)) is not None}
        live = referenced(manifest for user in sorted(users) for manifest in committed(*user))
        for stored in stored_files:
            key = f"{pool}/{stored.relpath}"
            old = stored.mtime is not None and stored.mtime < older_than
            if parse_pool_reference(stored.relpath) is not None:
                continue
            if stored.relpath.startswith(BLOB_TEMP_PREFIX):
                doomed = old
            else:
                doomed = parse_blob_key(key) is not None and key not in live and (key in released or old)
            if doomed and storage.remove_file(key):
                deleted.append(key)
    return deleted
