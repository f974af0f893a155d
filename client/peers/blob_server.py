"""The read-only HTTP server of a training process's local tier, for the job's other nodes: a peer pulls
the copies it holds for this node from it, and a node restoring reads the copies this one holds for it.

    GET|HEAD /own/<job>/<path>   a file of the job on the local tier (Range: bytes=a-b answered 206)
    GET|HEAD /held/<job>/<path>  a file of the copies this node holds for others (<local root>/.peers)
    GET /own|held/<job>/…?list   the entries under a folder, JSON: [{"name", "size", "type", "mtime"}];
                                 &recursive lists every file below it

Every request carries `Authorization: Bearer <token>` (the token this process registered with the
service, for one job); a path names that job's folder or something in it — a few names of the storage
layout's characters, never `..` —, and never leaves the root through a link: a local root that other
jobs share shows them nothing. Files are sent with sendfile(2), so a transfer costs the kernel's copy only.
"""

from __future__ import annotations

import hmac
import json
import os
import re
import secrets
import socket
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from ckptstore.names import validate_name

__all__ = ["BlobServer", "HELD_DIR", "OWN", "HELD"]

HELD_DIR = ".peers"  # under a local tier root: the copies this node holds for other nodes
OWN, HELD = "own", "held"  # the two roots a blob server serves
_SEGMENT = re.compile(r"[A-Za-z0-9._-]{1,255}\Z")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # a restore's readers and a holder's pulls connect at once (read at listen)


class BlobServer:
    """Serves `job`'s folders of `local_root` (as /own) and of `local_root/.peers` (as /held) on `host`, from
    a thread of its own; `url` is where the job's other nodes reach it (`advertise`: the host name they use)."""

    def __init__(
        self, local_root: str, job: str, *, host: str = "0.0.0.0", port: int = 0, advertise: str | None = None
    ):
        self.token = secrets.token_urlsafe(32)
        roots = {OWN: os.path.realpath(local_root), HELD: os.path.realpath(os.path.join(local_root, HELD_DIR))}
        self._connections: set[socket.socket] = set()
        self._server = _Server(
            (host, port), _handler(roots, validate_name(job, kind="job"), self.token, self._connections)
        )
        name = advertise or (host if host not in ("0.0.0.0", "") else _own_address())
        self.url = f"http://{name}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="ckptstore-blob-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop answering, and end the connections kept alive (a reader mid-transfer sees it fail)."""
        self._server.shutdown()
        self._server.server_close()
        for connection in list(self._connections):
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _own_address() -> str:
    """This machine's address as the job's other machines see it: the one its host name resolves to."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.gethostname()


def _handler(
    roots: dict[str, str], job: str, token: str, connections: set[socket.socket]
) -> type[BaseHTTPRequestHandler]:
    expected = f"Bearer {token}".encode()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a restore's many reads share connections
        server_version = "ckptstore-blobs"

        def setup(self) -> None:
            super().setup()
            connections.add(self.connection)

        def finish(self) -> None:
            connections.discard(self.connection)
            super().finish()

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per request would drown the training's output

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _answer(self, *, body: bool) -> None:
            given = self.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                self._fail(HTTPStatus.UNAUTHORIZED, "a job's blob server answers its token only")
                return
            parts = urlsplit(self.path)
            path = _local_path(roots, job, unquote(parts.path))
            if path is None:
                self._fail(HTTPStatus.NOT_FOUND, "no such path")
                return
            query = parse_qs(parts.query, keep_blank_values=True)
            if "list" in query:
                self._list(path, recursive="recursive" in query)
            else:
                self._file(path, body=body)

        def _list(self, path: str, *, recursive: bool) -> None:
            if not os.path.isdir(path):
                self._fail(HTTPStatus.NOT_FOUND, "no such folder")
                return
            prefix = urlsplit(self.path).path.strip("/")
            entries = _walk(path, prefix) if recursive else _entries(path, prefix)
            self._send_bytes(json.dumps(entries).encode(), "application/json")

        def _file(self, path: str, *, body: bool) -> None:
            try:
                handle = open(path, "rb")
            except OSError:
                self._fail(HTTPStatus.NOT_FOUND, "no such file")
                return
            with handle:
                size = os.fstat(handle.fileno()).st_size
                start, end = 0, size
                wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
                if wanted:
                    start = int(wanted.group(1))
                    end = min(size, int(wanted.group(2)) + 1) if wanted.group(2) else size
                    if (start >= size and size) or end < start:
                        self._fail(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE, "range past the end")
                        return
                self.send_response(HTTPStatus.PARTIAL_CONTENT if wanted else HTTPStatus.OK)
                if wanted:
                    self.send_header("Content-Range", f"bytes {start}-{max(start, end - 1)}/{size}")
                self.send_header("Content-Length", str(end - start))
                self.send_header("Last-Modified", self.date_time_string(int(os.fstat(handle.fileno()).st_mtime)))
                self.end_headers()
                if body and end > start:
                    self.connection.sendfile(handle, start, end - start)

        def _send_bytes(self, data: bytes, kind: str) -> None:
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _fail(self, status: HTTPStatus, why: str) -> None:
            data = why.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    return Handler


def _local_path(roots: dict[str, str], job: str, path: str) -> str | None:
    """The file or folder a request path names under its root, or None: an unknown root, another job's
    folder (or none), a name outside the layout's characters, `.`/`..`, or a link that leads out of the
    root."""
    names = [n for n in path.split("/") if n]
    if len(names) < 2 or names[0] not in roots or names[1] != job:
        return None
    root, names = roots[names[0]], names[1:]
    if any(not _SEGMENT.match(n) or n in (".", "..") for n in names):
        return None
    found = os.path.realpath(os.path.join(root, *names))
    return found if found == root or found.startswith(root + os.sep) else None


def _entries(folder: str, prefix: str) -> list[dict[str, Any]]:
    entries = []
    with os.scandir(folder) as found:
        for entry in found:
            if entry.name.startswith(".") and entry.name != ".blobs":
                continue
            try:
                info = entry.stat()
            except OSError:
                continue  # deleted meanwhile
            kind = "directory" if entry.is_dir() else "file"
            entries.append(
                {"name": f"{prefix}/{entry.name}", "size": info.st_size, "type": kind, "mtime": info.st_mtime}
            )
    return entries


def _walk(folder: str, prefix: str) -> list[dict[str, Any]]:
    files = []
    for here, folders, names in os.walk(folder):
        folders[:] = [f for f in folders if not f.startswith(".") or f == ".blobs"]
        relative = os.path.relpath(here, folder)
        base = prefix if relative == "." else f"{prefix}/{relative}"
        for name in names:
            try:
                info = os.stat(os.path.join(here, name))
            except OSError:
                continue
            files.append({"name": f"{base}/{name}", "size": info.st_size, "type": "file", "mtime": info.st_mtime})
    return files
