"""Event streams: one reader of the event log per service process fans new events out to every
subscriber in memory, so 200 subscribers cost one query per wake-up, not 200.

The reader wakes when this process commits events, when PostgreSQL NOTIFYs that another process did
(server/records/versions.py), and every `poll_seconds` regardless (SQLite's other workers, or a dropped
notification connection). A subscriber first registers, then reads its backlog from the log, then
takes live events, skipping ids it has already sent: nothing is missed and nothing is sent twice.
A subscriber that falls too far behind reads from the log again. Under a stream of commits the
reader wakes at most once a window (`CKPTSTORE_EVENTS_WINDOW_SECONDS`), each wake-up's events are
encoded and joined once for every subscriber, each subscriber gets one queue item per wake-up, and
sends whatever queued up since its last send as one chunk. Heartbeats come from the hub too: every
`heartbeat_seconds` it queues one for each stream that sent nothing since the last beat, so a
waiting stream needs no timer of its own (those timers were 1.6 % of the service's time under
bench/events.py).

Streams to clients that accept gzip (browsers, httpx, `ckptstore watch`) are gzip-encoded: every
chunk is a deflate segment of its own (a fresh compressor, flushed), so a wake-up's batch is
compressed once and the same bytes continue every such stream: ~10× fewer bytes for the fan-out
to push through the kernel.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import TypeVar

from ckptstore.server.db.engine import Database
from ckptstore.server.events.log import events_after, newest_event_id, oldest_event_id
from ckptstore.wire.events import Event

__all__ = [
    "EventHub",
    "Subscription",
    "Batch",
    "restart_after",
    "sse_frame",
    "deflate_segment",
    "GZIP_HEADER",
    "HEARTBEAT",
]

log = logging.getLogger("ckptstore.server")
T = TypeVar("T")
READ_LIMIT = 500
QUEUE_LIMIT = 1_000  # reader wake-ups (each a batch of events) a stream may fall behind before it reads the log again
HEARTBEAT = b": heartbeat\n\n"
GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # RFC 1952: deflate, no name, no time


def deflate_segment(data: bytes) -> bytes:
    """`data` as raw deflate blocks that refer to nothing before them and end on a byte boundary
    (a sync flush): one segment continues any gzip stream, and a client decodes it at once."""
    compressor = zlib.compressobj(1, zlib.DEFLATED, -zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush(zlib.Z_SYNC_FLUSH)


HEARTBEAT_GZIP = deflate_segment(HEARTBEAT)


def sse_frame(event: Event, *, named: bool = True, data: str | None = None) -> bytes:
    """One Server-Sent Event: `id`, `event` (the type; unnamed frames reach a browser's `onmessage`)
    and `data` (the event as JSON: `data` when the caller encoded it already)."""
    name = f"event: {event.type}\n" if named else ""
    return f"id: {event.id}\n{name}data: {data or event.model_dump_json()}\n\n".encode()


def restart_after(after: int, oldest: int | None, newest: int) -> int | None:
    """Where a reader asking for events after `after` must go on from instead, or None when it can go on:
    the events it asks for left the log (it goes on before the oldest left), or the id lies beyond the
    newest event (a restored database, a reindex: waiting for it would be silence forever)."""
    if oldest is not None and after + 1 < oldest:
        return oldest - 1
    if after > newest:
        return (oldest or newest + 1) - 1
    return None


def reset_frame(after: int, oldest: int) -> bytes:
    """The ids after `after` up to `oldest` left the log: the subscriber missed events it cannot get."""
    data = json.dumps({"after": after, "oldest": oldest})
    return f"id: {oldest - 1}\nevent: reset\ndata: {data}\n\n".encode()


def _pick(column: list[T], indices: list[int]) -> list[T]:
    return [column[i] for i in indices]


@dataclass(frozen=True)
class Batch:
    """The events of one reader wake-up, in id order, as parallel lists of plain values (ids, jobs,
    types and SSE frames, named and unnamed) encoded once for every subscriber; their joined frames
    are made when first asked for, so a subscriber that wants them all sends one ready chunk.

    No event objects: a batch waits in every stream's queue while the service goes on allocating,
    and its events' objects (~7 each) were promoted into the collector's oldest generation by the
    thousand, making its full collections longer and more frequent (bench/RESULTS.md, events)."""

    ids: list[int]
    jobs: list[str | None]
    types: list[str]
    named_frames: list[bytes]
    unnamed_frames: list[bytes]

    @classmethod
    def of(cls, events: list[Event]) -> Batch:
        data = [event.model_dump_json() for event in events]
        return cls(
            [event.id for event in events],
            [event.job for event in events],
            [event.type for event in events],
            [sse_frame(event, data=text) for event, text in zip(events, data)],
            [sse_frame(event, named=False, data=text) for event, text in zip(events, data)],
        )

    @property
    def newest(self) -> int:
        return self.ids[-1]

    def only(self, job: str | None, types: frozenset[str] | None) -> Batch | None:
        """The events of `job` (None: any) and of `types` (empty: any), or None if there are none."""
        if job is None and not types:
            return self
        kept = [
            i
            for i, (event_job, event_type) in enumerate(zip(self.jobs, self.types))
            if (job is None or event_job == job) and (not types or event_type in types)
        ]
        if len(kept) == len(self.ids):
            return self
        if not kept:
            return None
        return Batch(
            _pick(self.ids, kept),
            _pick(self.jobs, kept),
            _pick(self.types, kept),
            _pick(self.named_frames, kept),
            _pick(self.unnamed_frames, kept),
        )

    @cached_property
    def named(self) -> bytes:
        return b"".join(self.named_frames)

    @cached_property
    def unnamed(self) -> bytes:
        return b"".join(self.unnamed_frames)

    @cached_property
    def named_gzip(self) -> bytes:
        return deflate_segment(self.named)

    @cached_property
    def unnamed_gzip(self) -> bytes:
        return deflate_segment(self.unnamed)

    def frames_after(self, last: int, *, named: bool) -> bytes:
        """The frames of the events with id above `last`."""
        start = bisect.bisect_right(self.ids, last)
        if start == 0:
            return self.named if named else self.unnamed
        return b"".join((self.named_frames if named else self.unnamed_frames)[start:])

    def chunk_after(self, last: int, *, named: bool, gzip: bool) -> bytes:
        """The frames after `last` as a stream sends them: as they are, or as a deflate segment
        (compressed once for every stream that takes the whole batch)."""
        if not gzip:
            return self.frames_after(last, named=named)
        if self.ids[0] > last:
            return self.named_gzip if named else self.unnamed_gzip
        return deflate_segment(self.frames_after(last, named=named))


@dataclass(eq=False)
class Subscription:
    """One stream's filter and its queue of live events (one batch per reader wake-up)."""

    job: str | None
    types: frozenset[str] | None
    holder: str = ""  # whose stream it is (a job's token, or a client address): streams are capped per holder
    queue: asyncio.Queue[Batch | bytes] = field(default_factory=lambda: asyncio.Queue(QUEUE_LIMIT))
    overflowed: bool = False
    sent: bool = False  # since the hub's last heartbeat

    def offer(self, batch: Batch) -> None:
        """Queue the events of `batch` this stream wants, as one item."""
        wanted = batch.only(self.job, self.types)
        if wanted is None:
            return
        try:
            self.queue.put_nowait(wanted)
        except asyncio.QueueFull:
            self.overflowed = True

    def beat(self) -> None:
        """A heartbeat if the stream sent nothing since the last one (a full queue has no need of it)."""
        if not self.sent and not self.queue.full():
            self.queue.put_nowait(HEARTBEAT)
        self.sent = False


class EventHub:
    """This process's reader of the event log (see module docstring)."""

    def __init__(self, db: Database, *, poll_seconds: float, heartbeat_seconds: float, window_seconds: float):
        self.db = db
        self.poll_seconds, self.heartbeat_seconds = poll_seconds, heartbeat_seconds
        # 200 subscribers under 500 commits/s: one read and one send per window, not per commit (bench/RESULTS.md)
        self.window_seconds = window_seconds
        self.subscribers: set[Subscription] = set()
        self.read_through = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def refusal(self, holder: str, *, most: int, most_per_holder: int) -> tuple[int, str] | None:
        """(status, why) when another stream would be one too many — in all (503), or for `holder` (429)."""
        if len(self.subscribers) >= most:
            return 503, f"this service process serves {most} event streams already (CKPTSTORE_EVENTS_MAX_STREAMS)"
        if sum(s.holder == holder for s in self.subscribers) >= most_per_holder:
            return 429, (
                f"this caller has {most_per_holder} event streams open already "
                "(CKPTSTORE_EVENTS_MAX_STREAMS_PER_CALLER): close one, or reuse it with a job filter"
            )
        return None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self.read_through = await asyncio.to_thread(self._newest)
        self._tasks = [
            asyncio.create_task(self._run(), name="ckptstore-event-hub"),
            asyncio.create_task(self._beat(), name="ckptstore-event-heartbeats"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def wake(self, newest: int | None = None) -> None:
        """New events were committed (callable from any thread)."""
        if self._loop is not None and self._wake is not None and (newest is None or newest > self.read_through):
            self._loop.call_soon_threadsafe(self._wake.set)

    def _newest(self) -> int:
        with self.db.read() as session:
            return newest_event_id(session)

    def _read(self, after: int, job: str | None, types: frozenset[str] | None) -> list[Event]:
        with self.db.read() as session:
            return events_after(session, after, job=job, types=types, limit=READ_LIMIT)

    def _bounds(self) -> tuple[int | None, int]:
        """The oldest event id in the log (None: it is empty) and the newest ever written."""
        with self.db.read() as session:
            return oldest_event_id(session), newest_event_id(session)

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            try:  # not wait_for: on Python 3.11 it swallows a stop() that lands as the wake-up does
                async with asyncio.timeout(self.poll_seconds):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                events = await asyncio.to_thread(self._read, self.read_through, None, None)
            except self.db.errors as exc:
                log.warning("event log unreadable (%s); retrying", type(exc).__name__)
                continue
            if events:
                self.read_through = events[-1].id
                batch = Batch.of(events)
                for subscriber in self.subscribers:
                    subscriber.offer(batch)
            if len(events) == READ_LIMIT:
                self._wake.set()  # more are waiting: read them now, not a window later
                continue
            await asyncio.sleep(self.window_seconds)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_seconds)
            for subscriber in self.subscribers:
                subscriber.beat()

    async def events(
        self,
        after: int,
        *,
        job: str | None,
        types: frozenset[str] | None,
        named: bool = True,
        gzip: bool = False,
        holder: str = "",
    ) -> AsyncIterator[bytes]:
        """SSE frames: a `reset` if events after `after` left the log, the backlog, then live events
        and heartbeats, until the client goes away; with `gzip`, the body of a gzip-encoded response."""
        encode = deflate_segment if gzip else bytes
        subscription = Subscription(job, types, holder)
        self.subscribers.add(subscription)
        try:
            if gzip:
                yield GZIP_HEADER
            last = after
            restart = restart_after(last, *await asyncio.to_thread(self._bounds))
            if restart is not None:
                yield encode(reset_frame(last, restart + 1))
                last = restart
            while True:
                async for page in self._backlog(last, job, types):
                    last = page[-1].id
                    yield encode(b"".join(sse_frame(event, named=named) for event in page))
                subscription.overflowed = False
                while not subscription.overflowed:
                    queued = [await subscription.queue.get()]
                    while not subscription.queue.empty():
                        queued.append(subscription.queue.get_nowait())
                    frames = []
                    for batch in queued:
                        if isinstance(batch, Batch) and batch.newest > last:
                            frames.append(batch.chunk_after(last, named=named, gzip=gzip))
                            last = batch.newest
                    if frames:
                        subscription.sent = True
                        yield b"".join(frames)
                    elif HEARTBEAT in queued:
                        yield HEARTBEAT_GZIP if gzip else HEARTBEAT
                subscription.queue = asyncio.Queue(QUEUE_LIMIT)  # fell behind: read the log again
        finally:
            self.subscribers.discard(subscription)

    async def _backlog(self, after: int, job: str | None, types: frozenset[str] | None) -> AsyncIterator[list[Event]]:
        """The log after `after`, a page (up to READ_LIMIT events) at a time."""
        while True:
            events = await asyncio.to_thread(self._read, after, job, types)
            if events:
                after = events[-1].id
                yield events
            if len(events) < READ_LIMIT:
                return

    async def page(
        self, after: int, *, job: str | None, types: frozenset[str] | None, limit: int
    ) -> tuple[list[Event], int | None]:
        """Events for polling clients: those after `after` (at most `limit`), and where to go on from
        when `after` cannot be (`restart_after`; then the events are those after it)."""

        def read() -> tuple[list[Event], int | None]:
            with self.db.read() as session:
                restart = restart_after(after, oldest_event_id(session), newest_event_id(session))
                start = after if restart is None else restart
                return events_after(session, start, job=job, types=types, limit=limit), restart

        return await asyncio.to_thread(read)
