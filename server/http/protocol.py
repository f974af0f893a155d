"""uvicorn's httptools protocol with a cap on a request's head (request line + headers), and a
shutdown that ends endless responses.

uvicorn bounds nothing there with httptools: a client sending a 10 MB URL or an endless header
makes the service buffer all of it. Over the cap the connection gets 431 and is closed. Bytes are
counted per received chunk, so a chunk of pipelined requests may count up to one chunk (≤ 256 KiB)
more than the head itself; the cap is set well above any real head.

A graceful shutdown lets every response in flight finish, and an event stream never does: one open
stream (a dashboard, `ckptstore watch`) kept the service from ever exiting on SIGTERM. Responses
whose scope is marked ENDLESS have their connection closed instead, as a restart or a failover
would; their clients resume from Last-Event-ID.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ckptstore.server.errors import error_body

__all__ = ["BoundedHttpToolsProtocol", "MAX_HEAD_BYTES", "ENDLESS"]

MAX_HEAD_BYTES = 1 << 20
ENDLESS = "ckptstore.endless"  # scope key: this response goes on until the client leaves


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    _head_bytes = 0
    _in_head = True

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes, self._in_head = 0, True

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse_head()

    def shutdown(self) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and cycle.scope.get(ENDLESS):
            self.transport.close()
        else:
            super().shutdown()

    def _refuse_head(self) -> None:
        body = error_body("too_large", f"the request line and headers are limited to {MAX_HEAD_BYTES} bytes")
        head = (
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        )
        self.transport.write(head + body)
        self.transport.close()
