"""The presigned data path's filesystem: every storage call of a node without storage credentials as
plain HTTP requests to URLs the service signed (`ckptstore.client.service.signed_urls`), so `Store`, its verification,
fallback, tiers and replication run unchanged on top (`presigned_storage`).

What an S3 call becomes: a read is a GET (a range GET for part of an object), a size a HEAD, a listing
one LIST page after another, a write a PUT — or, past one part (`ckptstore.storage.filesystem.UPLOAD_PART_SIZE`),
a multipart upload whose parts are sent as they fill, so memory stays bounded; a blob's upload is
create-only (the service signs `If-None-Match: *`), and a blob already there is content-addressed, so
"already there" is success. Failures become the OSErrors `ckptstore.storage.failures` reads: 404 missing, 403
denied (after one retry with a fresh URL, in case the last one expired early), other 4xx misconfigured,
5xx and lost connections unavailable after a few tries; the service refusing to sign says why the same
way, and a fenced attempt raises FencedError.
"""

from __future__ import annotations

import errno
import random
import re
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator, Sequence
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import unquote

import httpx
from fsspec.spec import AbstractBufferedFile

from ckptstore.client.service.signed_urls import SignedUrlSource
from ckptstore.errors import CheckpointNotFoundError, FencedError, RequestRejectedError, ServiceUnavailableError
from ckptstore.format.layout import PROBE_DIR
from ckptstore.storage.filesystem import Storage
from ckptstore.storage.ranged import RangedReadFileSystem, range_header
from ckptstore.threads import map_threads
from ckptstore.wire.presign import SignedUrl, UrlWanted

__all__ = ["PresignedFileSystem", "presigned_storage"]

_TRIES = 4  # for a store that fails now (5xx, a lost connection)
_PARTS_AHEAD = 8  # part URLs asked for at once: one request to the service per 64 MiB uploaded
_CONCURRENCY = 16  # requests in flight for a batch of reads, listings' deletes
_XML = "{*}"  # S3 answers in its namespace, GCS's XML API in another


class PresignedFile(AbstractBufferedFile):
    """A streamed read (range GETs) or write: one PUT for an object of at most one part, else a multipart
    upload that sends each part as it fills and completes at close (`discard` aborts it)."""

    fs: PresignedFileSystem

    def _fetch_range(self, start: int, end: int) -> bytes:
        return self.fs.cat_file(self.path, start, end)

    def _initiate_upload(self) -> None:
        self._key = self.fs.key(self.path)
        self._upload_id: str | None = None
        self._etags: list[str] = []
        self._part_urls: dict[int, SignedUrl] = {}

    def _upload_chunk(self, final: bool = False) -> bool:
        data = self.buffer.getvalue()
        if final and self._upload_id is None:
            self.fs.request(UrlWanted(method="PUT", key=self._key), content=data, allow=(412,))
            return True
        if self._upload_id is None:
            started = self.fs.request(UrlWanted(method="POST", key=self._key))
            self._upload_id = _xml_text(started.content, "UploadId")
        if data:
            self._send_part(data)
        if final:
            self._complete()
        return True

    def _send_part(self, data: bytes) -> None:
        number = len(self._etags) + 1
        if number not in self._part_urls:
            wanted = [self._part(n) for n in range(number, number + _PARTS_AHEAD)]
            self._part_urls = dict(zip(range(number, number + _PARTS_AHEAD), self.fs._signed_all(wanted)))
        sent = self.fs.request(self._part(number), content=data, signed=self._part_urls.pop(number))
        self._etags.append(sent.headers["etag"])

    def _part(self, number: int) -> UrlWanted:
        return UrlWanted(method="PUT", key=self._key, upload_id=self._upload_id, part=number)

    def _complete(self) -> None:
        parts = "".join(
            f"<Part><PartNumber>{n}</PartNumber><ETag>{e}</ETag></Part>" for n, e in enumerate(self._etags, 1)
        )
        body = f"<CompleteMultipartUpload>{parts}</CompleteMultipartUpload>".encode()
        done = self.fs.request(
            UrlWanted(method="POST", key=self._key, upload_id=self._upload_id), content=body, allow=(412,)
        )
        if done.status_code == 412:
            self._abort()  # the blob was there already: this upload is not needed
        elif b"<Error>" in done.content:  # S3 may answer 200 and fail the completion in the body
            raise ConnectionError(f"completing the upload of {self._key} failed: {done.text[:300]}")

    def _abort(self) -> None:
        if self._upload_id is not None:
            self.fs.request(UrlWanted(method="DELETE", key=self._key, upload_id=self._upload_id), allow=(404,))
            self._upload_id = None

    def discard(self) -> None:
        if getattr(self, "_upload_id", None) is not None:
            self._abort()


