"""The metadata service over real HTTP (uvicorn on 127.0.0.1), on SQLite and on PostgreSQL."""

from __future__ import annotations

import concurrent.futures
import itertools

import httpx

from ckptstore.client import ServiceClient
from tests import builders
from tests.builders import commit_body

NODES = ["n0", "n1", "n2"]


def declare(client, service, job, nodes=NODES, **extra):
    return builders.declare(client, service.storage, job, nodes, **extra)


def commit(client, service, job, node, epoch, batch=None, attempt=1, expect=201, **extra):
    response = client.post(
        f"/v1/jobs/{job}/nodes/{node}/checkpoints",
        json=commit_body(service.storage, job, node, epoch, batch, attempt, **extra),
    )
    assert response.status_code == expect, response.text
    return response.json()


def last_good(client, job, **params):
    response = client.get(f"/v1/jobs/{job}/last-good-epoch", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def test_job_lifecycle(service, job_name):
    with service.client() as client:
        assert (
            client.put(f"/v1/jobs/{job_name}", json={"nodes": ["a"], "storage_root": service.storage}).status_code
            == 201
        )
        updated = client.put(f"/v1/jobs/{job_name}", json={"nodes": ["a", "b"], "retention": {"keep_last": 2}})
        assert updated.status_code == 200 and updated.json()["nodes"] == ["a", "b"]
        assert updated.json()["retention"]["keep_last"] == 2
        assert job_name in [j["job"] for j in client.get("/v1/jobs", params={"limit": 1000}).json()]
        assert client.get(f"/v1/jobs/{job_name}").json()["last_good_epoch"] is None
        assert client.delete(f"/v1/jobs/{job_name}").status_code == 204
        missing = client.get(f"/v1/jobs/{job_name}")
        assert missing.status_code == 404 and missing.json()["error"] == "not_found"


def test_a_position_is_good_only_when_every_expected_node_committed(service, job_name):
    with service.client() as client:
        declare(client, service, job_name)
        commit(client, service, job_name, "n0", 0)
        commit(client, service, job_name, "n1", 0)
        answer = last_good(client, job_name)
        assert answer["epoch"] is None and answer["resume"] is None
        assert answer["not_good"] == [
            {"epoch": 0, "batch": None, "missing": ["n2"], "corrupt": [], "deleted": [], "reasons": {}}
        ]
        commit(client, service, job_name, "n2", 0)
        answer = last_good(client, job_name)
        assert answer["epoch"] == 0 and answer["resume"] == {"epoch": 0, "batch": None}
        assert answer["nodes"]["n1"]["location"].endswith(f"/{job_name}/n1/0000000000/1")
        assert answer["not_good"] == []


def test_a_node_asks_for_its_own_part_of_the_last_good_answer_and_a_new_commit_refreshes_it(service, job_name):
    with service.client() as client:
        declare(client, service, job_name)
        for node in ("n0", "n1", "n2"):
            commit(client, service, job_name, node, 0)
        whole = last_good(client, job_name)
        for _ in range(2):  # computed, then the cached bytes (ckptstore.server.http.fastpath)
            own = last_good(client, job_name, node="n1")
            assert own == whole | {"nodes": {"n1": whole["nodes"]["n1"]}}, own
        assert last_good(client, job_name, max_epoch=0, node="n2")["nodes"].keys() == {"n2"}
        assert last_good(client, job_name, node="stranger")["nodes"] == {}, "a node the job lacks has no part"
        for node in ("n0", "n1", "n2"):
            commit(client, service, job_name, node, 1)
        own = last_good(client, job_name, node="n1")
        assert own["epoch"] == 1 and own["nodes"]["n1"]["location"].endswith("/n1/0000000001/1"), "not the stale one"
        repeated = client.get(f"/v1/jobs/{job_name}/last-good-epoch?node=n1&node=n2").json()
        assert repeated["nodes"].keys() == {"n2"}, "the route's reading (the last), not a cached n1"
        assert client.get(f"/v1/jobs/{job_name}/last-good-epoch?node=..").status_code == 422
        assert client.get(f"/v1/jobs/{job_name}/last-good-epoch?max_epoch=0node=n1").status_code == 422


def test_out_of_order_commits_and_mid_epoch_positions(service, job_name):
    with service.client() as client:
        declare(client, service, job_name)
        for node in NODES:  # epoch 2 arrives before epoch 1
            commit(client, service, job_name, node, 2)
        for node in NODES[:2]:
            commit(client, service, job_name, node, 1)
        assert last_good(client, job_name)["epoch"] == 2
        for node in NODES:
            commit(client, service, job_name, node, 3, batch=50)
        commit(client, service, job_name, "n0", 3, batch=80)
        answer = last_good(client, job_name)
        assert answer["epoch"] == 2 and answer["resume"] == {"epoch": 3, "batch": 50}
        assert answer["not_good"] == [
            {"epoch": 3, "batch": 80, "missing": ["n1", "n2"], "corrupt": [], "deleted": [], "reasons": {}}
        ]
        assert last_good(client, job_name, max_epoch=1)["epoch"] is None, "epoch 1 never became good"
        capped = last_good(client, job_name, max_epoch=2)
        assert capped["epoch"] == 2 and capped["resume"] == {"epoch": 2, "batch": None}


def test_a_corrupt_mark_demotes_the_position(service, job_name):
    with service.client() as client:
        declare(client, service, job_name)
        for epoch, node in itertools.product((0, 1), NODES):
            commit(client, service, job_name, node, epoch)
        marked = client.post(
            f"/v1/jobs/{job_name}/nodes/n1/checkpoints/mark",
            json={"epoch": 1, "state": "corrupt", "reason": "verify: checksum mismatch"},
        )
        assert marked.status_code == 200 and marked.json()[0]["state"] == "corrupt"
        answer = last_good(client, job_name)
        assert answer["epoch"] == 0
        assert answer["not_good"] == [
            {
                "epoch": 1,
                "batch": None,
                "missing": [],
                "corrupt": ["n1"],
                "deleted": [],
                "reasons": {"n1": "verify: checksum mismatch"},
            }
        ]
        commit(client, service, job_name, "n1", 1, attempt=2)  # a later attempt re-saves it
        assert last_good(client, job_name)["epoch"] == 1
        listed = client.get(f"/v1/jobs/{job_name}/checkpoints", params={"state": "corrupt"}).json()
        assert [(r["node"], r["epoch"], r["attempt"]) for r in listed] == [("n1", 1, "1")]


def test_changing_the_node_set_applies_to_positions_written_after(service, job_name):
    with service.client() as client:
        declare(client, service, job_name)
        for node in NODES:
            commit(client, service, job_name, node, 0)
        commit(client, service, job_name, "n0", 1)  # epoch 1 begins under the 3-node set
        declare(client, service, job_name, nodes=["n0", "n1"])
        commit(client, service, job_name, "n1", 1)
        assert last_good(client, job_name)["epoch"] == 0, "epoch 1 still needs n2 (written before the change)"
        commit(client, service, job_name, "n0", 2)
        commit(client, service, job_name, "n1", 2)
        assert last_good(client, job_name)["epoch"] == 2
        rejected = client.post(
            f"/v1/jobs/{job_name}/nodes/n2/checkpoints", json=commit_body(service.storage, job_name, "n2", 3)
        )
        assert rejected.status_code == 422, "n2 is no longer an expected node"


def test_attempts_fencing_idempotency_and_conflicts(service, job_name):
    with service.client() as client:
        declare(client, service, job_name, nodes=["n0"])
        first = client.post(f"/v1/jobs/{job_name}/nodes/n0/attempts", json={})
        assert first.status_code == 201 and first.json()["attempt"] == "1"
        commit(client, service, job_name, "n0", 0, attempt=1)
        commit(client, service, job_name, "n0", 0, attempt=1, expect=200)  # identical re-post
        conflict = client.post(
            f"/v1/jobs/{job_name}/nodes/n0/checkpoints",
            json=commit_body(service.storage, job_name, "n0", 0, attempt=1, bytes=999),
        )
        assert conflict.status_code == 409 and conflict.json()["error"] == "conflict"
        second = client.post(f"/v1/jobs/{job_name}/nodes/n0/attempts", json={"resumed_from": {"epoch": 0}})
        assert second.json()["attempt"] == "2"
        fenced = client.post(
            f"/v1/jobs/{job_name}/nodes/n0/checkpoints", json=commit_body(service.storage, job_name, "n0", 1)
        )
        assert fenced.status_code == 409 and fenced.json()["error"] == "fenced"
        commit(client, service, job_name, "n0", 1, attempt=2)
        history = client.get(f"/v1/jobs/{job_name}/attempts").json()
        assert [(a["attempt"], a["resumed_from"]) for a in history] == [("1", None), ("2", {"epoch": 0, "batch": None})]
        foreign = commit_body(service.storage, job_name, "n0", 2, attempt=2)
        foreign["location"] = foreign["location"].replace(job_name, "other-job")
        response = client.post(f"/v1/jobs/{job_name}/nodes/n0/checkpoints", json=foreign)
        assert response.status_code == 422 and response.json()["error"] == "invalid"
        third = client.post(f"/v1/jobs/{job_name}/nodes/n0/attempts", json={})
        assert third.status_code == 201 and third.json()["attempt"] == "3"


class LosesFirstAnswer(httpx.HTTPTransport):
    """Loopback HTTP whose first answer is lost after the service acted on the request."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        self.sent += 1
        if self.sent == 1:
            response.close()
            raise httpx.ReadTimeout("the answer was lost", request=request)
        return response


def test_a_registration_retried_after_a_lost_answer_gets_the_same_attempt(service, job_name):
    with service.client() as http:
        declare(http, service, job_name, nodes=["n0"])
        path = f"/v1/jobs/{job_name}/nodes/n0/attempts"
        keyed = [http.post(path, json={}, headers={"Idempotency-Key": "start-a"}) for _ in range(2)]
        assert [r.json()["attempt"] for r in keyed] == ["1", "1"], "a repeated key is the same start"
        assert http.post(path, json={}, headers={"Idempotency-Key": "start-b"}).json()["attempt"] == "2"
        for bad in ("", "x" * 65, "a b", "../x"):
            refused = http.post(path, json={}, headers={"Idempotency-Key": bad})
            assert refused.status_code == 422, (bad, refused.text)
        transport = LosesFirstAnswer()
        with ServiceClient(service.live.url, transport=transport, backoff=0.01) as client:
            assert client.start_attempt(job_name, "n0") == "3"
        assert transport.sent == 2, "the client re-sent its registration"
        history = http.get(f"/v1/jobs/{job_name}/attempts").json()
        assert [a["attempt"] for a in history] == ["1", "2", "3"], "the retry registered nothing more"


def test_offline_attempts_are_numbered_past_by_the_service(service, job_name):
    with service.client() as client:
        declare(client, service, job_name, nodes=["n0"])
        commit(client, service, job_name, "n0", 0, attempt="4-1a2b3c4d")
        assert client.post(f"/v1/jobs/{job_name}/nodes/n0/attempts", json={}).json()["attempt"] == "5"


def test_concurrent_committers_lose_nothing_and_duplicate_nothing(service, job_name):
    nodes = [f"n{i}" for i in range(4)]
    with service.client() as client:
        declare(client, service, job_name, nodes=nodes)

    work = [(node, epoch) for node in nodes for epoch in range(6)] * 2  # every commit posted twice

    def post(item):
        node, epoch = item
        with service.client() as client:
            response = client.post(
                f"/v1/jobs/{job_name}/nodes/{node}/checkpoints",
                json=commit_body(service.storage, job_name, node, epoch),
            )
            return response.status_code

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(post, work))
    assert sorted(set(statuses)) == [200, 201] and statuses.count(201) == 24, statuses
    with service.client() as client:
        records = client.get(f"/v1/jobs/{job_name}/checkpoints").json()
        assert sorted((r["node"], r["epoch"]) for r in records) == sorted(set(work))
        assert last_good(client, job_name)["epoch"] == 5


def test_health_reports_staleness_and_probe(service, job_name, tmp_path):
    with service.client() as client:
        declare(client, service, job_name, nodes=["n0", "n1"])
        put = client.put(
            f"/v1/jobs/{job_name}/nodes/n0/health",
            json={"cp_accessible": False, "latency_ms": None, "error": "timeout"},
        )
        assert put.status_code == 200 and put.json()["stale"] is False
        health = client.get(f"/v1/jobs/{job_name}/health").json()
        by_node = {n["node"]: n for n in health["nodes"]}
        assert by_node["n0"]["cp_accessible"] is False and by_node["n0"]["error"] == "timeout"
        assert by_node["n1"]["stale"] is True and by_node["n1"]["cp_accessible"] is None
        assert health["probe"] is None
        probed = client.get(f"/v1/jobs/{job_name}/health", params={"probe": "true"}).json()["probe"]
        assert probed["cp_accessible"] is True and probed["latency_ms"] >= 0


def test_stats_summary(service, job_name):
    with service.client() as client:
        declare(client, service, job_name, nodes=["n0"])
        for seconds in (1.0, 2.0, 3.0, 4.0, 10.0):
            response = client.post(
                f"/v1/jobs/{job_name}/stats", json={"node": "n0", "action": "save", "seconds": seconds, "bytes": 100}
            )
            assert response.status_code == 204
        rows = client.get(f"/v1/jobs/{job_name}/stats").json()["rows"]
        assert rows == [
            {
                "action": "save",
                "node": "n0",
                "count": 5,
                "mean": 4.0,
                "p50": 3.0,
                "p95": 10.0,
                "max": 10.0,
                "bytes": 500,
            }
        ]


def test_gc_plan_never_touches_the_protected_range(service, job_name):
    with service.client() as client:
        declare(client, service, job_name, retention={"keep_last": 2})
        for epoch, node in itertools.product(range(5), NODES):
            commit(client, service, job_name, node, epoch)
        commit(client, service, job_name, "n0", 5)
        plan = client.get(f"/v1/jobs/{job_name}/gc-plan").json()
        assert plan["last_good_epoch"] == 4
        assert sorted({(d["epoch"], d["node"]) for d in plan["deletions"]}) == sorted(
            itertools.product(range(3), NODES)
        )
        assert all(
            d["reason"] == "retention" and d["location"].endswith(f"/{d['epoch']:010d}/1") for d in plan["deletions"]
        )


def test_operations_endpoints(service):
    with service.client() as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        assert client.get("/readyz").json() == {"status": "ready"}
        metrics = client.get("/metrics").text
        assert "ckptstore_requests_total" in metrics and "ckptstore_commits_total" in metrics
        assert client.get("/docs").status_code == 200
        assert "/v1/jobs/{job}/last-good-epoch" in client.get("/openapi.json").json()["paths"]


def test_the_job_answer_is_served_from_cache_and_never_stale(service, job_name):
    with service.client() as client:
        declare(client, service, job_name)
        first, cached = (client.get(f"/v1/jobs/{job_name}").json() for _ in range(2))
        assert cached == first and first["last_good_epoch"] is None
        for node in NODES:
            commit(client, service, job_name, node, 0)
        assert client.get(f"/v1/jobs/{job_name}").json()["last_good_epoch"] == 0, "a commit changes the answer"
        declare(client, service, job_name, retention={"keep_last": 3})
        again = client.get(f"/v1/jobs/{job_name}").json()
        assert again["retention"]["keep_last"] == 3 and again["updated_at"] > first["updated_at"]
        assert client.delete(f"/v1/jobs/{job_name}").status_code == 204
        assert client.get(f"/v1/jobs/{job_name}").status_code == 404, "a deleted job is not served from cache"


def test_an_answer_read_right_after_a_commit_is_never_older_than_the_commit(postgres_service, job_name, monkeypatch):
    """The process that committed answers from its caches by the versions it knows; on PostgreSQL it
    hears other processes' versions by notification. Here every notification is held back (as if still
    on its way): its own commits must still make its next answers new (`Database.on_versions`)."""
    versions = postgres_service.live.app.state.versions
    assert versions.listening, "the process hears version notifications"
    with postgres_service.client() as client:
        declare(client, postgres_service, job_name, nodes=["n0"])
        monkeypatch.setattr(versions, "_heard", lambda payload: None)
        for epoch in range(3):
            for _ in range(2):  # computed, then from the caches
                assert last_good(client, job_name)["epoch"] == (epoch - 1 if epoch else None)
                assert last_good(client, job_name, node="n0")["epoch"] == (epoch - 1 if epoch else None)
                assert client.get(f"/v1/jobs/{job_name}").json()["last_good_epoch"] == (epoch - 1 if epoch else None)
            commit(client, postgres_service, job_name, "n0", epoch)
        assert last_good(client, job_name)["epoch"] == 2
        assert last_good(client, job_name, node="n0")["epoch"] == 2
        assert client.get(f"/v1/jobs/{job_name}").json()["last_good_epoch"] == 2
