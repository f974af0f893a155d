"""What exists on storage: jobs, nodes, attempt prefixes and committed manifests, read uncached.

Invariant: "committed" is decided only by reading a manifest and parsing it against the path it
sits at (`parse_manifest(expect=...)`), never from a listing alone or from modification times;
"newest" is decided by position and attempt number.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from ckptstore.layout import MANIFEST_NAME, checkpoint_key, parse_position_dirname, position_key
from ckptstore.manifest import Manifest, ManifestError, parse_manifest
from ckptstore.names import ATTEMPT_LIMIT, attempt_number, attempt_sort_key, validate_attempt, validate_name
from ckptstore.position import Position
from ckptstore.report import CheckpointInfo
from ckptstore.storage import Storage, StoredFile

__all__ = [
    "valid_names",
    "stored_attempts",
    "committed_manifests",
    "manifest_owner",
    "case_twin",
    "list_checkpoints",
    "highest_attempt",
]

log = logging.getLogger("ckptstore")


def valid_names(storage: Storage, relpath: str, kind: str, *, exclude: str | None = None) -> list[str]:
    """Entries under `relpath` that are valid job or node names, sorted."""
    names = []
    for name in storage.list_names(relpath):
        try:
            names.append(validate_name(name, kind=kind))
        except ValueError:
            continue
    return sorted(n for n in names if n != exclude)


def stored_attempts(storage: Storage, job: str, node: str, position: Position) -> list[str]:
    """The attempt prefixes stored at a position (committed or not), oldest first."""
    found = []
    for name in storage.list_names(position_key(job, node, position)):
        try:
            found.append(validate_attempt(name))
        except ValueError:
            continue
    return sorted(found, key=attempt_sort_key)


def committed_manifests(
    storage: Storage, job: str, node: str, position: Position, attempt: str | int | None
) -> Iterator[tuple[str, Manifest]]:
    """Committed (attempt, manifest) pairs at a position, newest attempt first (just `attempt` if given)."""
    if attempt is not None:
        attempts = [validate_attempt(attempt)]
    else:
        attempts = stored_attempts(storage, job, node, position)[::-1]
    for attempt_id in attempts:
        path = f"{checkpoint_key(job, node, position, attempt_id)}/{MANIFEST_NAME}"
        try:
            data = storage.read_object(path)
        except FileNotFoundError:
            continue
        try:
            yield attempt_id, parse_manifest(bytes(data), expect=(job, node, position, attempt_id))
        except ManifestError as exc:
            log.info("%s is not committed: %s", storage.path(path), exc)


def case_twin(storage: Storage, parent: str, name: str) -> str | None:
    """An entry of `parent` that differs from `name` only by case (on local disk, where such names
    can share one folder: macOS, Windows, SMB), or None."""
    if not storage.is_local:
        return None
    folded = name.casefold()
    return next((n for n in storage.list_names(parent) if n != name and n.casefold() == folded), None)


def manifest_owner(storage: Storage, key: str) -> tuple[str, str, Position, str] | None:
    """(job, node, position, attempt) that the manifest under `key` was written for, if one parses there."""
    try:
        data = storage.read_object(f"{key}/{MANIFEST_NAME}")
    except FileNotFoundError:
        return None
    try:
        manifest = parse_manifest(bytes(data))
    except ManifestError:
        return None
    return manifest.job, manifest.node, manifest.position, manifest.attempt


def list_checkpoints(storage: Storage, url: str, job: str, node: str, *, concurrency: int) -> list[CheckpointInfo]:
    """Every attempt prefix of a node on storage, committed or not, ordered by position and attempt."""
    validate_name(job, kind="job")
    validate_name(node, kind="node")
    groups: dict[tuple[Position, str], list[StoredFile]] = {}
    for stored in storage.find(f"{job}/{node}"):
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
    blobs = storage.read_objects(list(manifest_paths.values()), concurrency=concurrency)
    infos = []
    for (position, attempt), files in groups.items():
        manifest, foreign = None, False
        blob = blobs.get(manifest_paths.get((position, attempt), ""))
        if isinstance(blob, Exception) and not isinstance(blob, FileNotFoundError):
            raise blob
        if blob is not None and not isinstance(blob, Exception):
            try:
                manifest = parse_manifest(bytes(blob), expect=(job, node, position, attempt))
            except ManifestError:
                foreign = _parses(bytes(blob))
        infos.append(
            CheckpointInfo(
                node=node,
                position=position,
                attempt=attempt,
                location=f"{url}/{checkpoint_key(job, node, position, attempt)}",
                committed=manifest is not None,
                bytes=sum(f.size for f in files),
                modified=max((f.mtime for f in files if f.mtime is not None), default=None),
                manifest=manifest,
                foreign=foreign,
            )
        )
    return sorted(infos, key=lambda i: (i.position, attempt_sort_key(i.attempt)))


def _parses(data: bytes) -> bool:
    try:
        parse_manifest(data)
    except ManifestError:
        return False
    return True


def highest_attempt(storage: Storage, job: str, node: str) -> int:
    """The highest attempt number stored for a node at any position (0 when there is none)."""
    validate_name(job, kind="job")
    validate_name(node, kind="node")
    highest = 0
    for posdir in storage.list_names(f"{job}/{node}"):
        position = parse_position_dirname(posdir)
        if position is not None:
            for attempt in stored_attempts(storage, job, node, position):
                if attempt_number(attempt) < ATTEMPT_LIMIT:  # a planted huge id must not stop the counting
                    highest = max(highest, attempt_number(attempt))
    return highest
