"""The third hostile pass (issue 34): the second wave's surface — attempt counters, webhooks, the
event stream, DCP metadata, the command line's output — against hostile and careless input. Each
test failed before its fix."""

from __future__ import annotations

import json
import os
import time
import uuid

import numpy as np
import pytest

from ckptstore import Store
from ckptstore.client import ServiceClient
from ckptstore.client.service.operations import reindex
from tests.builders import commit_body, declare

# -- 1. one request must not exhaust a node's attempt counter -------------------------------------


def test_no_outside_number_can_push_a_counter_near_its_end(sqlite_service, job_name):
    root = sqlite_service.storage
    with sqlite_service.client() as http:
        declare(http, root, job_name, ["n0", "n1", "n2"])
        body = commit_body(root, job_name, "n0", 0, attempt="999999999")
        refused = http.post(f"/v1/jobs/{job_name}/nodes/n0/checkpoints", json=body)
        assert refused.status_code == 422 and "accepted below 100000000" in refused.json()["detail"]
        huge = http.post(f"/v1/jobs/{job_name}/nodes/n1/attempts", json={"at_least": 999999999})
        assert huge.status_code == 422
        assert http.post(f"/v1/jobs/{job_name}/nodes/n0/attempts", json={}).status_code == 201
        assert http.post(f"/v1/jobs/{job_name}/nodes/n1/attempts", json={}).json()["attempt"] == "1"
    os.makedirs(f"{root}/{job_name}/n2/0000000001/999999999")  # an empty planted folder, then reindex
    with ServiceClient(sqlite_service.live.url) as client:
        (result,) = [r for r in reindex(client, root) if r.job == job_name]
        assert result.counters_behind == {}, "the planted id raises no counter"
        assert client.start_attempt(job_name, "n2") == "1", "the node's next start is numbered as ever"


def test_offline_numbering_ignores_a_planted_id_above_the_accepted_limit(tmp_path):
    store = Store(str(tmp_path))
    store.save("j", "n0", 0, {"w": np.zeros(2)}, attempt="999999999")
    assert store.next_attempt("j", "n0").startswith("1-")


# -- 8. an Idempotency-Key reused with a different body ------------------------------------------


def test_an_idempotency_key_reused_with_another_body_is_refused(service, job_name):
    with service.client() as http:
        declare(http, service.storage, job_name, ["n0"])
        path, key = f"/v1/jobs/{job_name}/nodes/n0/attempts", {"Idempotency-Key": "start-7"}
        first = http.post(path, json={"at_least": 5}, headers=key)
        assert first.status_code == 201 and first.json()["attempt"] == "5"
        assert http.post(path, json={"at_least": 5}, headers=key).json() == first.json(), "a retry: the same"
        other = http.post(path, json={"resumed_from": {"epoch": 3}}, headers=key)
        assert other.status_code == 422 and "another body" in other.json()["detail"]
        again = http.post(path, content=b'{"at_least": 9}', headers=key | {"content-type": "Application/JSON"})
        assert again.status_code == 422, "the route refuses it as the fast path does"
        assert [a["attempt"] for a in http.get(f"/v1/jobs/{job_name}/attempts").json()] == ["5"]


# -- 9. an event id above the newest ---------------------------------------------------------------


