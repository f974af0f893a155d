"""The event log, its stream and webhooks, against a real service on loopback: every event type is
produced by the action that causes it with the documented fields; a subscriber that reconnects with
Last-Event-ID misses nothing and sees nothing twice; a webhook receiver that is down gets every
delivery afterwards, in order, signed, even across a service restart; job tokens see only their
job; webhooks reach only allowed hosts and never show their secret."""

from __future__ import annotations

import asyncio
import gc
import http.server
import itertools
import json
import signal
import threading
import time
import zlib

import httpx
import pytest

from ckptstore.client import ServiceClient
from ckptstore.client.cli.commands import _event_line
from ckptstore.server.db.engine import Database, make_engine
from ckptstore.server.db.migrate import migrate
from ckptstore.server.events.log import emit
from ckptstore.server.events.stream import HEARTBEAT, READ_LIMIT, Batch, EventHub, Subscription, sse_frame
from ckptstore.server.routes.events import accepts_gzip
from ckptstore.wire.events import EVENT_TYPES, Event, verify_signature
from tests.builders import commit_body, declare
from tests.conftest import service_settings
from tests.live import LiveService, ScratchPostgres, postgres_available, start_service_process, wait_for
from tests.servers import free_port

SECRET = "s3cret-webhook-key-0123"
FIELDS = {"id", "type", "time", "job", "node", "position", "data"}
DATA = {  # the documented payload of each type (docs/rest.md, "Events")
    "job.declared": {"nodes", "storage_root", "local_root"},
    "job.updated": {"nodes", "storage_root", "local_root", "nodes_changed"},
    "job.deleted": set(),
    "attempt.started": {"attempt", "resumed_from"},
    "attempt.started/reported": {"attempt", "resumed_from", "reported", "skipped"},
    "resume.audited": {"attempt", "verdict", "differences"},
    "node.fenced": {"attempt", "by"},
    "checkpoint.committed": {"attempt", "tier", "location", "bytes", "step"},
    "position.good": {"last_good_epoch", "durable", "nodes"},
    "copy.marked": {"attempt", "state", "tiers", "cause", "reason"},
    "replicas.disagreed": {"attempt", "state", "tiers", "cause", "reason"},
    "retention.deleted": {"attempt", "state", "tiers", "cause", "reason"},
    "replication.done": {"attempt"},
    "replication.lagging": {"pending", "oldest_pending_since"},
    "health.changed": {"cp_accessible", "previous", "error", "latency_ms"},
    "checkpoint.requested": {"nodes", "reason"},
}


def events_of(http: httpx.Client, job: str, after: int = 0) -> list[dict]:
    page = http.get("/v1/events", params={"format": "json", "job": job, "after": after, "limit": 1000}).json()
    return page["events"]