class PresignedFileSystem(RangedReadFileSystem):
    """The objects of one job's storage root (`root`, as fsspec strips it: `bucket/prefix`), reached
    through signed URLs; every path is `root/key`, `key` relative to the job's root."""

    file_class = PresignedFile
    protocol = "ckptstore-presigned"
    cachable = False

    def __init__(self, root: str, urls: SignedUrlSource, *, http: httpx.Client | None = None):
        super().__init__()
        self.root = root.rstrip("/")
        self.bucket = self.root.split("/", 1)[0]
        self.urls = urls
        self.http = http or httpx.Client(
            timeout=httpx.Timeout(120.0, connect=10.0),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
        )

    # -- paths ---------------------------------------------------------------------------------

    def key(self, path: str) -> str:
        path = self._strip_protocol(path)
        if not path.startswith(self.root + "/"):
            raise PermissionError(errno.EACCES, f"{path} is outside this node's storage root {self.root}")
        return path[len(self.root) + 1 :]

    def _path_of(self, s3_key: str) -> str:
        return f"{self.bucket}/{unquote(s3_key)}".rstrip("/")

    # -- one request -----------------------------------------------------------------------------

    def request(
        self,
        wanted: UrlWanted,
        *,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        signed: SignedUrl | None = None,
        allow: Sequence[int] = (),
    ) -> httpx.Response:
        """Send `wanted` with its signed URL (`signed`, or asked for now): the answer when it succeeded
        or its status is in `allow`, else the OSError its failure means."""
        refreshed = False
        for attempt in range(_TRIES):
            url = signed or self._signed(wanted)
            signed = None
            try:
                response = self.http.request(
                    url.method if url.method != "LIST" else "GET",
                    url.url,
                    content=content,
                    headers={**url.headers, **(headers or {})},
                )
            except httpx.TransportError as exc:
                error: OSError = ConnectionError(f"{wanted.method} {wanted.key}: {type(exc).__name__}: {exc}")
            else:
                if response.is_success or response.status_code in allow:
                    return response
                error = _status_error(wanted, response)
                if response.status_code == 403 and not refreshed:
                    refreshed = True  # the URL may have expired early (a skewed clock): once more with a new one
                    self.urls.forget(wanted)
                    continue
                if response.status_code < 500:
                    raise error
            if attempt + 1 < _TRIES:
                time.sleep(0.1 * 2**attempt * (0.5 + random.random()))
        raise error

    def _signed(self, wanted: UrlWanted) -> SignedUrl:
        return self._signed_all([wanted])[0]

    def _signed_all(self, wanted: Sequence[UrlWanted]) -> list[SignedUrl]:
        try:
            return self.urls.get(wanted)
        except FencedError:
            raise
        except ServiceUnavailableError as exc:
            raise ConnectionError(f"the service that signs this node's storage URLs is away: {exc}") from exc
        except RequestRejectedError as exc:
            kind = errno.EACCES if exc.status in (401, 403) else errno.EINVAL
            raise OSError(kind, f"the service refused to sign {wanted[0].method} {wanted[0].key}: {exc}") from exc
        except CheckpointNotFoundError as exc:
            raise OSError(errno.EINVAL, f"the service cannot sign for this node: {exc}") from exc

    # -- reading ---------------------------------------------------------------------------------

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        headers = None if start is None and end is None else {"Range": range_header(start or 0, end)}
        return self.request(UrlWanted(method="GET", key=self.key(path)), headers=headers).content

    def cat_ranges(
        self, paths: list[str], starts: Any, ends: Any, max_gap: Any = None, on_error: str = "return", **kwargs: Any
    ) -> list[bytes | Exception]:
        wanted = [UrlWanted(method="GET", key=self.key(p)) for p in paths]
        signed = self._signed_all(wanted) if wanted else []

        def fetch(i: int) -> bytes | Exception:
            headers = (
                None if starts[i] is None and ends[i] is None else {"Range": range_header(starts[i] or 0, ends[i])}
            )
            try:
                return self.request(wanted[i], headers=headers, signed=signed[i]).content
            except Exception as exc:
                if on_error == "raise" or isinstance(exc, FencedError):
                    raise
                return exc

        return map_threads(fetch, range(len(paths)), _CONCURRENCY)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        key = self.key(path)
        head = self.request(UrlWanted(method="HEAD", key=key), allow=(404,))
        if head.status_code != 404:
            modified = head.headers.get("last-modified")
            mtime = parsedate_to_datetime(modified).timestamp() if modified else None
            size = int(head.headers.get("content-length", 0))
            return {"name": self._strip_protocol(path), "size": size, "type": "file", "mtime": mtime}
        for _ in self._list(key, delimiter=True):
            return {"name": self._strip_protocol(path), "size": 0, "type": "directory"}
        raise FileNotFoundError(errno.ENOENT, f"{path}: not found")

    def exists(self, path: str, **kwargs: Any) -> bool:
        try:
            self.info(path)
        except FileNotFoundError:
            return False
        return True

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        entries = list(self._list(self.key(path), delimiter=True))
        return entries if detail else [entry["name"] for entry in entries]

    def find(
        self, path: str, maxdepth: int | None = None, withdirs: bool = False, detail: bool = False, **kwargs: Any
    ) -> Any:
        found = {entry["name"]: entry for entry in self._list(self.key(path), delimiter=False)}
        return found if detail else sorted(found)

    def _list(self, key: str, *, delimiter: bool) -> Iterator[dict[str, Any]]:
        """The entries under the folder `key`, one LIST page after another."""
        continuation: str | None = None
        while True:
            wanted = UrlWanted(method="LIST", key=key, delimiter=delimiter, continuation=continuation)
            page = ElementTree.fromstring(self.request(wanted).content)
            for item in page.findall(f"{_XML}Contents"):
                modified = item.findtext(f"{_XML}LastModified")
                yield {
                    "name": self._path_of(item.findtext(f"{_XML}Key", "")),
                    "size": int(item.findtext(f"{_XML}Size", "0")),
                    "type": "file",
                    "LastModified": modified,
                }
            for prefix in page.findall(f"{_XML}CommonPrefixes"):
                yield {"name": self._path_of(prefix.findtext(f"{_XML}Prefix", "")), "size": 0, "type": "directory"}
            continuation = page.findtext(f"{_XML}NextContinuationToken")
            if page.findtext(f"{_XML}IsTruncated") != "true" or not continuation:
                return

    # -- writing and deleting --------------------------------------------------------------------

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        """One PUT; a create-only upload that finds its blob there already has written it."""
        self.request(UrlWanted(method="PUT", key=self.key(path)), content=bytes(value), allow=(412,))

    def rm_file(self, path: str) -> None:
        self.request(UrlWanted(method="DELETE", key=self.key(path)))

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        paths = [path] if isinstance(path, str) else list(path)
        # a folder is its objects (object stores have no folder to delete); a path with none under it, an object
        keys = [self.key(name) for p in paths for name in (self.find(p) if recursive else []) or [p]]
        wanted = [UrlWanted(method="DELETE", key=key) for key in dict.fromkeys(keys)]
        signed = self._signed_all(wanted) if wanted else []
        map_threads(lambda i: self.request(wanted[i], signed=signed[i]), range(len(wanted)), _CONCURRENCY)


