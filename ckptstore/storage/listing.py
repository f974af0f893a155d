"""What exists on storage: jobs, nodes, attempt prefixes and committed manifests, read uncached.

Invariant: "committed" is decided only by reading a manifest and parsing it against the path it
sits at (`parse_manifest(expect=...)`), never from a listing alone or from modification times;
"newest" is decided by position and attempt number.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator

from ckptstore.copykey import CopyKey
from ckptstore.errors import InvalidNameError
from ckptstore.format.layout import MANIFEST_NAME, parse_position_dirname, position_key
from ckptstore.format.manifest import Manifest, ManifestError, parse_manifest
from ckptstore.names import (
    ACCEPTED_ATTEMPT_LIMIT,
    Tier,
    attempt_number,
    attempt_sort_key,
    validate_attempt,
    validate_name,
)
from ckptstore.position import Position
from ckptstore.report import CheckpointInfo
from ckptstore.storage.filesystem import Storage, StoredFile

__all__ = [
    "valid_names",
    "stored_attempts",
    "committed_manifests",
    "newest_manifest",
    "manifest_owner",
    "refuse_foreign",
    "refuse_case_twins",
    "list_checkpoints",
    "manifest_keys",
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
    storage: Storage, job: str, node: str, position: Position, attempt: str | None
) -> Iterator[Manifest]:
    """The committed manifests at a position, newest attempt first (just `attempt`'s if given)."""
    attempts = [attempt] if attempt is not None else stored_attempts(storage, job, node, position)[::-1]
    for attempt_id in attempts:
        key = CopyKey(job, node, position, attempt_id)
        path = f"{key.relpath}/{MANIFEST_NAME}"
        try:
            data = storage.read_object(path)
        except FileNotFoundError:
            continue
        try:
            yield parse_manifest(bytes(data), expect=key)
        except ManifestError as exc:
            log.info("%s is not committed: %s", storage.path(path), exc)


def newest_manifest(storage: Storage, job: str, node: str) -> list[Manifest]:
    """The node's newest committed copy's manifest ([] when none), read newest first until one parses:
    a save's dedup base, without reading every manifest of a node that kept many copies."""
    for position, attempt in reversed(_manifest_prefixes(storage, job, node)):
        found = next(committed_manifests(storage, job, node, position, attempt), None)
        if found is not None:
            return [found]
    return []


def refuse_case_twins(storage: Storage, key: CopyKey) -> None:
    """InvalidNameError when the copy's job or node differs from an existing one only by case, on local
    disk (where such names can share one folder: macOS, Windows, SMB)."""
    if not storage.is_local:
        return
    for parent, name, kind in (("", key.job, "job"), (key.job, key.node, "node")):
        folded = name.casefold()
        twin = next((n for n in storage.list_names(parent) if n != name and n.casefold() == folded), None)
        if twin is not None:
            raise InvalidNameError(
                f"{kind} {name!r} differs from {twin!r} under {storage.root} only by case: on case-insensitive "
                "storage they would share one folder"
            )


def manifest_owner(storage: Storage, relpath: str) -> CopyKey | None:
    """The copy the manifest under `relpath` was written for, if one parses there."""
    try:
        data = storage.read_object(f"{relpath}/{MANIFEST_NAME}")
    except FileNotFoundError:
        return None
    try:
        manifest = parse_manifest(bytes(data))
    except ManifestError:
        return None
    return manifest.key()


def refuse_foreign(storage: Storage, key: CopyKey, location: str) -> None:
    """Refuse to delete a prefix that leads outside the root (a symbolic link on the way) or whose
    manifest names another job, node, position or attempt: it is not this checkpoint's to delete."""
    if storage.escapes(key.relpath):
        raise InvalidNameError(f"refusing to delete {location}: it leads outside {storage.root} (a symbolic link)")
    owner = manifest_owner(storage, key.relpath)
    if owner is not None and not owner.is_copy_of(key):
        raise InvalidNameError(f"refusing to delete {location}: its manifest belongs to another checkpoint")


def list_checkpoints(
    storage: Storage, url: str, job: str, node: str, *, tier: Tier, concurrency: int, skip: Collection[CopyKey] = ()
) -> list[CheckpointInfo]:
    """Every attempt prefix of a node on storage, committed or not, ordered by position and attempt —
    but those in `skip` (whose manifests are then not even read)."""
    groups = _attempt_prefixes(storage, job, node)
    keys = {group: CopyKey(job, node, group[0], group[1], tier) for group in groups}
    keys = {group: key for group, key in keys.items() if key not in skip}
    groups = {group: files for group, files in groups.items() if group in keys}
    manifest_paths = {
        group: f"{keys[group].relpath}/{MANIFEST_NAME}"
        for group, files in groups.items()
        if any(f.relpath.endswith("/" + MANIFEST_NAME) for f in files)
    }
    blobs = storage.read_objects(list(manifest_paths.values()), concurrency=concurrency)
    infos = []
    for group, files in groups.items():
        key, manifest, foreign = keys[group], None, False
        blob = blobs.get(manifest_paths.get(group, ""))
        if isinstance(blob, Exception) and not isinstance(blob, FileNotFoundError):
            raise blob
        if blob is not None and not isinstance(blob, Exception):
            try:
                manifest = parse_manifest(bytes(blob), expect=key)
            except ManifestError:
                foreign = _parses(bytes(blob))
        infos.append(
            CheckpointInfo(
                key=key,
                location=key.location(url),
                committed=manifest is not None,
                bytes=manifest.total_bytes if manifest is not None else sum(f.size for f in files),
                modified=max((f.mtime for f in files if f.mtime is not None), default=None),
                manifest=manifest,
                foreign=foreign,
            )
        )
    return sorted(infos, key=lambda i: (i.key.position, i.key.attempt_order))


def manifest_keys(storage: Storage, job: str, node: str, *, tier: Tier) -> list[CopyKey]:
    """The copies of a node whose prefix holds a manifest (committed, as far as names tell), from one
    listing and without reading a manifest."""
    return [CopyKey(job, node, position, attempt, tier) for position, attempt in _manifest_prefixes(storage, job, node)]


def _manifest_prefixes(storage: Storage, job: str, node: str) -> list[tuple[Position, str]]:
    """The (position, attempt) prefixes of a node holding a manifest, oldest first."""
    prefixes = _attempt_prefixes(storage, job, node)
    found = [p for p, files in prefixes.items() if any(f.relpath.endswith("/" + MANIFEST_NAME) for f in files)]
    return sorted(found, key=lambda prefix: (prefix[0], attempt_sort_key(prefix[1])))


def _attempt_prefixes(storage: Storage, job: str, node: str) -> dict[tuple[Position, str], list[StoredFile]]:
    """The files of a node, by the (position, attempt) prefix holding them."""
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
    return groups


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
                if attempt_number(attempt) < ACCEPTED_ATTEMPT_LIMIT:  # a planted huge id must not stop the counting
                    highest = max(highest, attempt_number(attempt))
    return highest
