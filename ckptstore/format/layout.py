"""The on-storage layout: every name ckptstore writes is built (and parsed) here.

    <root>/<job>/<node>/<epoch:010d>[.b<batch:010d>]/<attempt>/
        MANIFEST.json                 written last; a manifest that parses and verifies = committed
        DRAWN_NEXT.json               written after the commit, when the run drew on: the first samples it drew
                                      after an epoch-end copy (the resume proof's late record; not part of the copy)
        tensors-00000.safetensors …   shards of a format-1 copy (before content-addressed blobs)
    <root>/<job>/<node>/.blobs/<id>.safetensors
                                      the node's content-addressed shards, shared by its copies
    <root>/<job>/<node>/.blobs/<id>.grouped.zst
                                      a blob stored encoded (`ckptstore.format.codec`), where a store's codec is on
    <root>/<job>/<node>/.blobs/.refs/<job2>/<node2>
                                      node2 of job2 (a fork) has copies pointing into this pool

The service and the client both build locations with `checkpoint_location`, so a commit's
location can be checked by string equality.
"""

from __future__ import annotations

import re

from ckptstore.names import NAME_PATTERN, validate_attempt, validate_name
from ckptstore.position import Position

__all__ = [
    "MANIFEST_TEMP_PREFIX",
    "MANIFEST_NAME",
    "DRAWN_NEXT_NAME",
    "PROBE_DIR",
    "BLOB_DIR",
    "BLOB_TEMP_PREFIX",
    "is_shard_name",
    "blob_pool",
    "ENCODED_BLOB_SUFFIX",
    "blob_key",
    "parse_blob_key",
    "plain_blob_key",
    "pool_reference",
    "parse_pool_reference",
    "position_dirname",
    "parse_position_dirname",
    "position_key",
    "checkpoint_key",
    "checkpoint_location",
    "normalize_root",
]

MANIFEST_NAME = "MANIFEST.json"
DRAWN_NEXT_NAME = "DRAWN_NEXT.json"
MANIFEST_TEMP_PREFIX = ".MANIFEST.json.tmp-"
PROBE_DIR = ".ckptstore-probe"
BLOB_DIR = ".blobs"
BLOB_TEMP_PREFIX = ".tmp-"
ENCODED_BLOB_SUFFIX = ".grouped.zst"
_REFS = ".refs"
_SHARD_RE = re.compile(r"tensors-([0-9]{5})\.safetensors\Z")
_BLOB_SUFFIX = r"(?:\.safetensors|\.grouped\.zst)"
_BLOB_RE = re.compile(r"(" + NAME_PATTERN + r")/(" + NAME_PATTERN + r")/\.blobs/([0-9a-f]{32})" + _BLOB_SUFFIX + r"\Z")
_POSITION_RE = re.compile(r"([0-9]{10})(?:\.b([0-9]{10}))?\Z")


def is_shard_name(name: str) -> bool:
    return _SHARD_RE.match(name) is not None


def blob_pool(job: str, node: str) -> str:
    """The folder of a node's content-addressed blobs, relative to the storage root."""
    return f"{validate_name(job, kind='job')}/{validate_name(node, kind='node')}/{BLOB_DIR}"


def blob_key(job: str, node: str, blob_id: str, *, encoded: bool = False) -> str:
    """Where the blob `blob_id` of a node's pool lies, relative to the storage root (`encoded`: stored
    through the codec)."""
    return f"{blob_pool(job, node)}/{blob_id}{ENCODED_BLOB_SUFFIX if encoded else '.safetensors'}"


def parse_blob_key(key: str) -> tuple[str, str, str] | None:
    """(job, node, blob id) of a blob key, or None for anything else (a `..` in a name included)."""
    match = _BLOB_RE.match(key)
    if match is None or ".." in match.group(1) or ".." in match.group(2):
        return None
    return match.group(1), match.group(2), match.group(3)


def plain_blob_key(key: str) -> str | None:
    """The plain key of the blob at `key`, stored encoded or not (None for anything but a blob key): one
    name for a blob, however a tier stores it."""
    parsed = parse_blob_key(key)
    return None if parsed is None else blob_key(*parsed)


def pool_reference(pool_job: str, pool_node: str, job: str, node: str) -> str:
    """The marker in (pool_job, pool_node)'s pool saying that (job, node) has copies pointing into it."""
    return (
        f"{blob_pool(pool_job, pool_node)}/{_REFS}/{validate_name(job, kind='job')}/{validate_name(node, kind='node')}"
    )


def parse_pool_reference(relpath: str) -> tuple[str, str] | None:
    """(job, node) of a marker's path relative to its pool, or None for anything else."""
    parts = relpath.split("/")
    if len(parts) != 3 or parts[0] != _REFS:
        return None
    try:
        return validate_name(parts[1], kind="job"), validate_name(parts[2], kind="node")
    except ValueError:
        return None


def position_dirname(position: Position) -> str:
    if position.batch is None:
        return f"{position.epoch:010d}"
    return f"{position.epoch:010d}.b{position.batch:010d}"


def parse_position_dirname(name: str) -> Position | None:
    """The position a directory name stands for, or None for anything else."""
    match = _POSITION_RE.match(name)
    if match is None:
        return None
    batch = match.group(2)
    return Position(int(match.group(1)), None if batch is None else int(batch))


def normalize_root(root: str) -> str:
    """A storage root URL without trailing slashes (but "/" stays "/")."""
    stripped = root.rstrip("/")
    if not stripped or stripped.endswith(":"):
        return root
    return stripped


def position_key(job: str, node: str, position: Position) -> str:
    """The prefix holding every attempt of one node's position, relative to the storage root."""
    return f"{validate_name(job, kind='job')}/{validate_name(node, kind='node')}/{position_dirname(position)}"


def checkpoint_key(job: str, node: str, position: Position, attempt: str | int) -> str:
    """The checkpoint's prefix relative to the storage root, from validated parts."""
    return f"{position_key(job, node, position)}/{validate_attempt(attempt)}"


def checkpoint_location(root: str, job: str, node: str, position: Position, attempt: str | int) -> str:
    """The checkpoint's full location: `<root>/<job>/<node>/<position>/<attempt>`."""
    return f"{normalize_root(root)}/{checkpoint_key(job, node, position, attempt)}"