def every_action(http: httpx.Client, root: str, job: str) -> None:
    """One action per event type, in order."""
    local = "/var/tmp/ckptstore-local"
    declare(http, root, job, ["n0", "n1"], local_root=local)
    declare(http, root, job, ["n0", "n1"], local_root=local, retention={"keep_last": 3})
    for _ in range(2):
        assert http.post(f"/v1/jobs/{job}/nodes/n0/attempts", json={}).status_code == 201
    assert http.post(f"/v1/jobs/{job}/nodes/n1/attempts", json={}).status_code == 201
    resume = {"resumed_from": None, "skipped": []}
    assert http.put(f"/v1/jobs/{job}/nodes/n0/attempts/2", json=resume).status_code == 200
    audit = {"position": None, "verdict": "drift", "differences": ["optimizer: saved Adam, restoring into AdamW"]}
    assert http.put(f"/v1/jobs/{job}/nodes/n0/attempts/2/audit", json=audit).status_code == 200
    for epoch in (0, 1):
        for node, attempt in (("n0", 2), ("n1", 1)):
            body = commit_body(local, job, node, epoch, attempt=attempt, tier="local")
            assert http.post(f"/v1/jobs/{job}/nodes/{node}/checkpoints", json=body).status_code == 201
    body = commit_body(root, job, "n0", 0, attempt=2)
    assert http.post(f"/v1/jobs/{job}/nodes/n0/checkpoints", json=body).status_code == 201
    mark = {"epoch": 1, "state": "corrupt", "attempt": "2", "tier": "local", "reason": "crc32c mismatch"}
    assert http.post(f"/v1/jobs/{job}/nodes/n0/checkpoints/mark", json=mark).status_code == 200
    mark = {"epoch": 1, "state": "corrupt", "attempt": "1", "tier": "local", "cause": "agreement"}
    mark["reason"] = "replicas disagree: rank 1, tensor model['w']"
    assert http.post(f"/v1/jobs/{job}/nodes/n1/checkpoints/mark", json=mark).status_code == 200
    mark = {
        "epoch": 0,
        "state": "deleted",
        "attempt": "1",
        "tier": "local",
        "cause": "retention",
        "reason": "keep_last",
    }
    assert http.post(f"/v1/jobs/{job}/nodes/n1/checkpoints/mark", json=mark).status_code == 200
    health = {"cp_accessible": False, "latency_ms": 12.5, "error": "timeout"}
    assert http.put(f"/v1/jobs/{job}/nodes/n0/health", json=health).status_code == 200
    assert http.post(f"/v1/jobs/{job}/checkpoint-requests", json={"reason": "drain"}).status_code == 201
    assert http.delete(f"/v1/jobs/{job}").status_code == 204


EXPECTED = [
    ("job.declared", None, None),
    ("job.updated", None, None),
    ("attempt.started", "n0", None),
    ("attempt.started", "n0", None),
    ("node.fenced", "n0", None),
    ("attempt.started", "n1", None),
    ("attempt.started/reported", "n0", None),
    ("resume.audited", "n0", None),
    ("checkpoint.committed", "n0", 0),
    ("checkpoint.committed", "n1", 0),
    ("position.good", None, 0),
    ("checkpoint.committed", "n0", 1),
    ("replication.lagging", "n0", 1),
    ("checkpoint.committed", "n1", 1),
    ("replication.lagging", "n1", 1),
    ("position.good", None, 1),
    ("checkpoint.committed", "n0", 0),
    ("replication.done", "n0", 0),
    ("copy.marked", "n0", 1),
    ("replicas.disagreed", "n1", 1),
    ("retention.deleted", "n1", 0),
    ("health.changed", "n0", None),
    ("checkpoint.requested", None, None),
    ("job.deleted", None, None),
]


def test_every_event_type_comes_from_its_action_with_the_documented_fields(service, job_name):
    with service.client() as http:
        every_action(http, service.storage, job_name)
        events = events_of(http, job_name)
    seen = []
    for event in events:
        assert set(event) == FIELDS and event["job"] == job_name
        kind = event["type"] + ("/reported" if event["data"].get("reported") else "")
        assert set(event["data"]) == DATA[kind], kind
        seen.append((kind, event["node"], event["position"] and event["position"]["epoch"]))
    assert seen == EXPECTED
    assert {kind.split("/")[0] for kind, _, _ in EXPECTED} == set(EVENT_TYPES), "every type is exercised"
    ids = [e["id"] for e in events]
    assert ids == sorted(set(ids)), "ids grow"
    good = [e for e in events if e["type"] == "position.good"]
    assert [e["data"]["last_good_epoch"] for e in good] == [0, 1]
    assert events[21]["data"] == {"cp_accessible": False, "previous": None, "error": "timeout", "latency_ms": 12.5}


def test_a_refused_write_emits_nothing(service, job_name):
    with service.client() as http:
        declare(http, service.storage, job_name, ["n0"])
        before = events_of(http, job_name)
        body = commit_body(service.storage, job_name, "n0", 0, location=f"{service.storage}/elsewhere")
        assert http.post(f"/v1/jobs/{job_name}/nodes/n0/checkpoints", json=body).status_code == 422
        assert http.post(f"/v1/jobs/{job_name}/nodes/n9/attempts", json={}).status_code == 422
        assert events_of(http, job_name) == before


