"""MANIFEST.json: the record that makes a checkpoint committed, and its strict parser.

Invariant: `parse_manifest` accepts a manifest only if it parses, carries a matching
self-checksum, names only shard files of the layout, describes byte ranges that lie inside
their shards and agree with dtype × shape, and was written for the path it sits at. Anything
else counts as "not committed" — never as a partially valid checkpoint.

Format 1 keeps its shards in the copy's own folder (`tensors-00000.safetensors`); format 2 keeps
them as content-addressed blobs in a node's pool (`<job>/<node>/.blobs/<id>.safetensors`, the
`file` relative to the storage root), shared by every copy whose tensors they hold, and records
each tensor's content hash so the next save can tell what did not change (`ckptstore.blobs`). A blob
stored through the codec (`<id>.grouped.zst`) says so in its shard record, with the stored object's
size and CRC32C beside the plain blob's; byte ranges are always the plain blob's. Format 3 holds the
same tensor fields as columns (`tensor_table`) instead of one record per tensor, so a manifest's cost
grows with its bytes rather than with a Python object per tensor; formats 1 and 2 are read into the
same table.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from functools import cached_property
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ckptstore.copykey import CopyKey
from ckptstore.errors import InvalidNameError
from ckptstore.format.codec import Codec
from ckptstore.format.crc import checksum, format_crc
from ckptstore.format.layout import ENCODED_BLOB_SUFFIX, is_shard_name, parse_blob_key, plain_blob_key
from ckptstore.format.shard import ITEMSIZES
from ckptstore.names import NAME_PATTERN, Tier, validate_attempt
from ckptstore.position import POSITION_LIMIT, Position

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_MANIFEST_BYTES",
    "ShardRecord",
    "TensorRecord",
    "TensorTable",
    "Manifest",
    "ManifestError",
    "parse_manifest",
]

FORMAT_NAME: Literal["ckptstore.format.manifest"] = "ckptstore.format.manifest"
FORMAT_VERSION: Literal[3] = 3
MAX_MANIFEST_BYTES = 64 << 20
_CRC_PATTERN = r"^[0-9a-f]{8}$"
_ID_PATTERN = r"^[0-9a-f]{32}$"
_PROBE_PATTERN = r"^[0-9a-f]{16}$"
_Count = Field(ge=0, lt=POSITION_LIMIT)


class ManifestError(ValueError):
    """A manifest that does not parse or verify: the checkpoint is not committed."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ShardRecord(_Strict):
    """A shard: its file, its plain safetensors size and CRC32C, its blob id (format 2) and, for a blob
    stored encoded (`ckptstore.format.codec`), the codec and the stored object's own size and CRC32C."""

    file: str
    bytes: int = Field(ge=0)
    crc32c: str = Field(pattern=_CRC_PATTERN)
    blob: str | None = Field(default=None, pattern=_ID_PATTERN)
    codec: Codec | None = None
    stored_bytes: int | None = Field(default=None, ge=0)
    stored_crc32c: str | None = Field(default=None, pattern=_CRC_PATTERN)

    def key(self, copy: str) -> str:
        """Where the shard lies relative to the storage root, for the copy whose folder is `copy`."""
        return self.file if self.blob is not None else f"{copy}/{self.file}"

    def plain(self) -> ShardRecord:
        """This shard's record as a plain blob."""
        if self.codec is None:
            return self
        unset = {"codec": None, "stored_bytes": None, "stored_crc32c": None}
        return self.model_copy(update={"file": plain_blob_key(self.file) or self.file, **unset})

    @property
    def stored_size(self) -> int:
        """The size of the object on storage."""
        return self.bytes if self.stored_bytes is None else self.stored_bytes

    @property
    def stored_crc(self) -> str:
        """The CRC32C of the object on storage."""
        return self.crc32c if self.stored_crc32c is None else self.stored_crc32c


