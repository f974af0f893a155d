"""Large jobs and batched writes: the batch commit endpoint answers each commit as it would alone;
reports that piled up during an outage are re-posted in one request; a 4,096-node job registers
its attempts, commits one position and pages through its lists; the job page of a large job shows
counts per position and names the nodes that hold it back."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading

import httpx
import numpy as np
import pytest

from ckptstore import Store
from ckptstore.client import ServiceClient
from ckptstore.client.engine.reports import Reports
from ckptstore.client.service.operations import iter_attempts
from ckptstore.client.service.wire import Commit
from ckptstore.wire.schema import COMMIT_BATCH_LIMIT, MAX_NODES
from tests.builders import commit_body, declare
from tests.conftest import service_settings
from tests.live import LiveService, wait_for


def post_batch(http: httpx.Client, job: str, commits: list[dict]) -> httpx.Response:
    return http.post(f"/v1/jobs/{job}/checkpoints/batch", json={"commits": commits})


def test_a_batch_answers_each_commit_as_it_would_alone(service, job_name):
    root = service.storage
    with service.client() as http:
        declare(http, root, job_name, ["n0", "n1"])
        for _ in range(2):
            assert http.post(f"/v1/jobs/{job_name}/nodes/n0/attempts", json={}).status_code == 201  # n0 is at attempt 2
        good = commit_body(root, job_name, "n0", 0, attempt=2)
        commits = [
            {"node": "n0", **good},
            {"node": "n0", **good},
            {"node": "n0", **good, "bytes": 999},
            {"node": "n0", **commit_body(root, job_name, "n0", 1, attempt=1)},
            {"node": "n1", **commit_body(root, job_name, "n1", 0), "location": f"{root}/elsewhere"},
            {"node": "n1", **commit_body(root, job_name, "n1", 0)},
        ]
        assert http.get(f"/v1/jobs/{job_name}/last-good-epoch").json()["epoch"] is None  # cached: none yet
        response = post_batch(http, job_name, commits)
        assert response.status_code == 200, response.text
        outcomes = response.json()
        assert [o["status"] for o in outcomes] == [201, 200, 409, 409, 422, 201]
        assert [o["error"]["error"] for o in outcomes if o.get("error")] == ["conflict", "fenced", "invalid"]
        assert outcomes[0]["record"]["attempt"] == "2" and outcomes[5]["record"]["node"] == "n1"
        records = http.get(f"/v1/jobs/{job_name}/checkpoints").json()
        assert sorted((r["node"], r["epoch"], r["attempt"], r["bytes"]) for r in records) == [
            ("n0", 0, "2", 100),
            ("n1", 0, "1", 100),
        ], "the refused commits changed nothing"
        assert http.get(f"/v1/jobs/{job_name}/last-good-epoch").json()["epoch"] == 0
        page = http.get("/v1/events", params={"format": "json", "job": job_name, "limit": 1000}).json()
        committed = [(e["node"], e["data"]["attempt"]) for e in page["events"] if e["type"] == "checkpoint.committed"]
        assert committed == [("n0", "2"), ("n1", "1")], "refused commits emitted no event"

        too_many = [{"node": "n1", **commit_body(root, job_name, "n1", e)} for e in range(COMMIT_BATCH_LIMIT + 1)]
        for bad in ([], too_many, [{"node": "../x", **commit_body(root, job_name, "n1", 5)}]):
            assert post_batch(http, job_name, bad).status_code == 422
        assert post_batch(http, "no-such-job", commits[:1]).json()[0]["status"] == 404
        assert len(http.get(f"/v1/jobs/{job_name}/checkpoints").json()) == 2, "nothing recorded by refused batches"


def test_commits_and_registrations_answered_before_routing_get_the_routes_answers(service, job_name):
    """Well-formed commits and registrations skip FastAPI's routing (ckptstore.server.http.fastpath); the same
    requests sent with a content type spelled as only the routes take it get the same answers."""
    root = service.storage
    routed = {"content-type": "Application/JSON"}
    with service.client() as http:
        declare(http, root, job_name, ["n0", "n1"])
        attempts = f"/v1/jobs/{job_name}/nodes/n0/attempts"
        fast = http.post(attempts, json={}, headers={"Idempotency-Key": "start-1"})
        slow = http.post(attempts, content=b"{}", headers=routed | {"Idempotency-Key": "start-1"})
        assert fast.status_code == slow.status_code == 201 and fast.json() == slow.json()
        assert http.post(attempts, content=b"", headers=routed).json()["attempt"] == "2"
        assert http.post(attempts, content=b"", headers={"content-type": "application/json"}).json()["attempt"] == "3"

        path = f"/v1/jobs/{job_name}/nodes/n0/checkpoints"
        body = commit_body(root, job_name, "n0", 0, attempt=3)
        created = http.post(path, json=body)
        repeated = http.post(path, content=json.dumps(body), headers=routed)
        assert (created.status_code, repeated.status_code) == (201, 200) and created.json() == repeated.json()
        refusals = [
            body | {"bytes": 5},  # 409 conflict
            commit_body(root, job_name, "n0", 1, attempt=2),  # 409 fenced
            body | {"location": f"{root}/elsewhere"},  # 422 invalid
            body | {"epoch": -1},  # 422 from validation: the fast path hands it to the route
        ]
        for refused in refusals:
            answers = [http.post(path, json=refused), http.post(path, content=json.dumps(refused), headers=routed)]
            assert answers[0].status_code == answers[1].status_code >= 400
            assert answers[0].json() == answers[1].json()
        unknown = [http.post(f"/v1/jobs/{job_name}-x/nodes/n0/checkpoints", json=body, headers=h) for h in ({}, routed)]
        assert unknown[0].status_code == unknown[1].status_code == 404 and unknown[0].json() == unknown[1].json()
        assert len(http.get(f"/v1/jobs/{job_name}/checkpoints").json()) == 1, "the refusals changed nothing"


def fast_path_count(http: httpx.Client, route: str) -> float:
    """How many writes to `route` the fast path answered (the service's /metrics)."""
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("ckptstore_fast_path_total{") and f'route="{route}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_batch_commit_the_python_client_sends_is_answered_by_the_fast_path(service, job_name):
    """The Python client commits only through `…/checkpoints/batch`: that route is on the fast path
    (counted), and the same batch sent so only the route takes it gets the same answers."""
    from ckptstore.server.http.fastpath import BATCH_ROUTE

    root = service.storage
    routed = {"content-type": "Application/JSON"}
    with service.client() as http:
        declare(http, root, job_name, ["n0", "n1"])
        path = f"/v1/jobs/{job_name}/checkpoints/batch"
        commits = [{"node": n, **commit_body(root, job_name, n, 0)} for n in ("n0", "n1")]
        commits.append({"node": "n0", **commit_body(root, job_name, "n0", 0)} | {"bytes": 9})  # a conflict
        before = fast_path_count(http, BATCH_ROUTE)
        fast = http.post(path, json={"commits": commits})
        assert fast_path_count(http, BATCH_ROUTE) == before + 1, "answered before routing"
        slow = http.post(path, content=json.dumps({"commits": commits}), headers=routed)
        assert fast_path_count(http, BATCH_ROUTE) == before + 1, "that one went through the route"
        assert fast.status_code == slow.status_code == 200
        assert [o["status"] for o in fast.json()] == [201, 201, 409]
        assert [o["status"] for o in slow.json()] == [200, 200, 409]
        assert [o["record"] for o in fast.json()][:2] == [o["record"] for o in slow.json()][:2]
        assert fast.json()[2]["error"] == slow.json()[2]["error"]
        with ServiceClient(service.live.url) as client:  # the Python client's own commits take that route
            store = Store(root)
            ref = store.save(job_name, "n0", 1, {"w": np.zeros(2, np.float32)}, attempt=1)
            client.commit(ref)
        assert fast_path_count(http, BATCH_ROUTE) == before + 2


def test_the_writes_of_one_group_transaction_see_the_rows_the_earlier_ones_hold(service, job_name):
    """Commits and registrations hold their new rows until the end of their group transaction
    (server/records/held.py), and registrations read their nodes' attempt numbers once for it; a later
    write of the same transaction must still see what an earlier one holds — an Idempotency-Key
    answered in it, the node's newest attempt, an identical commit, the nodes of a position it
    created — and what was stored before. The writer is held up so that every request lands in
    one transaction."""
    root = service.storage
    writes = service.live.server.config.app.state.writes
    other = f"{job_name}-b"
    attempts = f"/v1/jobs/{job_name}/nodes/n0/attempts"
    with service.client() as http:
        declare(http, root, job_name, ["n0", "n1"])
        declare(http, root, other, ["a", "b"])
        assert http.post(attempts, json={}, headers={"Idempotency-Key": "start-0"}).json()["attempt"] == "1"
        gate, holding = threading.Event(), threading.Event()

        def hold(session) -> None:
            holding.set()
            gate.wait(120)  # released below, or by the deadline if the test fails

        writes.submit("", hold)
        assert holding.wait(60), "the writer runs the gate alone (a request queued before it would join its batch)"
        n1 = f"/v1/jobs/{job_name}/nodes/n1/checkpoints"
        requests = [(attempts, {}, {"Idempotency-Key": "start-n0"})] * 3 + [(attempts, {}, {})] * 2
        requests += [(attempts, {}, {"Idempotency-Key": "start-0"})]  # a retry of the stored one
        requests += [(n1, commit_body(root, job_name, "n1", 0), {})] * 2
        requests += [(f"/v1/jobs/{other}/nodes/{n}/checkpoints", commit_body(root, other, n, 0), {}) for n in "ab"]
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            answers = [pool.submit(http.post, path, json=body, headers=h) for path, body, h in requests]
            try:
                wait_for(
                    lambda: writes._queue.qsize() >= len(requests),
                    timeout=90,
                    what="every request queued behind the gate",
                )
            finally:
                gate.set()
            answers = [a.result() for a in answers]
    keyed, fresh = [a.json()["attempt"] for a in answers[:3]], [a.json()["attempt"] for a in answers[3:5]]
    assert len(set(keyed)) == 1 and sorted({keyed[0], *fresh}) == ["2", "3", "4"], (keyed, fresh)
    assert answers[5].json()["attempt"] == "1", "the stored key's attempt again"
    assert sorted(a.status_code for a in answers[6:8]) == [200, 201], "the identical re-post found the held copy"
    assert [a.status_code for a in answers[8:]] == [201, 201]
    with service.client() as http:
        assert http.get(f"/v1/jobs/{other}/last-good-epoch").json()["epoch"] == 0, "both nodes counted"
        assert len(http.get(f"/v1/jobs/{job_name}/attempts", params={"node": "n0"}).json()) == 4
        assert [(r["node"], r["epoch"]) for r in http.get(f"/v1/jobs/{job_name}/checkpoints").json()] == [("n1", 0)]
        late = http.post(f"/v1/jobs/{job_name}/nodes/n0/checkpoints", json=commit_body(root, job_name, "n0", 0))
        assert late.status_code == 409 and late.json()["error"] == "fenced", "attempt 1 was fenced"


class CountingTransport(httpx.HTTPTransport):
    """Loopback HTTP that remembers each answered request (method, path, body)."""

    def __init__(self) -> None:
        super().__init__()
        self.answered: list[tuple[str, str, bytes]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        self.answered.append((request.method, request.url.path, request.content))
        return response


def test_commits_queued_during_an_outage_are_reposted_in_one_request(tmp_path):
    settings = service_settings(str(tmp_path), f"sqlite:///{tmp_path}/svc.db")
    live = LiveService(settings)
    store = Store(settings.default_storage)
    job = "outage-batch"
    with live.client() as http:
        declare(http, settings.default_storage, job, ["n0"])
    live.stop()
    transport = CountingTransport()
    client = ServiceClient(live.url, transport=transport, retries=1, backoff=0.01)
    reports = Reports(client, job, "n0")
    for epoch in range(5):
        ref = store.save(job, "n0", epoch, {"w": np.full(8, epoch, np.float32)}, attempt=1)
        reports.commit(Commit(ref, {"loss": 1.0 / (epoch + 1)}))
    assert not reports.drain(), "the service is down: the commits wait"
    assert reports.pending_commits == 5
    live = LiveService(settings, port=live.port)
    try:
        assert reports.drain() and reports.pending_commits == 0
        batches = [json.loads(body) for method, path, body in transport.answered if path.endswith("/checkpoints/batch")]
        assert [len(b["commits"]) for b in batches] == [5], "one request carried every queued commit"
        assert not [p for _, p, _ in transport.answered if re.search(r"/nodes/n0/checkpoints$", p)]
        with live.client() as http:
            records = http.get(f"/v1/jobs/{job}/checkpoints").json()
            assert [(r["epoch"], r["metrics"]["loss"]) for r in records] == [(e, 1.0 / (e + 1)) for e in range(5)]
    finally:
        reports.close()
        client.close()
        live.stop()


@pytest.mark.slow  # a long run: scripts/test.sh -m slow runs it (the default run stays near 30 minutes)
def test_a_4096_node_job_registers_commits_and_pages(sqlite_service, job_name):
    nodes = [f"w{i:04d}" for i in range(MAX_NODES)]
    root = sqlite_service.storage
    with sqlite_service.client() as http, ServiceClient(sqlite_service.live.url) as client:
        declare(http, root, job_name, nodes)

        def register(node: str) -> str:
            return client.start_attempt(job_name, node)

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            assert set(pool.map(register, nodes)) == {"1"}
        attempts = list(iter_attempts(client, job_name))
        assert sorted(a.node for a in attempts) == nodes, "every registration listed once, across pages"
        assert len(client.list_attempts(job_name, limit=10, offset=4090)) == 6
        for bad in ({"limit": 0}, {"limit": 10_001}, {"offset": -1}):
            assert http.get(f"/v1/jobs/{job_name}/attempts", params=bad).status_code == 422

        bodies = [{"node": n, **commit_body(root, job_name, n, 0)} for n in nodes]
        chunks = [bodies[i : i + COMMIT_BATCH_LIMIT] for i in range(0, len(bodies), COMMIT_BATCH_LIMIT)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = [o["status"] for r in pool.map(lambda c: post_batch(http, job_name, c), chunks) for o in r.json()]
        assert answers == [201] * MAX_NODES
        wait_for(lambda: http.get(f"/v1/jobs/{job_name}/last-good-epoch").json()["epoch"] == 0, what="last good")
        page = http.get(f"/v1/jobs/{job_name}/checkpoints", params={"limit": 1000, "offset": 4000}).json()
        assert [r["node"] for r in page] == nodes[4000:]


@pytest.fixture
def big_job(sqlite_service, job_name):
    """A 100-node job: epoch 0 intact everywhere; at epoch 1 one node's copy is corrupt and one node
    has nothing yet."""
    nodes = [f"w{i:03d}" for i in range(100)]
    root = sqlite_service.storage
    with sqlite_service.client() as http:
        declare(http, root, job_name, nodes)
        epoch0 = [{"node": n, **commit_body(root, job_name, n, 0)} for n in nodes]
        epoch1 = [{"node": n, **commit_body(root, job_name, n, 1)} for n in nodes if n != "w042"]
        for batch in (epoch0, epoch1):
            assert {o["status"] for o in post_batch(http, job_name, batch).json()} == {201}
        mark = {"epoch": 1, "state": "corrupt", "reason": "crc32c mismatch"}
        assert http.post(f"/v1/jobs/{job_name}/nodes/w007/checkpoints/mark", json=mark).status_code == 200
    return sqlite_service, job_name


def test_the_page_of_a_large_job_counts_per_position_and_names_the_laggards(big_job):
    service, job = big_job
    with service.client() as http:
        page = http.get(f"/ui/jobs/{job}").text
    assert 'class="grid"' not in page, "no 100-row grid"
    rows = dict(re.findall(r'<tr class="[^"]*" data-position="(\d+)" data-intact="(\d+)" data-absent="\d+"', page))
    assert rows == {"1": "98", "0": "100"}
    epoch1 = re.search(r'data-position="1".*?</tr>', page, re.S).group(0)
    assert re.findall(r'<td class="num[^"]*">(\d+)', epoch1)[:4] == ["100", "98", "1", "0"]
    assert "w042" in epoch1, "the node with nothing yet is named"
    assert "2 nodes behind the newest position" in page
    laggards = re.search(r'<table class="laggards">.*?</table>', page, re.S).group(0)
    assert re.findall(r'<tr data-node="(w\d+)">', laggards) == ["w007", "w042"]
    assert re.search(r"100 nodes; not ok: 100", page), "no node reported health: all listed as not ok, counted"
