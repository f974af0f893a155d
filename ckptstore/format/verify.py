"""Verification: CRC32C helpers, the problems a checkpoint's bytes can have, and verified reads.

Invariant: `read_verified` returns arrays only after every byte it read matched the manifest
(whole shards: size and shard CRC32C; partial reads: each tensor's size and CRC32C). A copy whose
bytes are missing or damaged raises `CorruptCheckpointError` naming the file and the problem; a
storage outage raises `StorageUnavailableError` — never "corrupt", since the copy may be intact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ckptstore.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckptstore.format.codec import decode
from ckptstore.format.crc import Buffer, byte_view, checksum, format_crc
from ckptstore.format.manifest import Manifest, ShardRecord, TensorRecord
from ckptstore.format.shard import numpy_dtype
from ckptstore.storage.filesystem import Storage

__all__ = [
    "Problem",
    "shard_problem",
    "plain_bytes",
    "checked_plain",
    "scan_shards",
    "size_problems",
    "raise_first",
    "read_verified",
    "as_array",
]


@dataclass(frozen=True)
class Problem:
    """One defect found by verification. `kind` is one of `Problem.KINDS`."""

    KINDS = ("unreadable_manifest", "missing_shard", "short_shard", "size_mismatch", "checksum_mismatch")

    kind: str
    file: str
    detail: str

    @property
    def state(self) -> str:
        """The copy state this problem means: `missing` when its bytes are gone, else `corrupt`."""
        return "missing" if self.kind == "missing_shard" else "corrupt"


def shard_problem(shard: ShardRecord, blob: Buffer, manifest: Manifest) -> Problem | None:
    """The first problem with a whole shard's stored bytes, naming the damaged tensors if any."""
    size = shard.stored_size
    if len(blob) < size:
        return Problem("short_shard", shard.file, f"shard {shard.file} has {len(blob)} of {size} bytes")
    if len(blob) > size:
        return Problem("size_mismatch", shard.file, f"shard {shard.file} has {len(blob)} bytes, expected {size}")
    if format_crc(checksum(blob)) == shard.stored_crc:
        return None
    if shard.codec is not None:
        return Problem("checksum_mismatch", shard.file, f"shard {shard.file} does not match its checksum (encoded)")
    view = byte_view(blob)
    damaged = [
        t.name
        for t in manifest.tensors
        if manifest.shards[t.shard] is shard and format_crc(checksum(view[t.begin : t.end])) != t.crc32c
    ]
    where = f"tensors {damaged[:5]}" if damaged else "its header"
    return Problem("checksum_mismatch", shard.file, f"shard {shard.file} does not match its checksum ({where})")


def plain_bytes(shard: ShardRecord, stored: Buffer) -> Buffer:
    """The plain safetensors bytes of a shard whose stored bytes verified: decoded where it is stored
    encoded, and checked against the plain blob's CRC32C. ValueError when they do not decode to them."""
    if shard.codec is None:
        return stored
    plain = decode(stored, shard.bytes)
    if format_crc(checksum(plain)) != shard.crc32c:
        raise ValueError("it decodes to other bytes than were encoded")
    return plain


def checked_plain(shard: ShardRecord, stored: Buffer, manifest: Manifest) -> Buffer:
    """The plain bytes of a shard from its stored bytes, checked (and decoded); CorruptCheckpointError
    naming the problem (its `file` the shard's) otherwise."""
    problem = shard_problem(shard, stored, manifest)
    if problem is None:
        try:
            return plain_bytes(shard, stored)
        except ValueError as exc:
            problem = Problem("checksum_mismatch", shard.file, f"shard {shard.file} does not decode: {exc}")
    raise _Defect(problem)


class _Defect(CorruptCheckpointError):
    """A shard check failed inside a reading thread; carries the problem back."""

    def __init__(self, problem: Problem):
        super().__init__(problem.detail, file=problem.file)
        self.problem = problem


def scan_shards(
    storage: Storage, key: str, manifest: Manifest, *, concurrency: int, keep: bool = False
) -> tuple[list[Problem], dict[str, Buffer], int]:
    """Read every shard of the checkpoint at `key` and check it (an encoded one decoded too), overlapping
    checks with I/O.

    Returns (problems, the shards' plain bytes by file name when `keep` and none failed, bytes read).
    Raises StorageUnavailableError when storage cannot be read now.
    """
    shards = {shard.key(key): shard for shard in manifest.shards}

    def check(relpath: str, blob: Buffer) -> Buffer:
        plain = checked_plain(shards[relpath], blob, manifest)
        return plain if keep else b""

    results = storage.read_objects(list(shards), concurrency=concurrency, check=check, transient=not keep)
    problems: list[Problem] = []
    blobs: dict[str, Buffer] = {}
    read = 0
    for relpath, shard in shards.items():
        result = results[relpath]
        if isinstance(result, FileNotFoundError):
            problems.append(Problem("missing_shard", shard.file, f"shard {shard.file} is missing"))
        elif isinstance(result, _Defect):
            problems.append(result.problem)
        elif isinstance(result, Exception):
            raise result
        else:
            read += shard.bytes
            blobs[shard.file] = result
    return problems, (blobs if keep and not problems else {}), read


