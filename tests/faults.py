"""A fault-injecting HTTP proxy on loopback, in front of a real S3 endpoint (moto's server).

Each request is, with probability `rate`, answered with one fault drawn from `kinds` instead of
(or on top of) the real answer: `500` (InternalError), `503` (SlowDown), `reset` (the connection
is dropped without an answer), `lost` (forwarded — the store acts on it — but the answer is dropped),
`latency` (forwarded 0.2 s late) and `truncate` (the real answer with its full Content-Length but
only half its body). `injected` counts what was done.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

__all__ = ["FaultProxy", "KINDS"]

KINDS = ("500", "503", "reset", "lost", "latency", "truncate")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}
S3_ERROR = "<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{message}</Message></Error>"


class FaultProxy:
    """`FaultProxy(target).endpoint_url` forwards to `target`, injecting faults at `rate` (changeable)."""

    def __init__(self, target: str, *, rate: float = 0.0, kinds: tuple[str, ...] = KINDS, seed: int = 0):
        self.target = urlsplit(target)
        self.rate = rate
        self.kinds = kinds
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.injected: Counter[str] = Counter()
        self.requests = 0
        self.methods: Counter[str] = Counter()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                proxy.methods[self.command] += 1
                fault = proxy._draw()
                if fault in ("reset", "lost"):
                    if fault == "lost":
                        proxy._forward(self.command, self.path, self.headers, body)
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return
                if fault in ("500", "503"):
                    code = "InternalError" if fault == "500" else "SlowDown"
                    payload = S3_ERROR.format(code=code, message="injected by FaultProxy").encode()
                    self.send_response(int(fault))
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                if fault == "latency":
                    time.sleep(0.2)
                status, headers, answer = proxy._forward(self.command, self.path, self.headers, body)
                self.send_response(status)
                for name, value in headers:
                    if name.lower() not in HOP_BY_HOP and name.lower() != "content-length":
                        self.send_header(name, value)
                # A HEAD answer has no body but tells the object's size.
                upstream = dict((k.lower(), v) for k, v in headers).get("content-length", "0")
                self.send_header("Content-Length", upstream if self.command == "HEAD" else str(len(answer)))
                self.end_headers()
                if fault == "truncate" and len(answer) > 1 and self.command != "HEAD":
                    self.wfile.write(answer[: len(answer) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if self.command != "HEAD":
                    self.wfile.write(answer)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint_url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def _draw(self) -> str | None:
        with self.lock:
            self.requests += 1
            if self.random.random() >= self.rate:
                return None
            fault = self.random.choice(self.kinds)
            self.injected[fault] += 1
            return fault

    def _forward(self, method: str, path: str, headers, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        connection = http.client.HTTPConnection(self.target.hostname, self.target.port, timeout=30)
        try:
            forwarded = {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}
            connection.request(method, path, body=body or None, headers=forwarded)
            response = connection.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            connection.close()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