def test_event_ids_out_of_range_are_refused(sqlite_service):
    with sqlite_service.client() as http:
        for after in (2**63, -1, 10**30):
            answer = http.get("/v1/events", params={"format": "json", "after": after})
            assert answer.status_code == 422, (after, answer.text)
        for header in ("9" * 30, str(2**63), "-1", "x", "\u00b2"):
            answer = http.get("/v1/events", params={"format": "json"}, headers={"Last-Event-ID": header.encode()})
            assert answer.status_code == 422, (header, answer.text)
        beyond = http.get("/v1/events", params={"format": "json", "after": 2**63 - 1}).json()
        assert beyond["reset"], "an id beyond the newest event is a reset (issue 34): the reader starts again"


def read_stream(url: str, headers: dict[str, str], count: int, params: dict | None = None) -> tuple[list[str], bool]:
    """The raw lines of the first `count` events of a stream, and whether a heartbeat came among them."""
    lines, events, heartbeat = [], 0, False
    with httpx.stream("GET", f"{url}/v1/events", headers=headers, params=params, timeout=10) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            heartbeat |= line.startswith(": heartbeat")
            lines.append(line)
            events += line.startswith("data:")
            if events == count:
                return lines, heartbeat
    raise AssertionError("the stream ended")


def test_a_subscriber_resuming_with_last_event_id_misses_nothing_and_sees_nothing_twice(tmp_path):
    settings = service_settings(str(tmp_path), f"sqlite:///{tmp_path}/svc.db", events_heartbeat_seconds=0.2)
    live = LiveService(settings)
    root = settings.default_storage
    try:
        with live.client() as http:
            declare(http, root, "resume", ["n0"])
            first, heartbeat = read_stream(live.url, {"Last-Event-ID": "0"}, 1, {"job": "resume"})
            assert first[:2] == ["id: 1", "event: job.declared"]
            for epoch in range(5):  # written while nobody listens
                http.post("/v1/jobs/resume/nodes/n0/checkpoints", json=commit_body(root, "resume", "n0", epoch))
            writer = threading.Thread(
                target=lambda: [
                    http.post("/v1/jobs/resume/nodes/n0/checkpoints", json=commit_body(root, "resume", "n0", e))
                    for e in range(5, 8)
                ]
            )
            timer = threading.Timer(0.5, writer.start)  # after a heartbeat, while the stream is open
            timer.start()
            lines, heartbeat = read_stream(live.url, {"Last-Event-ID": "1"}, 16, {"job": "resume"})
            writer.join()
        ids = [int(line[4:]) for line in lines if line.startswith("id: ")]
        assert ids == list(range(2, 18)), "every event after 1, once, in order (commits and good positions)"
        assert heartbeat, "an idle stream sends heartbeats"
        events = [Event.model_validate_json(line[6:]) for line in lines if line.startswith("data: ")]
        assert [e.position.epoch for e in events if e.type == "position.good"] == list(range(8))
    finally:
        live.stop()


def read_encoded_stream(url: str, accept: str, count: int, params: dict) -> tuple[str | None, list[str]]:
    """A stream's Content-Encoding and its lines (decoded here, not by httpx) up to `count` events."""
    headers = {"Accept-Encoding": accept, "Last-Event-ID": "0"}
    with httpx.stream("GET", f"{url}/v1/events", headers=headers, params=params, timeout=20) as response:
        encoding = response.headers.get("content-encoding")
        decoder = zlib.decompressobj(16 + zlib.MAX_WBITS) if encoding == "gzip" else None
        text = ""
        for chunk in response.iter_raw():
            text += (decoder.decompress(chunk) if decoder else chunk).decode()
            if text.count("\ndata: ") + text.startswith("data: ") >= count and text.endswith("\n\n"):
                return encoding, text.splitlines()
    raise AssertionError("the stream ended")