def test_an_event_id_beyond_the_newest_gets_a_reset_not_silence(sqlite_service, job_name):
    with sqlite_service.client() as http:
        declare(http, sqlite_service.storage, job_name, ["n0"])
        page = http.get("/v1/events", params={"format": "json", "after": 10**12}).json()
        assert page["reset"] and page["events"] and page["events"][0]["id"] <= page["last_id"] + len(page["events"])
        with http.stream("GET", "/v1/events", headers={"Last-Event-ID": str(10**12)}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("id: ") and next(lines) == "event: reset"
    with ServiceClient(sqlite_service.live.url) as client:  # a Python follower goes on from the oldest
        first = next(iter(client.events(job_name, after=10**12)))
        assert first.type == "job.declared" and first.job == job_name


# -- webhooks: a receiver that can be slow, failing, or fine ----------------------------------------

HOOK_SECRET = "third-pass-webhook-secret"


class Receiver:
    """A loopback webhook receiver: records what it got; `trickle` answers 200, then sends a body byte
    every half second; `slow_headers` sends its status line a byte every half second; `failing`
    answers 503."""

    def __init__(self) -> None:
        import http.server
        import threading
        import time

        from tests.servers import free_port

        self.received: list[tuple[float, str, bytes]] = []
        self.trickle = self.failing = self.slow_headers = False
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if receiver.failing:
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                receiver.received.append((time.monotonic(), self.path, body))
                if receiver.slow_headers:
                    for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n":
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(0.5)
                    return
                self.send_response(200)
                self.send_header("Content-Length", "20" if receiver.trickle else "0")
                self.end_headers()
                for _ in range(20 if receiver.trickle else 0):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.5)

            def log_message(self, *args) -> None:
                pass

        self.port = free_port()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def webhook_settings(tmp_path, **overrides):
    """A SQLite service whose webhooks may target this machine, polled every 0.1 s."""
    from tests.conftest import service_settings

    return service_settings(
        str(tmp_path), f"sqlite:///{tmp_path}/svc.db", webhook_hosts="127.0.0.1", webhook_poll_seconds=0.1, **overrides
    )


@pytest.fixture
def hooked(tmp_path):
    from tests.live import LiveService

    settings = webhook_settings(tmp_path, webhook_timeout_seconds=3)
    live, receiver = LiveService(settings), Receiver()
    yield live, receiver
    live.stop()
    receiver.stop()


def hook(http, name: str, url: str, job: str) -> None:
    spec = {"url": url, "events": ["job.declared", "checkpoint.committed"], "job": job, "secret": HOOK_SECRET}
    answer = http.put(f"/v1/webhooks/{name}", json=spec)
    assert answer.status_code == 201, answer.text


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:99999/x",
        "http://127.0.0.1:\uff19/x",  # a fullwidth digit
        "http://[::1/x",
        "http://[not-v6]/x",
        "http://user:pw@127.0.0.1:9/x",
        "http://169.254.169.254\\@127.0.0.1:9/",
    ],
)
def test_webhook_urls_that_do_not_parse_plainly_are_refused_with_422(hooked, url):
    live, _ = hooked
    with live.client() as http:
        answer = http.put("/v1/webhooks/bad", json={"url": url, "events": ["position.good"], "secret": HOOK_SECRET})
        assert answer.status_code == 422, (url, answer.status_code, answer.text)
        assert http.get("/v1/webhooks").json() == []


def test_webhook_urls_and_their_secrets_stay_out_of_the_logs(hooked, caplog):
    import logging

    from tests.live import wait_for

    live, receiver = hooked
    job = f"logs-{uuid.uuid4().hex[:6]}"
    with caplog.at_level(logging.INFO), live.client() as http:
        hook(http, "secretive", receiver.url("/hook/SECRETPATH?token=SECRETTOKEN"), job)
        declare(http, live.settings.default_storage, job, ["n0"])
        wait_for(lambda: receiver.received, timeout=20, what="a delivery")
    assert "SECRETPATH" not in caplog.text and "SECRETTOKEN" not in caplog.text


@pytest.mark.parametrize("timestamp, signature", [("1700000000", "sha256=\u00e9"), (None, None), ("\u00b2", "x")])
def test_verify_signature_says_false_for_forged_headers_instead_of_raising(timestamp, signature):
    from ckptstore.wire.events import verify_signature

    assert verify_signature(HOOK_SECRET, timestamp, b"{}", signature, now=1700000000.0) is False


# -- 2. a slow receiver holds nothing else ----------------------------------------------------------


