"""A node's start in one request (`POST …/nodes/{node}/start`): registered and answered at once while
nothing has to change first, declined — changing nothing — when the declaration moved or storage holds
copies the service never recorded; and the client taking it, or the long way, on SQLite and PostgreSQL."""

from __future__ import annotations

import re
import uuid

import numpy as np

from ckptstore import Position
from ckptstore.client import ServiceClient
from ckptstore.client.engine.node import NodeCheckpointer
from tests import builders
from tests.builders import commit_body

STATE = {"w": np.arange(64, dtype=np.float32)}


def started(http, job: str, node: str, declared_at: float, stored: list[dict], key: str | None = None):
    headers = {} if key is None else {"Idempotency-Key": key}
    body = {"declared_at": declared_at, "stored": stored}
    return http.post(f"/v1/jobs/{job}/nodes/{node}/start", json=body, headers=headers)


def attempts(http, job: str) -> list[tuple[str, str]]:
    return [(a["node"], a["attempt"]) for a in http.get(f"/v1/jobs/{job}/attempts").json()]


def test_a_start_registers_fences_and_answers_the_node_part_in_one_request(service, job_name):
    with service.client() as http:
        declared = builders.declare(http, service.storage, job_name, ["n0", "n1"])
        for node in ("n0", "n1"):
            assert http.post(f"/v1/jobs/{job_name}/nodes/{node}/attempts", json={}).status_code == 201
            body = commit_body(service.storage, job_name, node, 0)
            assert http.post(f"/v1/jobs/{job_name}/nodes/{node}/checkpoints", json=body).status_code == 201
        answer = started(http, job_name, "n0", declared["updated_at"], [{"epoch": 0, "attempt": "1"}], key="k-1")
        assert answer.status_code == 200, answer.text
        start = answer.json()
        assert start["attempt"]["attempt"] == "2" and start["refused"] is None and start["unknown"] == []
        assert start["resume"]["resume"] == {"epoch": 0, "batch": None}
        assert start["resume"]["nodes"].keys() == {"n0"}, "the node's own part only"
        assert start["resume"]["nodes"]["n0"]["attempt"] == "1"
        again = started(http, job_name, "n0", declared["updated_at"], [{"epoch": 0, "attempt": "1"}], key="k-1")
        assert again.json()["attempt"]["attempt"] == "2", "a retry with the same key is the same start"
        zombie = http.post(
            f"/v1/jobs/{job_name}/nodes/n0/checkpoints", json=commit_body(service.storage, job_name, "n0", 1)
        )
        assert zombie.status_code == 409 and zombie.json()["error"] == "fenced", "attempt 1 is fenced"
        assert attempts(http, job_name) == [("n0", "1"), ("n1", "1"), ("n0", "2")]


def test_a_start_that_must_not_register_changes_nothing_and_says_why(service, job_name):
    with service.client() as http:
        declared = builders.declare(http, service.storage, job_name, ["n0"])
        assert http.post(f"/v1/jobs/{job_name}/nodes/n0/attempts", json={}).status_code == 201
        body = commit_body(service.storage, job_name, "n0", 0)
        assert http.post(f"/v1/jobs/{job_name}/nodes/n0/checkpoints", json=body).status_code == 201
        stale = started(http, job_name, "n0", declared["updated_at"] - 1, [])
        assert stale.status_code == 200 and stale.json()["attempt"] is None
        assert "declaration changed" in stale.json()["refused"]
        unrecorded = [
            {"epoch": 0, "attempt": "1"},
            {"epoch": 1, "attempt": "1"},
            {"epoch": 0, "attempt": "1", "tier": "local"},
        ]
        unknown = started(http, job_name, "n0", declared["updated_at"], unrecorded).json()
        assert unknown["attempt"] is None and "no record" in unknown["refused"]
        assert unknown["unknown"] == [
            {"epoch": 1, "batch": None, "attempt": "1", "tier": "durable"},
            {"epoch": 0, "batch": None, "attempt": "1", "tier": "local"},
        ]
        assert attempts(http, job_name) == [("n0", "1")], "nothing was registered"
        fenced_not = http.post(
            f"/v1/jobs/{job_name}/nodes/n0/checkpoints", json=commit_body(service.storage, job_name, "n0", 1)
        )
        assert fenced_not.status_code == 201, "attempt 1 still commits"
        assert started(http, "no-such-job", "n0", 0.0, []).status_code == 404
        stranger = started(http, job_name, "stranger", declared["updated_at"], [])
        assert stranger.status_code == 422 and "expected nodes" in stranger.text
        extra = http.post(f"/v1/jobs/{job_name}/nodes/n0/start", json={"declared_at": 1.0, "nodes": []})
        assert extra.status_code == 422, "an unknown field is refused"


def requests_to(http, route: str) -> int:
    """How many requests the service answered on `route` (its /metrics)."""
    text = http.get("/metrics").text
    found = re.findall(r'ckptstore_requests_total\{[^}]*route="%s"[^}]*\} ([0-9.e+]+)' % re.escape(route), text)
    return int(sum(float(n) for n in found))


def test_a_restart_takes_one_request_and_the_long_way_when_storage_holds_unrecorded_copies(service):
    job = f"start-{uuid.uuid4().hex[:6]}"
    url, storage = service.live.url, service.storage
    first = NodeCheckpointer(job=job, storage=storage, service=url, node="n0", async_save=False)
    assert first.start() is None
    first.save(Position(0), STATE)
    first.close()
    with service.client() as http:
        before = [
            requests_to(http, r) for r in ("/v1/jobs/{job}/nodes/{node}/start", "/v1/jobs/{job}/nodes/{node}/attempts")
        ]
        second = NodeCheckpointer(job=job, storage=storage, service=url, node="n0", async_save=False)
        restored = second.start()
        assert restored is not None and restored.copy.position == Position(0) and second.attempt == "2"
        after = [
            requests_to(http, r) for r in ("/v1/jobs/{job}/nodes/{node}/start", "/v1/jobs/{job}/nodes/{node}/attempts")
        ]
        assert [a - b for a, b in zip(after, before, strict=True)] == [1, 0], "registered by the one request"
        # A copy written while the service was away (attempt 2 saved epoch 1 on storage only):
        second.store.save(job, "n0", 1, STATE, attempt="2")
        second.close()
        third = NodeCheckpointer(job=job, storage=storage, service=url, node="n0", async_save=False)
        restored = third.start()
        assert restored is not None and restored.copy.position == Position(1), (
            "the unrecorded copy is recorded and resumed"
        )
        assert third.attempt == "3"
        third.close()
        final = [
            requests_to(http, r) for r in ("/v1/jobs/{job}/nodes/{node}/start", "/v1/jobs/{job}/nodes/{node}/attempts")
        ]
        assert [a - b for a, b in zip(final, after, strict=True)] == [1, 1], "declined, then the long way"
    with ServiceClient(url) as client:
        assert [(r.epoch, r.attempt) for r in client.list_checkpoints(job)] == [(0, "1"), (1, "2")]