def size_problems(storage: Storage, key: str, manifest: Manifest) -> list[Problem]:
    """Shards of the checkpoint at `key` whose stored size is not the manifest's (nothing is read)."""
    problems = []
    for shard in manifest.shards:
        size = storage.size(shard.key(key))
        if size is None:
            problems.append(Problem("missing_shard", shard.file, f"shard {shard.file} is missing"))
        elif size != shard.stored_size:
            problems.append(
                Problem("size_mismatch", shard.file, f"shard {shard.file} has {size} of {shard.stored_size} bytes")
            )
    return problems


def raise_first(problems: Sequence[Problem], location: str) -> None:
    """Raise CorruptCheckpointError for the first problem found in the copy at `location`, if any."""
    if problems:
        first = problems[0]
        raise CorruptCheckpointError(
            f"{first.detail} in {location}", location=location, file=first.file, missing=first.state == "missing"
        )


def read_verified(
    storage: Storage,
    key: str,
    manifest: Manifest,
    *,
    location: str,
    names: Sequence[str] | None = None,
    concurrency: int,
) -> dict[str, np.ndarray]:
    """The checkpoint's tensors (all, or only `names` by byte range), each verified before it is returned."""
    if names is not None:
        return _read_named(storage, key, manifest, location, names)
    problems, blobs, _ = scan_shards(storage, key, manifest, concurrency=concurrency, keep=True)
    raise_first(problems, location)
    buffers = [blobs[shard.file] for shard in manifest.shards]
    table = manifest.tensor_table
    return {
        name: _view(buffers[shard], dtype, shape, begin, end - begin)
        for name, dtype, shape, shard, begin, end in zip(
            table.name, table.dtype, table.shape, table.shard, table.begin, table.end
        )
    }


def _read_named(
    storage: Storage, key: str, manifest: Manifest, location: str, names: Sequence[str]
) -> dict[str, np.ndarray]:
    wanted = []
    for name in names:
        record = manifest.tensor(name)
        if record is None:
            raise CheckpointNotFoundError(f"tensor {name!r} is not in {location}")
        wanted.append(record)
    files = [manifest.shards[t.shard].file for t in wanted]
    keys = [manifest.shards[t.shard].key(key) for t in wanted]
    # Empty tensors need no read (an empty range request returns the whole object on S3); a tensor of an
    # encoded blob is cut from the whole blob, decoded.
    ranged = [i for i, t in enumerate(wanted) if t.nbytes and manifest.shards[t.shard].codec is None]
    encoded = {t.shard for t in wanted if t.nbytes and manifest.shards[t.shard].codec is not None}
    parts: list[Buffer | memoryview] = [b""] * len(wanted)
    try:
        fetched = storage.read_ranges(
            [keys[i] for i in ranged],
            [wanted[i].begin for i in ranged],
            [wanted[i].end for i in ranged],
        )
        plain = {index: _read_plain(storage, manifest, key, index, location) for index in sorted(encoded)}
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(
            f"a shard of {location} is missing: {exc}", location=location, missing=True
        ) from exc
    for i, fetched_part in zip(ranged, fetched):
        parts[i] = fetched_part
    for i, record in enumerate(wanted):
        if record.shard in plain:
            parts[i] = byte_view(plain[record.shard])[record.begin : record.end]
    arrays = {}
    for record, file, part in zip(wanted, files, parts):
        if len(part) != record.nbytes or format_crc(checksum(part)) != record.crc32c:
            raise CorruptCheckpointError(
                f"tensor {record.name!r} in {file} of {location} does not match its checksum",
                location=location,
                file=file,
            )
        arrays[record.name] = as_array(part, record, 0)
    return arrays


def _read_plain(storage: Storage, manifest: Manifest, key: str, index: int, location: str) -> Buffer:
    """The plain bytes of the manifest's shard `index`, read whole and checked."""
    shard = manifest.shards[index]
    try:
        return checked_plain(shard, storage.read_object(shard.key(key)), manifest)
    except _Defect as exc:
        raise CorruptCheckpointError(
            f"{exc.problem.detail} in {location}", location=location, file=shard.file
        ) from None


def as_array(buffer: Buffer | memoryview, record: TensorRecord, offset: int) -> np.ndarray:
    """A read-only little-endian view of one tensor inside a verified buffer."""
    return _view(buffer, record.dtype, record.shape, offset, record.nbytes)


def _view(buffer: Buffer | memoryview, dtype: str, shape: tuple[int, ...], offset: int, nbytes: int) -> np.ndarray:
    numpy = numpy_dtype(dtype)
    array = np.frombuffer(buffer, dtype=numpy, count=nbytes // numpy.itemsize, offset=offset).reshape(shape)
    array.flags.writeable = False
    return array