def test_a_slow_receiver_holds_no_other_webhook_and_is_cut_off_at_the_deadline(hooked):
    from tests.live import wait_for

    live, slow = hooked
    fast = Receiver()
    job = f"slow-{uuid.uuid4().hex[:6]}"
    try:
        slow.slow_headers = True  # the worst case: not even its status line comes in time
        with live.client() as http:
            hook(http, "a-slow", slow.url("/slow"), job)
            hook(http, "b-fast", fast.url("/fast"), job)
            sent = time.monotonic()
            declare(http, live.settings.default_storage, job, ["n0"])
            wait_for(lambda: fast.received, timeout=10, what="the fast webhook's delivery")
            # Behind the slow one it would wait its 3 s deadline; alone, a few ms (room for a loaded machine).
            assert fast.received[0][0] - sent < 1.5, "the fast webhook does not wait behind the slow one"

            def cut_off() -> list | None:
                found = http.get("/v1/webhooks/a-slow/deliveries").json()
                return found if found and found[0]["last_error"] else None

            (delivery,) = wait_for(cut_off, timeout=15, what="the slow delivery's outcome")
            assert delivery["status"] == "pending" and delivery["last_error"] == "no answer within 3 s"
            assert delivery["last_attempt_at"] - delivery_started(slow) < 5, "cut off at the deadline"
    finally:
        fast.stop()


def delivery_started(receiver: Receiver) -> float:
    """When the receiver got the first request, on the wall clock (its own stamps are monotonic)."""
    return time.time() - (time.monotonic() - receiver.received[0][0])


def test_a_trickled_answer_body_is_not_waited_for(tmp_path):
    """The receiver answers 200 at once, then trickles a 10 s body: the delivery counts when the status
    comes, long before the 5 s deadline a sender reading the body would run into."""
    from tests.live import LiveService, wait_for

    live, receiver = LiveService(webhook_settings(tmp_path, webhook_timeout_seconds=5)), Receiver()
    receiver.trickle = True
    job = f"trickle-{uuid.uuid4().hex[:6]}"
    try:
        with live.client() as http:
            hook(http, "trickled", receiver.url(), job)
            declare(http, live.settings.default_storage, job, ["n0"])

            def delivered() -> dict | None:
                found = http.get("/v1/webhooks/trickled/deliveries").json()
                return found[0] if found and found[0]["status"] == "delivered" else None

            delivery = wait_for(delivered, timeout=15, what="the delivery")
            # Typically a few ms; room for a loaded machine, and well below the deadline.
            assert delivery["delivered_at"] - delivery_started(receiver) < 2.5, "its 10 s body was never read"
    finally:
        live.stop()
        receiver.stop()


# -- 4. events a webhook has not been given are not trimmed silently ----------------------------------


def commits(http, root: str, job: str, count: int) -> None:
    for start in range(0, count, 200):
        batch = [{"node": "n0", **commit_body(root, job, "n0", e)} for e in range(start, min(count, start + 200))]
        assert http.post(f"/v1/jobs/{job}/checkpoints/batch", json={"commits": batch}).status_code == 200