@pytest.mark.parametrize(
    ("header", "gzip"),
    [
        (None, False),
        ("identity", False),
        ("gzip, deflate, br", True),
        ("br;q=1, GZIP;q=0.5", True),
        ("gzip;q=0", False),
        ("deflate, gzip ; q=0.000", False),
        ("*", False),
    ],
)
def test_streams_are_gzip_encoded_only_where_accept_encoding_accepts_gzip(header, gzip):
    assert accepts_gzip(header) is gzip


def test_gzip_streams_carry_exactly_the_frames_of_plain_ones(tmp_path):
    """Clients that accept gzip get each chunk as a deflate segment, whole batches compressed once for
    every such stream; decoded, the backlog, the live batches and filtered streams are the plain ones."""
    settings = service_settings(str(tmp_path), f"sqlite:///{tmp_path}/svc.db")
    live = LiveService(settings)
    root = settings.default_storage
    streams = {
        (accept, name): (params, count)
        for accept in ("gzip, deflate", "identity")
        for name, params, count in (("all", {}, 2 + 16), ("filtered", {"job": "gz-a", "types": "position.good"}, 5))
    }
    answers: dict = {}
    try:
        with live.client() as http:
            declare(http, root, "gz-a", ["n0"])
            declare(http, root, "gz-b", ["n0"])
            readers = [
                threading.Thread(
                    target=lambda key=key, params=params, count=count: answers.__setitem__(
                        key, read_encoded_stream(live.url, key[0], count, params)
                    )
                )
                for key, (params, count) in streams.items()
            ]
            for reader in readers:
                reader.start()
            # Every stream is subscribed (a live batch overlapping its backlog is sent once: Batch.chunk_after).
            wait_for(lambda: len(live.app.state.hub.subscribers) == len(streams), timeout=20, what="every stream")
            for job, epochs in (("gz-a", 5), ("gz-b", 3)):
                for epoch in range(epochs):
                    http.post(f"/v1/jobs/{job}/nodes/n0/checkpoints", json=commit_body(root, job, "n0", epoch))
            for reader in readers:
                reader.join(30)
        assert set(answers) == set(streams), "every stream got its events"
        for name in ("all", "filtered"):
            (gzip_encoding, gzip_lines), (plain_encoding, plain_lines) = (
                answers["gzip, deflate", name],
                answers["identity", name],
            )
            assert (gzip_encoding, plain_encoding) == ("gzip", None)
            assert gzip_lines == plain_lines
        ids = [int(line[4:]) for line in answers["identity", "all"][1] if line.startswith("id: ")]
        assert ids == list(range(1, 19))
    finally:
        live.stop()


def test_a_live_batch_overlapping_what_a_stream_sent_gives_only_the_newer_events():
    events = [Event(id=i, type="checkpoint.committed", time=0.0, job="j") for i in (5, 6, 7)]
    batch = Batch.of(events)
    assert batch.frames_after(4, named=True) == b"".join(sse_frame(e) for e in events)
    assert batch.frames_after(5, named=False) == b"".join(sse_frame(e, named=False) for e in events[1:])
    assert batch.frames_after(5, named=True).startswith(b"id: 6\nevent: checkpoint.committed\ndata: ")
    assert batch.frames_after(7, named=True) == b""
    other_job, same_job = Subscription("other", None), Subscription("j", frozenset({"checkpoint.committed"}))
    other_job.offer(batch)
    same_job.offer(batch)
    assert other_job.queue.empty()
    assert same_job.queue.get_nowait().frames_after(0, named=True) == batch.named


def test_a_filtered_stream_is_offered_exactly_its_jobs_events_of_its_types():
    kinds = itertools.product(("a", "b"), ("checkpoint.committed", "position.good"))
    events = [Event(id=i, type=kind, time=0.0, job=job) for i, (job, kind) in enumerate(kinds, start=1)]
    batch = Batch.of(events)
    for job, types in (("a", None), (None, frozenset({"position.good"})), ("b", frozenset({"position.good"}))):
        subscription = Subscription(job, types)
        subscription.offer(batch)
        wanted = [e for e in events if job in (None, e.job) and (not types or e.type in types)]
        offered = subscription.queue.get_nowait()
        assert offered.ids == [e.id for e in wanted]
        assert offered.frames_after(0, named=False) == b"".join(sse_frame(e, named=False) for e in wanted)


