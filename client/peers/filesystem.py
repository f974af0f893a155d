"""The filesystem a node reads another node's blob server through (`blob_server`), so `Store` — its
listing, verification, fallback and copying — runs unchanged on a peer's disk (`peer_store`).

Read-only: a read is a GET (a range GET for part of a file), a size a HEAD, a listing one GET with
`?list`. A whole file is read straight from the socket into one new buffer (`http.client`'s
`readinto`): a restore from a peer moves each byte once, as a raw transfer does (bench/peers.py).
Failures become the OSErrors `ckptstore.storage.failures` reads: 404 missing, 401/403 denied, a lost
connection or a 5xx unavailable — a peer is never waited for long (it is one of several sources), so
connections time out in seconds and a failed request is tried once more only.
"""

from __future__ import annotations

import errno
import http.client
import json
import queue
import time
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import numpy as np
from fsspec.spec import AbstractBufferedFile

from ckptstore import Store
from ckptstore.storage.filesystem import Storage
from ckptstore.storage.ranged import RangedReadFileSystem, range_header
from ckptstore.threads import map_threads

__all__ = ["PeerFileSystem", "peer_store"]

_TRIES = 2
_CONCURRENCY = 4  # streams a batch of reads takes: as many as a store's writers (more only contend here)
_CONNECT_TIMEOUT_S = 3.0
_READ_TIMEOUT_S = 60.0


class _Answer:
    """A response read whole: its status, headers and body (a new buffer for a file's bytes)."""

    def __init__(self, status: int, headers: http.client.HTTPMessage, body: np.ndarray):
        self.status, self.headers, self.body = status, headers, body

    def text(self) -> str:
        return self.body[:300].tobytes().decode(errors="replace")


class PeerFile(AbstractBufferedFile):
    """A streamed read of a peer's file, one range GET per block."""

    fs: PeerFileSystem

    def _fetch_range(self, start: int, end: int) -> bytes:
        return self.fs.cat_file(self.path, start, end)


class PeerFileSystem(RangedReadFileSystem):
    """The files of one blob server (`url`, with its `token`); paths are `<url>/own/…` or `<url>/held/…`."""

    file_class = PeerFile
    protocol = "ckptstore-peer"
    cachable = False
    read_only = True

    def __init__(self, url: str, token: str):
        super().__init__()
        self.url = url.rstrip("/")
        self._host = urlsplit(self.url).netloc
        self._auth = f"Bearer {token}"
        self._idle: queue.SimpleQueue[http.client.HTTPConnection] = queue.SimpleQueue()

    # -- one request -----------------------------------------------------------------------------

    def _request(
        self, method: str, path: str, *, headers: dict[str, str] | None = None, params: dict[str, str] | None = None
    ) -> _Answer:
        path = self._strip_protocol(path).removeprefix(self.url).strip("/")
        target = "/" + quote(path) + (f"?{urlencode(params)}" if params else "")
        error: OSError = ConnectionError(f"peer {self.url}: {method} {path}: not tried")
        for attempt in range(_TRIES):
            try:
                answer = self._exchange(method, target, headers or {})
            except (OSError, http.client.HTTPException) as exc:
                error = ConnectionError(f"peer {self.url}: {method} {path}: {type(exc).__name__}: {exc}")
            else:
                if 200 <= answer.status < 300:
                    return answer
                error = _status_error(self.url, method, path, answer)
                if answer.status < 500:
                    raise error
            if attempt + 1 < _TRIES:
                time.sleep(0.2)
        raise error

    def _exchange(self, method: str, target: str, headers: dict[str, str]) -> _Answer:
        """One request on an idle kept-alive connection (or a new one); the body read into one new buffer."""
        try:
            connection = self._idle.get_nowait()
        except queue.Empty:
            connection = http.client.HTTPConnection(self._host, timeout=_CONNECT_TIMEOUT_S)
            connection.connect()
            assert connection.sock is not None
            connection.sock.settimeout(_READ_TIMEOUT_S)
        try:
            connection.request(method, target, headers={"Authorization": self._auth, **headers})
            response = connection.getresponse()
            length = 0 if method == "HEAD" else int(response.getheader("content-length") or 0)
            body = np.empty(length, dtype=np.uint8)
            view, done = body.data, 0
            while done < length:
                got = response.readinto(view[done:])
                if not got:
                    raise http.client.IncompleteRead(b"", length - done)
                done += got
            response.read()  # the end of the response, so the connection can be reused
        except BaseException:
            connection.close()
            raise
        self._idle.put(connection)
        return _Answer(response.status, response.headers, body)

    # -- reading ---------------------------------------------------------------------------------

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> Any:
        """A whole file as one new uint8 array (moved once, from the socket); a range as bytes."""
        if start is None and end is None:
            return self._request("GET", path).body
        return self._request("GET", path, headers={"Range": range_header(start or 0, end)}).body.tobytes()

    def cat_ranges(
        self, paths: list[str], starts: Any, ends: Any, max_gap: Any = None, on_error: str = "return", **kwargs: Any
    ) -> list[Any]:
        def fetch(i: int) -> Any:
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
            entries = json.loads(self._request("GET", path, params=params).body.tobytes())
        except FileNotFoundError:
            return None
        return [{**entry, "name": f"{self.url}/{entry['name']}"} for entry in entries]


def _status_error(url: str, method: str, path: str, answer: _Answer) -> OSError:
    what = f"peer {url}: {method} {path} answered {answer.status} {answer.text()}"
    if answer.status == 404:
        return FileNotFoundError(errno.ENOENT, what)
    if answer.status in (401, 403):
        return PermissionError(errno.EACCES, what)
    if answer.status >= 500:
        return ConnectionError(what)
    return OSError(errno.EINVAL, what)


def peer_store(url: str, token: str, root: str) -> Store:
    """A read-only `Store` over one blob server's `root` (`blob_server.OWN`: that node's local tier;
    `blob_server.HELD`: the copies it holds for others), on the `peer` tier."""
    storage = Storage(PeerFileSystem(url, token), f"{url}/{root}")
    return Store(f"{url}/{root}", tier="peer", storage=storage)