@pytest.mark.slow
def test_events_a_webhook_was_not_given_stay_past_the_window_and_past_its_bound_fail_with_a_reason(tmp_path):
    from tests.live import LiveService, wait_for

    settings = webhook_settings(
        tmp_path,
        events_keep_rows=1000,
        events_keep_undelivered_rows=1200,
        webhook_retry_seconds=3600,  # nothing is given up by age (a slow machine's 700 commits take long)
    )
    live, receiver = LiveService(settings), Receiver()
    root, job = settings.default_storage, "trimmed"
    try:
        receiver.failing = True
        with live.client() as http:
            spec = {"url": receiver.url(), "events": ["checkpoint.committed"], "job": job, "secret": HOOK_SECRET}
            assert http.put("/v1/webhooks/behind", json=spec).status_code == 201
            declare(http, root, job, ["n0"])
            commits(http, root, job, 700)  # ~1,400 events (commits and positions), over the 1,000-row window
            dispatcher = live.app.state.webhooks
            dispatcher.trim_log()
            page = http.get("/v1/events", params={"format": "json", "after": 0, "limit": 1}).json()
            oldest = page["events"][0]["id"]
            deliveries = http.get("/v1/webhooks/behind/deliveries", params={"limit": 1000}).json()
            failed = [d for d in deliveries if d["status"] == "failed"]
            assert failed and all("trimmed from the event log" in d["last_error"] for d in failed)
            assert all(d["event_id"] < oldest for d in failed), "only what left the log is failed"
            kept, ids = [], []
            after = 0
            while page := http.get("/v1/events", params={"format": "json", "after": after, "limit": 1000}).json()[
                "events"
            ]:
                ids += [e["id"] for e in page]
                kept += [e["id"] for e in page if e["type"] == "checkpoint.committed" and e["job"] == job]
                after = page[-1]["id"]
            assert ids[0] == oldest and 1000 < len(ids) <= 1200, "past the 1,000-row window, within the bound"
            assert len(kept) + len(failed) == 700, "every commit event is kept for the webhook or failed with a reason"
            receiver.failing = False  # only now: once delivered, events may leave the log at its next trim
            wait_for(lambda: len(receiver.received) >= len(kept), timeout=60, what="every kept event delivered")
            assert [json.loads(body)["id"] for _, _, body in receiver.received] == kept, "none lost, in order"
    finally:
        live.stop()
        receiver.stop()


# -- 10. event streams are capped per caller and in all ----------------------------------------------


def test_event_streams_are_capped_per_caller_and_per_process(tmp_path):
    import contextlib

    import httpx

    from tests.conftest import service_settings
    from tests.live import LiveService, wait_for

    tokens = {"a": "token-for-job-a-0123456", "b": "token-for-job-b-0123456"}
    settings = service_settings(
        str(tmp_path),
        f"sqlite:///{tmp_path}/svc.db",
        job_tokens=tokens,
        token="the-admin-token-0123456",
        events_max_streams=5,
        events_max_streams_per_caller=3,
    )
    live = LiveService(settings)
    hub = live.app.state.hub
    try:
        with contextlib.ExitStack() as streams:

            def open_stream(job: str) -> httpx.Response:
                headers = {"Authorization": f"Bearer {tokens[job]}"}
                return streams.enter_context(httpx.stream("GET", f"{live.url}/v1/events", headers=headers))

            assert all(open_stream("a").status_code == 200 for _ in range(3))
            wait_for(lambda: len(hub.subscribers) == 3, what="three streams")
            refused = open_stream("a")
            assert refused.status_code == 429 and refused.headers["retry-after"] == "5"
            assert "CKPTSTORE_EVENTS_MAX_STREAMS_PER_CALLER" in refused.read().decode()
            assert all(open_stream("b").status_code == 200 for _ in range(2))
            wait_for(lambda: len(hub.subscribers) == 5, what="five streams")
            full = open_stream("b")
            assert full.status_code == 503 and "CKPTSTORE_EVENTS_MAX_STREAMS" in full.read().decode()
        wait_for(lambda: not hub.subscribers, what="closed streams leave")
        with httpx.stream("GET", f"{live.url}/v1/events", headers={"Authorization": f"Bearer {tokens['a']}"}) as again:
            assert again.status_code == 200
    finally:
        live.stop()


# -- 11, 12. the command line's terminal output and `watch`'s arguments ---------------------------------