class TensorRecord(NamedTuple):
    """One tensor of a manifest: its dtype and shape, its byte range in the plain blob of shard `shard`,
    its CRC32C and (format 2 on) its content hash and probe (`ckptstore.blobs`)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: int
    begin: int
    end: int
    crc32c: str
    hash: str | None = None
    probe: str | None = None

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


_NonNegative = Annotated[int, Field(ge=0)]


class TensorTable(_Strict):
    """A manifest's tensors as columns, the i-th entry of each one tensor (`TensorRecord`'s fields): a
    manifest of 10,000 small tensors is validated, checksummed and encoded per column, not per record."""

    name: tuple[Annotated[str, Field(min_length=1, max_length=1024)], ...]
    dtype: tuple[str, ...]
    shape: tuple[Annotated[tuple[_NonNegative, ...], Field(max_length=64)], ...]
    shard: tuple[_NonNegative, ...]
    begin: tuple[_NonNegative, ...]
    end: tuple[_NonNegative, ...]
    crc32c: tuple[Annotated[str, Field(pattern=_CRC_PATTERN)], ...]
    hash: tuple[Annotated[str, Field(pattern=_ID_PATTERN)] | None, ...]
    probe: tuple[Annotated[str, Field(pattern=_PROBE_PATTERN)] | None, ...]

    @classmethod
    def of(cls, records: Iterable[TensorRecord]) -> TensorTable:
        columns = tuple(zip(*records)) or ((),) * len(TensorRecord._fields)
        return cls(**dict(zip(TensorRecord._fields, columns)))

    def records(self) -> tuple[TensorRecord, ...]:
        return tuple(map(TensorRecord._make, zip(*(getattr(self, field) for field in TensorRecord._fields))))


class Manifest(_Strict):
    format: Literal["ckptstore.format.manifest"] = FORMAT_NAME
    format_version: Literal[1, 2, 3] = FORMAT_VERSION
    job: str = Field(pattern="^" + NAME_PATTERN + "$")
    node: str = Field(pattern="^" + NAME_PATTERN + "$")
    epoch: int = _Count
    batch: int | None = _Count
    attempt: str
    step: int | None = Field(default=None, ge=0)
    created_at: str
    metadata: dict[str, Any] = Field(default_factory=dict)
    shards: tuple[ShardRecord, ...]
    tensor_table: TensorTable

    @cached_property
    def tensors(self) -> tuple[TensorRecord, ...]:
        return self.tensor_table.records()

    @property
    def position(self) -> Position:
        return Position(self.epoch, self.batch)

    def key(self, tier: Tier = "durable") -> CopyKey:
        """The copy this manifest describes, on `tier` (a manifest is the same on every tier)."""
        return CopyKey(self.job, self.node, self.position, self.attempt, tier)

    @property
    def total_bytes(self) -> int:
        return sum(shard.bytes for shard in self.shards)

    @cached_property
    def tensors_by_name(self) -> dict[str, TensorRecord]:
        """The tensors by name, built once per manifest (a save's dedup and a restore both look them up)."""
        return {t.name: t for t in self.tensors}

    def tensor(self, name: str) -> TensorRecord | None:
        return self.tensors_by_name.get(name)

    def plain(self) -> Manifest:
        """This manifest with every blob as stored plain: what two tiers' copies of one checkpoint share,
        however each tier's codec stores the blobs."""
        return self.model_copy(update={"shards": tuple(shard.plain() for shard in self.shards)})

    def to_json(self) -> bytes:
        """Serialise with the self-checksum that `parse_manifest` requires: format 3 seals its own bytes
        (`_SEAL`), formats 1 and 2 their canonical JSON, as they were written."""
        if self.format_version == 3:
            body = self.model_dump_json().encode()[:-1]
            return body + _SEAL + format_crc(checksum(body)).encode() + b'"}'
        legacy = self.model_dump(mode="json")
        table = legacy.pop("tensor_table")
        legacy["tensors"] = [dict(zip(TensorRecord._fields, record)) for record in zip(*table.values())]
        legacy["manifest_crc32c"] = format_crc(checksum(_canonical(legacy)))
        return json.dumps(legacy, separators=(",", ":")).encode()


# A format 3 manifest is its JSON body with this last member, the CRC32C of every byte before it: checking
# it needs no second encoding of the body, and the body is validated straight from the bytes read.
_SEAL = b',"manifest_crc32c":"'
_SEALED_TAIL = len(_SEAL) + 8 + 2


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _names_shard(shard: ShardRecord, version: int) -> bool:
    """Format 1 names shard files in the copy's folder; format 2 names blobs (their id in the key)."""
    if version == 1:
        return shard.blob is None and shard.codec is None and is_shard_name(shard.file)
    parsed = parse_blob_key(shard.file)
    encoded = shard.codec is not None
    return (
        parsed is not None
        and parsed[2] == shard.blob
        and shard.file.endswith(ENCODED_BLOB_SUFFIX) == encoded
        and (shard.stored_bytes is not None) == encoded
        and (shard.stored_crc32c is not None) == encoded
    )


def _check_consistency(manifest: Manifest) -> None:
    try:
        validate_attempt(manifest.attempt)
    except InvalidNameError as exc:
        raise ManifestError(str(exc)) from None
    files = [shard.file for shard in manifest.shards]
    if (
        not files
        or any(not _names_shard(s, manifest.format_version) for s in manifest.shards)
        or len(set(files)) != len(files)
    ):
        raise ManifestError(f"manifest lists invalid shard files {files[:5]}")
    table = manifest.tensor_table
    count = len(table.name)
    if any(len(getattr(table, field)) != count for field in TensorRecord._fields):
        raise ManifestError("manifest's tensor table has columns of different lengths")
    if len(set(table.name)) != count:
        raise ManifestError("manifest lists a tensor name twice")
    unknown = set(table.dtype) - ITEMSIZES.keys()
    if unknown:
        raise ManifestError(f"manifest names unknown dtypes {sorted(unknown)[:5]}")
    sizes = [shard.bytes for shard in manifest.shards]
    for name, dtype, shape, shard, begin, end in zip(
        table.name, table.dtype, table.shape, table.shard, table.begin, table.end
    ):
        if shard >= len(sizes):
            raise ManifestError(f"tensor {name!r} points at shard {shard}, which does not exist")
        if not begin <= end <= sizes[shard]:
            raise ManifestError(f"tensor {name!r} has a byte range outside its shard")
        if math.prod(shape) * ITEMSIZES[dtype] != end - begin:
            raise ManifestError(f"tensor {name!r}: shape {shape} × {ITEMSIZES[dtype]} B ≠ {end - begin} B")


_REQUIRED_FIELDS = frozenset(TensorRecord._fields) - set(TensorRecord._field_defaults)


def _tabulated(body: dict[str, Any]) -> dict[str, Any]:
    """A format 1 or 2 body (its tensors a list of records) with its tensors as the table format 3 has."""
    records = body.pop("tensors", None)
    if (
        "tensor_table" in body
        or not isinstance(records, list)
        or not all(isinstance(r, dict) and _REQUIRED_FIELDS <= r.keys() <= set(TensorRecord._fields) for r in records)
    ):
        raise ManifestError("manifest's tensors do not match the format")
    body["tensor_table"] = {field: [r.get(field) for r in records] for field in TensorRecord._fields}
    return body


def _sealed_body(data: bytes) -> bytes | None:
    """The body of a format 3 manifest whose seal matches its bytes, else None."""
    tail = data[-_SEALED_TAIL:]
    if len(data) <= _SEALED_TAIL or not tail.startswith(_SEAL) or not tail.endswith(b'"}'):
        return None
    body = data[:-_SEALED_TAIL]
    return body if tail[len(_SEAL) : -2] == format_crc(checksum(body)).encode() else None


def _validated(data: bytes | str) -> Manifest:
    """Strict JSON-mode validation (tuples from lists, no bool-as-int) of a manifest's body."""
    try:
        return Manifest.model_validate_json(data)
    except ValidationError as exc:
        raise ManifestError(f"manifest does not match the format: {exc.errors()[0]['msg']}") from None


def _parse_canonical(data: bytes) -> Manifest:
    """A format 1 or 2 manifest, its self-checksum over the canonical JSON of its body."""
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"manifest is not JSON: {exc}") from None
    except RecursionError:
        raise ManifestError("manifest nests too deeply to be one") from None
    if not isinstance(body, dict) or not isinstance(body.get("manifest_crc32c"), str):
        raise ManifestError("manifest has no self-checksum")
    stated = body.pop("manifest_crc32c")
    if stated != format_crc(checksum(_canonical(body))):
        raise ManifestError("manifest self-checksum does not match its content")
    version = body.get("format_version")
    if version not in (1, 2) or isinstance(version, bool):
        raise ManifestError(f"manifest does not match the format: format {version!r} is not checksummed this way")
    return _validated(json.dumps(_tabulated(body)))


def parse_manifest(data: bytes, *, expect: CopyKey | None = None) -> Manifest:
    """Parse and verify a manifest; `expect` is the copy whose path it was read from.

    Raises ManifestError for anything that is not a committed manifest.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest is {len(data)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit")
    sealed = _sealed_body(data)
    if sealed is not None:
        manifest = _validated(sealed + b"}")
        if manifest.format_version != 3:
            raise ManifestError("only a format 3 manifest is sealed over its bytes")
    else:
        manifest = _parse_canonical(data)
    _check_consistency(manifest)
    if expect is not None:
        if not manifest.key().is_copy_of(expect):
            raise ManifestError(
                f"manifest was written for {manifest.job}/{manifest.node} {manifest.position} attempt "
                f"{manifest.attempt}, not for the path it sits at"
            )
    return manifest
