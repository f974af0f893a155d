"""Short-lived URLs to a job's objects, signed with the service's own storage credentials (SigV4), so
that a node holding only its job token reads and writes its checkpoints on S3 directly — the service
never moves a byte of them.

What a URL may name (`scope`): a write only under the node's own current attempt prefix
(`{job}/{node}/{position}/{attempt}/{file}`), a blob of its own pool as a create-only upload
(`If-None-Match: *`, signed: an existing blob is never overwritten, and readers verify every blob by its
hash anyway) or its reference marker in a fork parent's pool; a read anywhere under the job or an
ancestor it was forked from. Everything else is refused (403) before anything is signed; a key that
could leave its root (`..`, empty segments) is invalid (422). The credentials come from the
service's environment (`AWS_*`) or `storage_options` for the job's root in its settings.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping
from typing import Any, Literal

from ckptstore.errors import InvalidNameError
from ckptstore.layout import parse_blob_key, parse_position_dirname, pool_reference
from ckptstore.names import validate_attempt
from ckptstore.presign_schema import SignedUrl
from server.errors import ApiError

__all__ = ["scope", "Signer", "CREATE_ONLY", "valid_attempt"]

CREATE_ONLY = {"If-None-Match": "*"}
Method = Literal["GET", "PUT"]


def _segments(key: str) -> list[str]:
    parts = key.split("/")
    if any(part in ("", ".", "..") for part in parts) or "\\" in key or "\x00" in key:
        raise ApiError.invalid(f"key {key!r} is not a plain relative path under the job's root")
    return parts


def scope(method: Method, key: str, *, job: str, node: str, attempt: str, readable: Collection[str]) -> bool:
    """Check that `key` is the node's to read or write (403 otherwise); whether a write is create-only."""
    parts = _segments(key)
    if method == "GET":
        if parts[0] in readable:
            return False
        raise ApiError(403, "forbidden", f"{key!r} is not under job {job!r} or a job it was forked from")
    if len(parts) == 5 and parts[:2] == [job, node] and parts[3] == attempt:
        if parse_position_dirname(parts[2]) is not None:
            return False
    blob = parse_blob_key(key)
    if blob is not None and blob[:2] == (job, node):
        return True
    if len(parts) > 4 and parts[0] in readable and _is_reference(parts, job, node):
        return False  # its marker in the pool of a job it was forked from
    raise ApiError(
        403, "forbidden", f"{key!r} is outside {job}/{node}'s attempt {attempt} prefix and its blob pool: not writable"
    )


def _is_reference(parts: list[str], job: str, node: str) -> bool:
    try:
        return "/".join(parts) == pool_reference(parts[0], parts[1], job, node)
    except InvalidNameError:
        return False


class Signer:
    """Presigns S3 requests per storage root, with a botocore client per root (made once)."""

    def __init__(self, storage_options: Mapping[str, Mapping[str, Any]]):
        self._options = {root.rstrip("/"): dict(options) for root, options in storage_options.items()}
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()

    def sign(self, root: str, method: Method, key: str, expires_s: int, *, create_only: bool) -> SignedUrl:
        if not root.startswith("s3://"):
            raise ApiError.invalid(f"presigned URLs need an s3:// storage root; the job's is {root!r}")
        bucket, _, prefix = root.removeprefix("s3://").partition("/")
        params: dict[str, Any] = {"Bucket": bucket, "Key": f"{prefix.strip('/')}/{key}".lstrip("/")}
        if create_only:
            params["IfNoneMatch"] = "*"
        operation = "get_object" if method == "GET" else "put_object"
        url = self._client(root).generate_presigned_url(operation, Params=params, ExpiresIn=expires_s)
        return SignedUrl(method=method, key=key, url=url, headers=dict(CREATE_ONLY) if create_only else {})

    def _client(self, root: str) -> Any:
        with self._lock:
            found = self._clients.get(root)
            if found is None:
                found = self._clients[root] = _s3_client(self._options_for(root))
            return found

    def _options_for(self, root: str) -> dict[str, Any]:
        """The options of the longest configured root that `root` lies under (whole segments), or none."""
        matches = [r for r in self._options if root == r or root.startswith(r + "/")]
        return self._options[max(matches, key=len)] if matches else {}


def _s3_client(options: Mapping[str, Any]) -> Any:
    """A botocore S3 client from s3fs-style options (`key`, `secret`, `token`, `endpoint_url`,
    `client_kwargs`: {"region_name"}); what is not given comes from the environment (AWS_*)."""
    try:
        import botocore.session
        from botocore.config import Config
    except ImportError:
        raise ApiError(503, "unavailable", "this service cannot sign URLs: install ckptstore[s3] (botocore)") from None

    region = options.get("client_kwargs", {}).get("region_name") or options.get("region_name")
    addressing = "path" if options.get("endpoint_url") else "auto"
    return botocore.session.get_session().create_client(
        "s3",
        endpoint_url=options.get("endpoint_url"),
        aws_access_key_id=options.get("key"),
        aws_secret_access_key=options.get("secret"),
        aws_session_token=options.get("token"),
        region_name=region or "us-east-1",
        config=Config(signature_version="s3v4", s3={"addressing_style": addressing}),
    )


def valid_attempt(attempt: str) -> str:
    """A registered attempt's id (offline attempts, `3-ab12cd34`, were never registered: 409)."""
    attempt = validate_attempt(attempt)
    if "-" in attempt:
        raise ApiError(409, "fenced", f"attempt {attempt} is an offline attempt: register one to get URLs")
    return attempt
