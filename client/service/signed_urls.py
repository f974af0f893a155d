"""Where a node without storage credentials gets its URLs: the service signs them
(`POST …/nodes/{node}/urls`); this asks in batches and keeps them until shortly before they expire.

Callers on many threads (a save writes its blobs on several) each ask for what they need now; whoever
asks while no request is on its way sends every URL wanted so far in one request (up to URL_LIMIT), and
the others wait for it — so a save's hundreds of uploads cost a handful of requests, without a timer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from ckptstore.wire.presign import URL_LIMIT, SignedUrl, SignedUrls, UrlsRequest, UrlWanted

__all__ = ["SignedUrlSource", "Asker"]

Asker = Callable[[UrlsRequest], SignedUrls]
_KEEP_AT_MOST = 10_000  # kept URLs; past that, the stale ones are dropped


@dataclass(frozen=True)
class _Kept:
    url: SignedUrl
    use_before: float  # time.monotonic()


class SignedUrlSource:
    """Signed URLs for one node, fetched from the service in batches and kept while fresh.

    `ask` sends one request to the service; `attempt()` is the node's current attempt (None before it
    has one: reads and the storage probe need none). A URL is used until `refresh_at` of its life has
    passed (default 0.8: a 15-minute URL is asked for again after 12 minutes), so a long upload never
    starts with a URL about to expire.
    """

    def __init__(self, ask: Asker, attempt: Callable[[], str | None], *, refresh_at: float = 0.8):
        self._ask, self._attempt, self._refresh_at = ask, attempt, refresh_at
        self._lock = threading.Lock()
        self._kept: dict[tuple[str, str], _Kept] = {}  # by (method, key)
        self._queue: list[tuple[UrlWanted, Future[SignedUrl]]] = []
        self._sending = False

    def get(self, wanted: Sequence[UrlWanted]) -> list[SignedUrl]:
        """A URL for each of `wanted`, in order; raises what the service answered (FencedError, …)."""
        now = time.monotonic()
        found: list[SignedUrl | Future[SignedUrl]] = []
        with self._lock:
            for want in wanted:
                kept = self._kept.get((want.method, want.key)) if _keeps(want) else None
                if kept is not None and kept.use_before > now:
                    found.append(kept.url)
                    continue
                future: Future[SignedUrl] = Future()
                self._queue.append((want, future))
                found.append(future)
            send = bool(self._queue) and not self._sending
            self._sending = self._sending or send
        if send:
            self._send_all()
        return [item.result() if isinstance(item, Future) else item for item in found]

    def forget(self, wanted: UrlWanted) -> None:
        """Drop a kept URL that the store refused (expired early, a clock skewed): the next use asks again."""
        with self._lock:
            self._kept.pop((wanted.method, wanted.key), None)

    def _send_all(self) -> None:
        """Send what is queued, in requests of up to URL_LIMIT, until nothing is (this thread's own first)."""
        try:
            while True:
                with self._lock:
                    batch, self._queue = self._queue[:URL_LIMIT], self._queue[URL_LIMIT:]
                    if not batch:
                        self._sending = False
                        return
                self._send([want for want, _ in batch], [future for _, future in batch])
        except BaseException as exc:  # interrupted: nobody may wait for a request that is never sent
            with self._lock:
                queued, self._queue, self._sending = self._queue, [], False
            for _, future in queued:
                future.set_exception(exc)
            raise

    def _send(self, wanted: list[UrlWanted], futures: list[Future[SignedUrl]]) -> None:
        started = time.monotonic()
        try:
            answer = self._ask(UrlsRequest(attempt=self._attempt(), objects=wanted))
        except Exception as exc:
            for future in futures:
                future.set_exception(exc)
            return
        use_before = started + self._refresh_at * answer.expires_s
        with self._lock:
            if len(self._kept) > _KEEP_AT_MOST:
                self._kept = {k: kept for k, kept in self._kept.items() if kept.use_before > started}
            for want, url in zip(wanted, answer.urls):
                if _keeps(want):
                    self._kept[want.method, want.key] = _Kept(url, use_before)
        for future, url in zip(futures, answer.urls):
            future.set_result(url)


def _keeps(wanted: UrlWanted) -> bool:
    """Whether a URL is kept for another use: reads only (a manifest or a blob read again, a size checked
    each save). A write or delete URL is used once — and one kept would outlive a fencing by its life."""
    return wanted.method in ("GET", "HEAD")
