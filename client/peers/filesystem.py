"""The filesystem a node reads another node's blob server through (`blob_server`), so `Store` — its
listing, verification, fallback and copying — runs unchanged on a peer's disk (`peer_store`).

Read-only: a read is a GET (a range GET for part of a file), a size a HEAD, a listing one GET with
`?list`. Failures become the OSErrors `ckptstore.storage.failures` reads: 404 missing, 401/403 denied,
a lost connection or a 5xx unavailable — a peer is never waited for long (it is one of several
sources), so connections time out in seconds and a failed request is tried once more only.
"""

from __future__ import annotations

import errno
import time
from typing import Any

import httpx
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from ckptstore import Store
from ckptstore.storage.filesystem import UPLOAD_PART_SIZE, Storage
from ckptstore.threads import map_threads

__all__ = ["PeerFileSystem", "peer_store"]

_TRIES = 2
_CONCURRENCY = 16
_TIMEOUT = httpx.Timeout(60.0, connect=3.0)


class PeerFileSystem(AbstractFileSystem):
    """The files of one blob server (`url`, with its `token`); paths are `<url>/own/…` or `<url>/held/…`."""

    protocol = "ckptstore-peer"
    cachable = False

    def __init__(self, url: str, token: str, *, http: httpx.Client | None = None):
        super().__init__()
        self.url = url.rstrip("/")
        self.http = http or httpx.Client(
            timeout=_TIMEOUT,
            headers={"Authorization": f"Bearer {token}"},
            limits=httpx.Limits(max_connections=_CONCURRENCY, max_keepalive_connections=_CONCURRENCY),
        )

    def _request(
        self, method: str, path: str, *, headers: dict[str, str] | None = None, params: dict[str, str] | None = None
    ) -> httpx.Response:
        path = self._strip_protocol(path).removeprefix(self.url).strip("/")
        error: OSError = ConnectionError(f"{method} {self.url}/{path}: not tried")
        for attempt in range(_TRIES):
            try:
                response = self.http.request(method, f"{self.url}/{path}", headers=headers, params=params)
            except httpx.TransportError as exc:
                error = ConnectionError(f"peer {self.url}: {method} {path}: {type(exc).__name__}: {exc}")
            else:
                if response.is_success:
                    return response
                error = _status_error(self.url, method, path, response)
                if response.status_code < 500:
                    raise error
            if attempt + 1 < _TRIES:
                time.sleep(0.2)
        raise error

    # -- reading ---------------------------------------------------------------------------------

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        headers = None if start is None and end is None else {"Range": _range(start or 0, end)}
        return self._request("GET", path, headers=headers).content

    def cat(
        self, path: Any, recursive: bool = False, on_error: str = "raise", batch_size: int | None = None, **kwargs: Any
    ) -> Any:
        paths = [path] if isinstance(path, str) else list(path)
        found = self.cat_ranges(paths, [None] * len(paths), [None] * len(paths), on_error=on_error)
        return found[0] if isinstance(path, str) else dict(zip(paths, found))

    def cat_ranges(
        self, paths: list[str], starts: Any, ends: Any, max_gap: Any = None, on_error: str = "return", **kwargs: Any
    ) -> list[bytes | Exception]:
        def fetch(i: int) -> bytes | Exception:
            try:
                return self.cat_file(paths[i], starts[i], ends[i])
            except Exception as exc:
                if on_error == "raise":
                    raise
                return exc

        return map_threads(fetch, range(len(paths)), _CONCURRENCY)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        name = self._strip_protocol(path)
        try:
            head = self._request("HEAD", path)
        except FileNotFoundError:
            if self._listing(path, recursive=False) is None:
                raise
            return {"name": name, "size": 0, "type": "directory"}
        return {"name": name, "size": int(head.headers.get("content-length", 0)), "type": "file"}

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        entries = self._listing(path, recursive=False)
        if entries is None:
            raise FileNotFoundError(errno.ENOENT, f"{path}: not found")
        return entries if detail else [entry["name"] for entry in entries]

    def find(
        self, path: str, maxdepth: int | None = None, withdirs: bool = False, detail: bool = False, **kwargs: Any
    ) -> Any:
        found = {entry["name"]: entry for entry in self._listing(path, recursive=True) or []}
        return found if detail else sorted(found)

    def _listing(self, path: str, *, recursive: bool) -> list[dict[str, Any]] | None:
        """The entries under the folder `path`, or None when there is no such folder."""
        params = {"list": "", "recursive": ""} if recursive else {"list": ""}
        try:
            entries = self._request("GET", path, params=params).json()
        except FileNotFoundError:
            return None
        return [{**entry, "name": f"{self.url}/{entry['name']}"} for entry in entries]

    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: Any = None,
        autocommit: bool = True,
        cache_options: Any = None,
        **kwargs: Any,
    ) -> PeerFile:
        if mode != "rb":
            raise PermissionError(errno.EROFS, f"a peer's blob server is read-only: {path}")
        kwargs["cache_type"] = "none"
        return PeerFile(self, path, mode, block_size or UPLOAD_PART_SIZE, **kwargs)


class PeerFile(AbstractBufferedFile):
    """A streamed read of a peer's file, one range GET per block."""

    fs: PeerFileSystem

    def _fetch_range(self, start: int, end: int) -> bytes:
        return self.fs.cat_file(self.path, start, end)


def _range(start: int, end: int | None) -> str:
    return f"bytes={start}-{'' if end is None else end - 1}"


def _status_error(url: str, method: str, path: str, response: httpx.Response) -> OSError:
    what = f"peer {url}: {method} {path} answered {response.status_code} {response.text[:200]}"
    if response.status_code == 404:
        return FileNotFoundError(errno.ENOENT, what)
    if response.status_code in (401, 403):
        return PermissionError(errno.EACCES, what)
    if response.status_code >= 500:
        return ConnectionError(what)
    return OSError(errno.EINVAL, what)


def peer_store(url: str, token: str, root: str) -> Store:
    """A read-only `Store` over one blob server's `root` (`blob_server.OWN`: that node's local tier;
    `blob_server.HELD`: the copies it holds for others), on the `peer` tier."""
    storage = Storage(PeerFileSystem(url, token), f"{url}/{root}")
    return Store(f"{url}/{root}", tier="peer", storage=storage)