def _xml_text(document: bytes, tag: str) -> str:
    found = re.search(rf"<{tag}>([^<]*)</{tag}>".encode(), document)
    if found is None:
        raise ConnectionError(f"the store's answer has no {tag}: {document[:300]!r}")
    return found.group(1).decode()


def _status_error(wanted: UrlWanted, response: httpx.Response) -> OSError:
    what = f"{wanted.method} {wanted.key}: the store answered {response.status_code} {response.text[:300]}"
    if response.status_code == 404:
        return FileNotFoundError(errno.ENOENT, what)
    if response.status_code in (401, 403):
        return PermissionError(errno.EACCES, what)
    if response.status_code >= 500 or response.status_code in (408, 429):
        return ConnectionError(what)
    return OSError(errno.EINVAL, what)


def presigned_storage(root_url: str, urls: SignedUrlSource, *, job: str, node: str) -> Storage:
    """A `Storage` over the job's root `root_url` (`s3://` or `gs://bucket/prefix`) whose every call goes through
    URLs from `urls`; the probe writes under the node's own folder (the service signs nothing else
    before the node has an attempt)."""
    root = root_url.split("://", 1)[-1].rstrip("/")
    return Storage(PresignedFileSystem(root, urls), root, probe_dir=f"{job}/{node}/{PROBE_DIR}")