def _tracked_objects(root: object) -> int:
    """How many objects the garbage collector tracks among those reachable from `root` (types aside)."""
    seen: set[int] = set()
    todo = [root]
    while todo:
        item = todo.pop()
        if id(item) not in seen:
            seen.add(id(item))
            todo.extend(r for r in gc.get_referents(item) if gc.is_tracked(r) and not isinstance(r, type))
    return len(seen)


def test_a_batch_holds_as_many_collector_tracked_objects_for_500_events_as_for_1():
    """A batch waits in every stream's queue while the service allocates: objects it held per event
    were promoted into the oldest generation by the thousand (bench/RESULTS.md, events)."""
    one, many = (
        Batch.of([Event(id=i, type="checkpoint.committed", time=0.0, job="j", data={"bytes": i}) for i in range(n)])
        for n in (1, READ_LIMIT)
    )
    for batch in (one, many):
        batch.named_gzip  # noqa: B018 (the joined and compressed frames are cached on the batch too)
    assert _tracked_objects(many) == _tracked_objects(one)


def test_the_hubs_heartbeat_reaches_only_streams_that_sent_nothing_since_the_last_one():
    idle, busy = Subscription(None, None), Subscription(None, None)
    busy.sent = True
    for subscription in (idle, busy):
        subscription.beat()
    assert idle.queue.get_nowait() == HEARTBEAT and idle.queue.empty()
    assert busy.queue.empty() and not busy.sent, "a stream that sent gets a heartbeat at the next beat if idle"
    busy.beat()
    assert busy.queue.get_nowait() == HEARTBEAT


def test_the_event_hub_stops_even_when_events_arrive_as_it_is_stopped(tmp_path):
    """A wake-up landing in the same loop turn as the stop must not swallow the cancellation (as
    `asyncio.wait_for` does on Python 3.11): the service would never finish shutting down."""
    url = f"sqlite:///{tmp_path}/catalog.db"
    migrate(url)
    db = Database(make_engine(url))

    async def start_and_stop() -> None:
        hub = EventHub(db, poll_seconds=30, heartbeat_seconds=30, window_seconds=0)
        await hub.start()
        async with asyncio.timeout(5):  # until the hub waits for a wake-up
            while not hub._wake._waiters:  # type: ignore[union-attr]
                await asyncio.sleep(0)
        hub.wake()  # as the writer thread does: its event is set on the next loop turn, before the stop
        await asyncio.sleep(0)
        async with asyncio.timeout(5):
            await hub.stop()

    try:
        asyncio.run(start_and_stop())
    finally:
        db.dispose()


