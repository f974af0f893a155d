"""Short-lived URLs to a job's objects, signed with the service's own storage credentials (SigV4 for S3,
`ckptstore.server.presign.s3`; V4 signed URLs for GCS, `ckptstore.server.presign.gcs`), so that a node holding only its job token
reads and writes its checkpoints directly — the service never moves a byte of them.

What a URL may name (`scope`): a write only under the node's own current attempt prefix
(`{job}/{node}/{position}/{attempt}/{file}`, a multipart upload's steps included), a blob of its own
pool as a create-only upload (signed: an existing blob is never overwritten, and readers verify every
blob by its hash anyway) or its reference marker in a fork parent's pool; a delete under the node's
own folder (retention, blob collection); the node's storage probe, before it has an attempt; a read
or a listing anywhere under the job or an ancestor it was forked from. Everything else is refused
(403) before anything is signed; a key that could leave its root (`..`, empty segments) is invalid
(422). The credentials come from the service's environment or `storage_options` for the job's root
in its settings.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from ckptstore.errors import InvalidNameError
from ckptstore.format.layout import PROBE_DIR, parse_blob_key, parse_position_dirname, pool_reference
from ckptstore.names import validate_attempt
from ckptstore.server.errors import ApiError
from ckptstore.server.presign.gcs import GcsSigning
from ckptstore.server.presign.s3 import S3Signing, Signing
from ckptstore.wire.presign import SignedUrl, UrlWanted

__all__ = ["scope", "Signer", "valid_attempt"]


def _segments(key: str) -> list[str]:
    parts = key.split("/")
    if any(part in ("", ".", "..") for part in parts) or "\\" in key or "\x00" in key:
        raise ApiError.invalid(f"key {key!r} is not a plain relative path under the job's root")
    return parts


def scope(wanted: UrlWanted, *, job: str, node: str, attempt: str | None, forked_at: Mapping[str, str]) -> bool:
    """Check that `wanted` is the node's to ask for (403 otherwise; a write without `attempt` 422);
    whether its write is create-only. `forked_at`: each job this one was forked from (its parent, that
    job's parent, …) and the position folder it was forked at."""
    parts, key = _segments(wanted.key), wanted.key
    if wanted.method in ("GET", "HEAD", "LIST"):
        if parts[0] == job or _at_fork_point(wanted, parts, forked_at):
            return False
        raise ApiError(
            403, "forbidden", f"{key!r} is not under job {job!r} nor a copy it was forked from (or one of its blobs)"
        )
    if len(parts) == 4 and parts[:3] == [job, node, PROBE_DIR]:
        return False  # the node's storage probe: a throwaway object, written before any attempt
    if attempt is None:
        raise ApiError.invalid(f"{wanted.method} {key!r} writes: it needs the node's current `attempt`")
    if wanted.method == "DELETE" and wanted.upload_id is None:
        if (len(parts) > 2 and parts[:2] == [job, node]) or _is_reference(parts, job, node):
            return False
        raise ApiError(403, "forbidden", f"{key!r} is not {job}/{node}'s to delete")
    if len(parts) == 5 and parts[:2] == [job, node] and parts[3] == attempt:
        if parse_position_dirname(parts[2]) is not None:
            return False
    blob = parse_blob_key(key)
    if blob is not None and blob[:2] == (job, node):
        return True
    if len(parts) > 4 and parts[0] in forked_at and _is_reference(parts, job, node):
        return False  # its marker in the pool of a job it was forked from
    raise ApiError(
        403, "forbidden", f"{key!r} is outside {job}/{node}'s attempt {attempt} prefix and its blob pool: not writable"
    )


def _at_fork_point(wanted: UrlWanted, parts: list[str], forked_at: Mapping[str, str]) -> bool:
    """A read in a job this one was forked from: its copies at the fork point (any node, any attempt),
    or a blob of its pools by content id (the fork point's copies name theirs; an id cannot be guessed,
    and a pool is never listed)."""
    position = forked_at.get(parts[0])
    if position is None:
        return False
    if len(parts) >= 3 and parts[2] == position:
        return True
    return wanted.method != "LIST" and parse_blob_key(wanted.key) is not None


def _is_reference(parts: list[str], job: str, node: str) -> bool:
    try:
        return "/".join(parts) == pool_reference(parts[0], parts[1], job, node)
    except InvalidNameError:
        return False


class Signer:
    """Presigns requests per storage root — S3 (`ckptstore.server.presign.s3`) or GCS (`ckptstore.server.presign.gcs`) — with one
    signing client per root (made on first use, from the options of the longest configured root it
    lies under)."""

    def __init__(self, storage_options: Mapping[str, Mapping[str, Any]]):
        self._options = {root.rstrip("/"): dict(options) for root, options in storage_options.items()}
        self._clients: dict[str, Signing] = {}
        self._lock = threading.Lock()

    def sign(self, root: str, wanted: UrlWanted, expires_s: int, *, create_only: bool) -> SignedUrl:
        scheme, _, path = root.partition("://")
        if scheme not in ("s3", "gs"):
            raise ApiError.invalid(f"presigned URLs need an s3:// or gs:// storage root; the job's is {root!r}")
        bucket, _, prefix = path.partition("/")
        key = f"{prefix.strip('/')}/{wanted.key}".lstrip("/")
        url, headers = self._client(root, scheme).sign(bucket, key, wanted, expires_s, create_only=create_only)
        return SignedUrl(method=wanted.method, key=wanted.key, url=url, headers=headers)

    def _client(self, root: str, scheme: str) -> Signing:
        with self._lock:
            found = self._clients.get(root)
            if found is None:
                options = self._options_for(root)
                found = self._clients[root] = S3Signing(options) if scheme == "s3" else GcsSigning(options)
            return found

    def _options_for(self, root: str) -> dict[str, Any]:
        """The options of the longest configured root that `root` lies under (whole segments), or none."""
        matches = [r for r in self._options if root == r or root.startswith(r + "/")]
        return self._options[max(matches, key=len)] if matches else {}


def valid_attempt(attempt: str) -> str:
    """A registered attempt's id (offline attempts, `3-ab12cd34`, were never registered: 409)."""
    attempt = validate_attempt(attempt)
    if "-" in attempt:
        raise ApiError(409, "fenced", f"attempt {attempt} is an offline attempt: register one to get URLs")
    return attempt
