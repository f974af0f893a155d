"""The on-storage layout: every name ckptstore writes is built (and parsed) here.

    <root>/<job>/<node>/<epoch:010d>[.b<batch:010d>]/<attempt>/
        tensors-00000.safetensors …   shards
        MANIFEST.json                 written last; a manifest that parses and verifies = committed

The service and the client both build locations with `checkpoint_location`, so a commit's
location can be checked by string equality.
"""

from __future__ import annotations

import re

from ckptstore.names import validate_attempt, validate_name
from ckptstore.position import Position

__all__ = [
    "MANIFEST_TEMP_PREFIX",
    "MANIFEST_NAME",
    "PROBE_DIR",
    "shard_name",
    "is_shard_name",
    "position_dirname",
    "parse_position_dirname",
    "position_key",
    "checkpoint_key",
    "checkpoint_location",
    "normalize_root",
]

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_TEMP_PREFIX = ".MANIFEST.json.tmp-"
PROBE_DIR = ".ckptstore-probe"
_SHARD_RE = re.compile(r"tensors-([0-9]{5})\.safetensors\Z")
_POSITION_RE = re.compile(r"([0-9]{10})(?:\.b([0-9]{10}))?\Z")


def shard_name(index: int) -> str:
    return f"tensors-{index:05d}.safetensors"


def is_shard_name(name: str) -> bool:
    return _SHARD_RE.match(name) is not None


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