def test_a_service_with_event_streams_open_stops_on_sigterm_and_closes_them(tmp_path):
    """A graceful shutdown waits for the responses in flight, and an event stream never ends on its
    own: the service closes its streams (their clients resume with Last-Event-ID) instead of never
    exiting. A plain and a dashboard stream are open."""
    port = free_port()
    process = start_service_process(tmp_path, port)
    attached, ended = threading.Semaphore(0), threading.Semaphore(0)
    content_types: list[str] = []

    def follow(path: str) -> None:
        try:
            with httpx.stream("GET", f"http://127.0.0.1:{port}{path}", timeout=60) as response:
                content_types.append(response.headers["content-type"])
                attached.release()
                for _ in response.iter_raw():
                    pass
        except httpx.HTTPError:
            pass  # the connection closed mid-body, as a restart would
        ended.release()

    try:
        for path in ("/v1/events", "/ui/events"):
            threading.Thread(target=follow, args=(path,), daemon=True).start()
        for _ in range(2):
            assert attached.acquire(timeout=30)
        assert [kind.split(";")[0] for kind in content_types] == ["text/event-stream"] * 2
        process.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal once its shutdown is complete
        assert process.wait(timeout=20) == -signal.SIGTERM, "the service exits on SIGTERM with streams open"
        for _ in range(2):
            assert ended.acquire(timeout=5), "every stream is closed"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_wake_up_with_more_events_than_one_read_takes_delivers_them_all_at_once(tmp_path):
    """The reader goes on reading while reads come back full, instead of waiting a window between
    them: otherwise a commit rate above READ_LIMIT events per window leaves every stream further
    behind with each window."""
    url = f"sqlite:///{tmp_path}/catalog.db"
    migrate(url)
    db = Database(make_engine(url))
    count = 2 * READ_LIMIT + 7

    async def deliver() -> list[int]:
        hub = EventHub(db, poll_seconds=60, heartbeat_seconds=60, window_seconds=60)
        await hub.start()
        frames = hub.events(0, job=None, types=None)
        first = asyncio.ensure_future(anext(frames))
        async with asyncio.timeout(5):  # until the stream is subscribed (overlaps with its backlog are sent once)
            while not hub.subscribers:
                await asyncio.sleep(0)
        with db.write() as session:
            for i in range(count):
                emit(session, "job.deleted", f"job-{i}")
        hub.wake()
        received = b""
        try:
            async with asyncio.timeout(20):  # a window between reads would take 120 s
                received = await first
                while received.count(b"\nevent: ") < count:
                    received += await anext(frames)
        finally:
            await frames.aclose()
            await hub.stop()
        return [int(line[4:]) for line in received.decode().splitlines() if line.startswith("id: ")]

    try:
        assert asyncio.run(deliver()) == list(range(1, count + 1))
    finally:
        db.dispose()


def test_a_reader_behind_the_log_window_gets_a_reset_and_the_rest(tmp_path):
    from ckptstore.server.db.engine import Database, make_engine
    from ckptstore.server.events.log import out_of_window, prune

    settings = service_settings(str(tmp_path), f"sqlite:///{tmp_path}/svc.db")
    live = LiveService(settings)
    try:
        with live.client() as http:
            for i in range(4):
                declare(http, settings.default_storage, f"window-{i}", ["n0"])
            db = Database(make_engine(settings.database_url))
            with db.write() as session:
                through = out_of_window(
                    session, keep_seconds=1e9, keep_rows=2, now=time.time(), keep_after=None, most_rows=2
                )
                assert prune(session, through) == 2
            db.dispose()
            page = http.get("/v1/events", params={"format": "json", "after": 1}).json()
            assert page["reset"] is True and [e["id"] for e in page["events"]] == [3, 4]
            lines, _ = read_stream(live.url, {"Last-Event-ID": "1"}, 3)
        assert lines[:3] == ["id: 2", "event: reset", 'data: {"after": 1, "oldest": 3}']
        assert [line for line in lines if line.startswith("id: ")] == ["id: 2", "id: 3", "id: 4"]
        with ServiceClient(live.url) as client:
            assert [e.id for e in _take(client.events(after=1), 2)] == [3, 4], "the Python client goes on after a reset"
    finally:
        live.stop()


def _take(events, n: int) -> list[Event]:
    return list(itertools.islice(events, n))


def test_job_tokens_see_only_their_jobs_events_and_no_webhooks(tmp_path):
    tokens = {"alpha": "alpha-token-0123456789", "beta": "beta-token-0123456789"}
    settings = service_settings(
        str(tmp_path), f"sqlite:///{tmp_path}/svc.db", token="admin-token-0123456789", job_tokens=tokens
    )
    live = LiveService(settings)
    try:
        admin = {"Authorization": "Bearer admin-token-0123456789"}
        with live.client(headers=admin) as http:
            for job in ("alpha", "beta"):
                declare(http, settings.default_storage, job, ["n0"])
        alpha = {"Authorization": f"Bearer {tokens['alpha']}"}
        with live.client(headers=alpha) as http:
            page = http.get("/v1/events", params={"format": "json"}).json()
            assert [(e["type"], e["job"]) for e in page["events"]] == [("job.declared", "alpha")]
            assert http.get("/v1/events", params={"format": "json", "job": "beta"}).status_code == 403
            assert http.get("/v1/webhooks").status_code == 403
        lines, _ = read_stream(live.url, alpha | {"Last-Event-ID": "0"}, 1)
        assert json.loads(lines[-1][6:])["job"] == "alpha"
        assert httpx.get(f"{live.url}/v1/events", params={"format": "json"}).status_code == 401
    finally:
        live.stop()


