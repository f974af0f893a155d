"""A local checkpoint whose tensors are read where they are needed, not into new memory.

A restore into a live model used to read every shard into new buffers, then hand them to the
framework: on this project's VMs faulting in fresh memory costs ~0.6 s per GiB, more than the disk
takes to read it, and the process briefly held the state twice. `read_deferred` checks the copy
first, then `VerifiedTensors.read_into` copies each tensor straight into the memory that will hold
it (a model's variables) and checks its CRC32C there. How much is checked first:

- `one_pass=False`: every shard's size and CRC32C, read through the page cache; nothing reaches a
  target before the whole copy verified, and a tensor whose bytes changed between the check and the
  copy (a file rewritten underneath, never done by ckptstore) raises CorruptCheckpointError.
- `one_pass=True`: every shard's size only (a missing or cut shard fails before anything is read);
  each byte is then read once, into its target, and checked there. A damaged tensor raises
  CorruptCheckpointError after earlier targets were filled: the targets hold a mix, and the caller
  must overwrite every one of them from another copy or raise — never train on them
  (`ckptstore.client.engine.manager.LoopManager.restore_or_initialize` does the first; docs/design.md, "One pass").
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

import numpy as np

from ckptstore.errors import CorruptCheckpointError
from ckptstore.format.crc import byte_view, checksum, format_crc
from ckptstore.format.manifest import Manifest, ShardRecord, TensorRecord
from ckptstore.format.shard import numpy_dtype
from ckptstore.format.verify import as_array, raise_first, read_verified, scan_shards, size_problems
from ckptstore.storage.filesystem import Storage
from ckptstore.storage.localfs import aligned_empty
from ckptstore.threads import map_threads

__all__ = ["VerifiedTensors", "read_deferred"]


class VerifiedTensors(Mapping[str, np.ndarray]):
    """The tensors of a copy on local disk, by name, checked as `read_deferred` says; `tensors[name]`
    reads one into new memory and checks its CRC32C there."""

    def __init__(
        self, storage: Storage, key: str, manifest: Manifest, *, location: str, concurrency: int, verified: bool
    ):
        self._storage, self._key, self._manifest = storage, key, manifest
        self._location, self._concurrency = location, concurrency
        self._verified = verified  # every shard was checked whole before any read_into
        self._records = manifest.tensors_by_name

    def __getitem__(self, name: str) -> np.ndarray:
        record = self._records[name]
        buffer = aligned_empty(record.nbytes)
        self._fill(self._manifest.shards[record.shard], [(record, buffer)])
        return as_array(buffer, record, 0)

    def __contains__(self, name: object) -> bool:
        return name in self._records

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def spec(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        """(shape, dtype) of a tensor, without reading it."""
        record = self._records[name]
        return tuple(record.shape), numpy_dtype(record.dtype)

    def read_into(self, targets: Mapping[str, np.ndarray]) -> None:
        """Copy each named tensor into its target (a writable, C-contiguous array of the tensor's
        size), one thread per shard in flight, and check its CRC32C where it landed."""
        by_shard: dict[int, list[tuple[TensorRecord, np.ndarray]]] = {}
        for name, target in targets.items():
            record = self._records[name]
            if byte_view(target).nbytes != record.nbytes:
                raise ValueError(f"target for {name!r} holds {target.nbytes} bytes, the tensor {record.nbytes}")
            by_shard.setdefault(record.shard, []).append((record, target))

        shards = self._manifest.shards
        map_threads(lambda index: self._fill(shards[index], by_shard[index]), sorted(by_shard), self._concurrency)

    def _fill(self, shard: ShardRecord, pairs: list[tuple[TensorRecord, np.ndarray]]) -> None:
        """Read each tensor of `shard` into its target and check its CRC32C there."""
        file = shard.file
        fd = os.open(self._storage.path(shard.key(self._key)), os.O_RDONLY)
        try:
            for record, target in pairs:
                view, filled = byte_view(target), 0
                while filled < record.nbytes:
                    got = os.preadv(fd, [view[filled:]], record.begin + filled)
                    if not got:
                        break
                    filled += got
                if filled != record.nbytes or format_crc(checksum(view)) != record.crc32c:
                    how = "changed after it was verified" if self._verified else "does not match its checksum"
                    raise CorruptCheckpointError(
                        f"tensor {record.name!r} in {file} of {self._location} {how}",
                        location=self._location,
                        file=file,
                    )
        finally:
            os.close(fd)


def read_deferred(
    storage: Storage, key: str, manifest: Manifest, *, location: str, concurrency: int, one_pass: bool = False
) -> Mapping[str, np.ndarray]:
    """The copy at `key`, checked as `one_pass` says (module docstring): on local disk as `VerifiedTensors`,
    elsewhere — or where a blob is stored encoded — read whole and verified as `read_verified` does (a
    second download would cost more than new memory; an encoded blob is decoded into new memory anyway)."""
    if not storage.is_local or any(shard.codec is not None for shard in manifest.shards):
        return read_verified(storage, key, manifest, location=location, concurrency=concurrency)
    if one_pass:
        raise_first(size_problems(storage, key, manifest), location)
    else:
        problems, _, _ = scan_shards(storage, key, manifest, concurrency=concurrency)
        raise_first(problems, location)
    return VerifiedTensors(storage, key, manifest, location=location, concurrency=concurrency, verified=not one_pass)