def test_epochs_and_watch_escape_control_characters_from_job_data(sqlite_service, job_name):
    import subprocess
    import sys

    hostile = "\x1b]0;pwned\x07\x1b[2J\u202egnp.exe"
    root, url = sqlite_service.storage, sqlite_service.live.url
    with sqlite_service.client() as http:
        declare(http, root, job_name, ["n0"])
        assert http.post(
            f"/v1/jobs/{job_name}/nodes/n0/checkpoints", json=commit_body(root, job_name, "n0", 0)
        ).is_success
        mark = {"epoch": 0, "state": "corrupt", "reason": hostile}
        assert http.post(f"/v1/jobs/{job_name}/nodes/n0/checkpoints/mark", json=mark).is_success
    for argv in (["epochs", job_name], ["watch", job_name, "--since", "0", "--count", "4"]):
        result = subprocess.run(
            [sys.executable, "-m", "ckptstore.client.cli.main", *argv, "--url", url],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        assert "\x1b" not in result.stdout and "\u202e" not in result.stdout and "\x07" not in result.stdout, argv
        assert "\\x1b]0;pwned\\x07" in result.stdout and "\\u202egnp.exe" in result.stdout, argv


@pytest.mark.parametrize("count", ["0", "-1"])
def test_watch_refuses_a_count_below_one(count):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "ckptstore.client.cli.main", "watch", "--count", count], capture_output=True, text=True
    )
    assert result.returncode == 2 and "must be 1 or more" in result.stderr


def test_watch_against_a_service_that_never_answers_says_so_in_one_line_and_exits_1():
    import subprocess
    import sys

    from tests.servers import free_port

    url = f"http://127.0.0.1:{free_port()}"
    result = subprocess.run(
        [sys.executable, "-m", "ckptstore.client.cli.main", "watch", "--url", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "cannot be used" in result.stderr


# -- 5. DCP metadata is data, never code ----------------------------------------------------------------


class _Planted:
    """What a storage writer could plant as DCP metadata: a pickle that runs a command when loaded."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_planted_dcp_metadata_pickle_is_refused_and_runs_nothing(tmp_path):
    import pickle

    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from ckptstore.client.torch.dcp import METADATA_KEY, CkptstoreReader, CkptstoreWriter
    from ckptstore.errors import CorruptCheckpointError

    state = {"w": torch.arange(6, dtype=torch.float32)}
    dcp.save(state, storage_writer=CkptstoreWriter(str(tmp_path), "planted", 0))
    loaded = {"w": torch.zeros(6)}
    dcp.load(loaded, storage_reader=CkptstoreReader(str(tmp_path), "planted"))  # the real metadata loads
    assert torch.equal(loaded["w"], state["w"])
    marker = tmp_path / "ran"
    poison = np.frombuffer(pickle.dumps(_Planted(str(marker))), np.uint8)
    Store(str(tmp_path)).save("planted", "node-0", 1, {METADATA_KEY: poison}, attempt="9")  # a newer position
    reader = CkptstoreReader(str(tmp_path), "planted")
    with pytest.raises(CorruptCheckpointError, match="system, which DCP metadata never does"):
        reader.read_metadata()
    with pytest.raises(BaseException):  # DCP wraps the refusal in its CheckpointException (a BaseException)
        dcp.load({"w": torch.zeros(6)}, storage_reader=CkptstoreReader(str(tmp_path), "planted"))
    assert not marker.exists(), "the planted command never ran"


# -- 13. max_to_keep=None keeps every position ---------------------------------------------------------


def test_max_to_keep_none_keeps_every_position(sqlite_service, job_name):
    from ckptstore import Position
    from ckptstore.client.engine.node import NodeCheckpointer

    node = NodeCheckpointer(
        job=job_name, storage=sqlite_service.storage, service=sqlite_service.live.url, node="n0", max_to_keep=None
    )
    node.start()
    for epoch in range(8):
        node.save(Position(epoch), {"w": np.full(2, epoch, np.float32)})
    node.close()
    with ServiceClient(sqlite_service.live.url) as client:
        assert client.get_job(job_name).retention.keep_last is None
    assert Store(sqlite_service.storage).list_epochs(job_name, "n0") == list(range(8)), "retention deleted nothing"