class Receiver:
    """A loopback webhook receiver that records (headers, body) and can be down (503 or no listener)."""

    def __init__(self, port: int | None = None):
        self.received: list[tuple[dict[str, str], bytes]] = []
        self.failing = False
        self.port = port or free_port()
        self._start()

    def _start(self) -> None:
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                status = 503 if receiver.failing else 200
                if not receiver.failing:
                    receiver.received.append(({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"


def test_webhook_deliveries_survive_a_down_receiver_and_a_service_restart_in_order_and_signed(tmp_path):
    settings = service_settings(
        str(tmp_path), f"sqlite:///{tmp_path}/svc.db", webhook_hosts="127.0.0.1", webhook_poll_seconds=0.1
    )
    live = LiveService(settings)
    receiver = Receiver()
    receiver.failing = True
    root = settings.default_storage
    with live.client() as http:
        spec = {"url": receiver.url, "events": ["checkpoint.committed", "position.good"], "secret": SECRET}
        created = http.put("/v1/webhooks/ci", json=spec)
        assert created.status_code == 201 and "secret" not in created.text and SECRET not in created.text
        declare(http, root, "hooked", ["n0"])
        for epoch in range(3):
            http.post("/v1/jobs/hooked/nodes/n0/checkpoints", json=commit_body(root, "hooked", "n0", epoch))

        def tried_twice() -> bool:
            deliveries = http.get("/v1/webhooks/ci/deliveries").json()
            return bool(deliveries) and deliveries[-1]["attempts"] >= 2

        wait_for(tried_twice, timeout=20, what="retries while the receiver fails")
        pending = http.get("/v1/webhooks/ci/deliveries").json()[-1]
        assert pending["status"] == "pending" and pending["last_error"] == "receiver answered 503"
    live.stop()  # mid-retry
    receiver.failing = False
    live = LiveService(settings, port=live.port)
    try:
        with live.client() as http:
            http.post("/v1/jobs/hooked/nodes/n0/checkpoints", json=commit_body(root, "hooked", "n0", 3))
            wait_for(lambda: len(receiver.received) >= 8, timeout=30, what="every delivery")

            def all_recorded_delivered() -> list | None:
                found = http.get("/v1/webhooks/ci/deliveries").json()
                return found if {d["status"] for d in found} == {"delivered"} else None

            deliveries = wait_for(all_recorded_delivered, timeout=30, what="every delivery recorded")
            listed = http.get("/v1/webhooks").text
        assert SECRET not in listed and {d["status"] for d in deliveries} == {"delivered"}
        assert deliveries[-1]["attempts"] >= 2 and deliveries[0]["attempts"] == 1
    finally:
        live.stop()
        receiver.stop()
    events = [Event.model_validate_json(body) for _, body in receiver.received]
    assert [(e.type, e.position.epoch) for e in events] == [
        (kind, epoch) for epoch in range(4) for kind in ("checkpoint.committed", "position.good")
    ], "every delivery, once, in order"
    for headers, body in receiver.received:
        assert verify_signature(SECRET, headers["x-ckptstore-timestamp"], body, headers["x-ckptstore-signature"])
        event = json.loads(body)
        assert headers["x-ckptstore-delivery"] == str(event["id"]) and headers["x-ckptstore-event"] == event["type"]
    assert not verify_signature(
        "another-secret-000000", headers["x-ckptstore-timestamp"], body, headers["x-ckptstore-signature"]
    )


def test_webhooks_to_hosts_not_allowed_are_refused(tmp_path):
    settings = service_settings(str(tmp_path), f"sqlite:///{tmp_path}/svc.db", webhook_hosts="hooks.internal")
    live = LiveService(settings)
    try:
        with live.client() as http:
            for url in (
                "http://169.254.169.254/latest",
                "http://127.0.0.1:9/x",
                "file:///etc/passwd",
                "http://hooks.internal.evil.com/",
            ):
                answer = http.put("/v1/webhooks/bad", json={"url": url, "events": ["position.good"], "secret": SECRET})
                assert answer.status_code in (403, 422), url
            assert http.get("/v1/webhooks").json() == []
            ok = {"url": "https://hooks.internal/ckpt", "events": ["position.good"], "secret": SECRET}
            assert http.put("/v1/webhooks/good", json=ok).status_code == 201
            assert http.put("/v1/webhooks/good", json=ok | {"events": ["no.such"]}).status_code == 422
            assert http.put("/v1/webhooks/good", json=ok | {"secret": "short"}).status_code == 422
    finally:
        live.stop()


def test_a_stream_through_one_replica_sees_commits_through_another(tmp_path):
    if not postgres_available():
        pytest.fail("PostgreSQL is not reachable on 127.0.0.1:5432 and could not be started")
    database = ScratchPostgres()
    settings = service_settings(str(tmp_path), database.url, events_poll_seconds=30)  # only NOTIFY wakes it
    a, b = LiveService(settings), LiveService(settings)
    root = settings.default_storage
    try:
        with httpx.Client(base_url=a.url) as http:
            declare(http, root, "across", ["n0"])
        got: list[Event] = []

        def listen() -> None:
            with ServiceClient(b.url) as client:
                for event in client.events("across", after=0):
                    got.append(event)
                    if len(got) == 3:
                        return

        listener = threading.Thread(target=listen)
        listener.start()
        wait_for(lambda: got, timeout=20, what="the stream through b delivers the backlog (it is attached)")
        with httpx.Client(base_url=a.url) as http:
            http.post("/v1/jobs/across/nodes/n0/checkpoints", json=commit_body(root, "across", "n0", 0))
        listener.join(timeout=10)  # well before the 30 s poll: only a NOTIFY from replica a can wake b
        assert [e.type for e in got] == ["job.declared", "checkpoint.committed", "position.good"]
        assert "checkpoint.committed" in _event_line(got[1]) and "node=n0" in _event_line(got[1])
    finally:
        a.stop()
        b.stop()
        database.drop()


def test_ckptstore_watch_prints_one_line_per_event_and_raw_json(tmp_path):
    import subprocess
    import sys

    settings = service_settings(str(tmp_path), f"sqlite:///{tmp_path}/svc.db")
    live = LiveService(settings)
    root = settings.default_storage
    try:
        with live.client() as http:
            declare(http, root, "watched", ["n0"])
            declare(http, root, "other", ["n0"])
            http.post("/v1/jobs/watched/nodes/n0/checkpoints", json=commit_body(root, "watched", "n0", 0))
        command = [
            sys.executable,
            "-m",
            "ckptstore.client.cli.main",
            "watch",
            "watched",
            "--url",
            live.url,
            "--since",
            "0",
        ]
        text = subprocess.run([*command, "--count", "3"], capture_output=True, text=True, timeout=60)
        raw = subprocess.run(
            [*command, "--count", "1", "--json", "--types", "position.good"], capture_output=True, text=True, timeout=60
        )
        bad = subprocess.run([*command, "--types", "nope"], capture_output=True, text=True, timeout=60)
    finally:
        live.stop()
    lines = text.stdout.splitlines()
    assert text.returncode == 0 and len(lines) == 3, text.stderr
    assert "#1" in lines[0] and "job.declared" in lines[0] and "job=watched" in lines[0] and "storage_root=" in lines[0]
    assert "checkpoint.committed" in lines[1] and "node=n0 position=0" in lines[1] and "attempt=1" in lines[1]
    assert "position.good" in lines[2] and "last_good_epoch=0" in lines[2]
    event = Event.model_validate_json(raw.stdout)
    assert event.type == "position.good" and event.job == "watched"
    assert bad.returncode == 2 and "unknown event types" in bad.stderr and len(bad.stderr.splitlines()) == 1
