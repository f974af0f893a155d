"""Bad input, auth and durability of the service: the right 4xx, nothing changed, nothing lost."""

from __future__ import annotations

import json
import logging
import signal
import socket

import httpx
import pytest

from ckptstore.server.settings import Settings, root_is_allowed
from tests.builders import commit_body
from tests.live import LiveService, start_service_process
from tests.servers import free_port
from tests.test_service import declare

TRAVERSAL = ["..", "%2e%2e", "%252e%252e", "a..b", ".hidden", "a%5Cb", "a%00b", "a%23b", "x" * 129, "-x", "a%20b"]


@pytest.mark.parametrize("bad", TRAVERSAL)
def test_bad_job_and_node_names_are_refused(service, job_name, bad):
    with service.client() as client:
        declare(client, service, job_name, nodes=["n0"])
        for method, path, body in [
            ("PUT", f"/v1/jobs/{bad}", {"nodes": ["n0"]}),
            ("GET", f"/v1/jobs/{bad}/last-good-epoch", None),
            ("POST", f"/v1/jobs/{job_name}/nodes/{bad}/attempts", {}),
            ("POST", f"/v1/jobs/{job_name}/nodes/{bad}/checkpoints", commit_body(service.storage, job_name, "n0", 0)),
            ("PUT", f"/v1/jobs/{job_name}/nodes/{bad}/health", {"cp_accessible": True}),
        ]:
            response = client.request(method, path, json=body)
            assert 400 <= response.status_code < 500, (method, path, response.status_code)
            assert set(response.json()) == {"error", "detail"}
        assert client.get(f"/v1/jobs/{job_name}/checkpoints").json() == []
        assert client.get(f"/v1/jobs/{job_name}/attempts").json() == []
        assert not any(j["job"] in ("..", "a..b") for j in client.get("/v1/jobs", params={"limit": 1000}).json())


@pytest.mark.parametrize("nodes", [["..", "n0"], ["n0", "n0"], [], ["a/b"], ["%2e%2e"]])
def test_bad_node_sets_are_refused(service, job_name, nodes):
    with service.client() as client:
        response = client.put(f"/v1/jobs/{job_name}", json={"nodes": nodes, "storage_root": service.storage})
        assert response.status_code == 422 and response.json()["error"] == "invalid"
        assert client.get(f"/v1/jobs/{job_name}").status_code == 404


@pytest.mark.parametrize(
    "change",
    [
        {"epoch": -1},
        {"epoch": 10**10},
        {"epoch": 10**30},
        {"batch": -3},
        {"batch": 10**10},
        {"epoch": True},
        {"epoch": "1"},
        {"epoch": 1.5},
        {"attempt": 0},
        {"attempt": "../1"},
        {"bytes": -1},
        {"unknown": 1},
        {"location": ""},
    ],
    ids=repr,
)
def test_bad_commit_bodies_are_refused_and_change_nothing(service, job_name, change):
    with service.client() as client:
        declare(client, service, job_name, nodes=["n0"])
        body = commit_body(service.storage, job_name, "n0", 0) | change
        response = client.post(f"/v1/jobs/{job_name}/nodes/n0/checkpoints", json=body)
        assert response.status_code == 422, response.text
        assert response.json()["error"] == "invalid"
        assert client.get(f"/v1/jobs/{job_name}/checkpoints").json() == []


def test_malformed_and_oversized_bodies(service, job_name):
    with service.client() as client:
        declare(client, service, job_name, nodes=["n0"])
        path = f"/v1/jobs/{job_name}/nodes/n0/checkpoints"
        garbage = client.post(path, content=b"{not json", headers={"content-type": "application/json"})
        assert garbage.status_code == 422 and garbage.json()["error"] == "invalid"
        deep = client.post(path, content=b"[" * 5000 + b"]" * 5000, headers={"content-type": "application/json"})
        assert deep.status_code in (400, 422) and deep.json()["error"] == "invalid"
        huge = commit_body(service.storage, job_name, "n0", 0) | {
            "checksums": {f"f{i}": "x" * 60 for i in range(20_000)}
        }
        too_large = client.post(path, content=json.dumps(huge), headers={"content-type": "application/json"})
        assert too_large.status_code == 413 and too_large.json()["error"] == "too_large"

        def chunks():
            yield json.dumps(huge).encode()

        streamed = client.post(path, content=chunks(), headers={"content-type": "application/json"})
        assert streamed.status_code == 413
        ten_mb_name = client.put(f"/v1/jobs/{job_name}-2", json={"nodes": ["x" * 10_000_000]})
        assert ten_mb_name.status_code == 413 and ten_mb_name.json()["error"] == "too_large"
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "application/xml"):
            body = json.dumps(commit_body(service.storage, job_name, "n0", 0))
            wrong = client.post(path, content=body, headers={"content-type": content_type})
            assert wrong.status_code == 422 and wrong.json()["error"] == "invalid", content_type
        assert client.get(f"/v1/jobs/{job_name}/checkpoints").json() == []


@pytest.mark.parametrize(
    ("root", "allowed"),
    [
        ("s3://ckpt-evil", False),
        ("s3://ckpt-evil/x", False),
        ("s3://ckpt/runs", True),
        ("s3://ckpt", True),
        ("s3://ckpt/../other", False),
        ("gs://ckpt/runs", False),
        ("file:///etc", False),
        ("/etc", False),
        ("s3://ckpt/%2e%2e/x", False),
        ("S3://ckpt/a", True),
    ],
)
def test_storage_roots_must_lie_under_an_allowed_root(service, job_name, root, allowed):
    with service.client() as client:
        response = client.put(f"/v1/jobs/{job_name}", json={"nodes": ["n0"], "storage_root": root})
        assert response.status_code == (201 if allowed else 403), response.text
        if not allowed:
            assert response.json()["error"] == "forbidden"
            assert client.get(f"/v1/jobs/{job_name}").status_code == 404


def test_root_matching_is_by_whole_segments():
    assert root_is_allowed("/data/ckpt/run", ["/data/ckpt"]) and not root_is_allowed("/data/ckpt2", ["/data/ckpt"])
    assert root_is_allowed("file:///data/ckpt/x", ["/data/ckpt"])


def test_unknown_routes_and_methods_answer_json_errors(service):
    with service.client() as client:
        for response, status in [(client.get("/nope"), 404), (client.delete("/healthz"), 405)]:
            assert response.status_code == status and set(response.json()) == {"error", "detail"}


@pytest.fixture(scope="module")
def token_service(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("auth"))
    live = LiveService(
        Settings(db_url=f"sqlite:///{tmp}/db.sqlite", storage=f"{tmp}/storage", token="s3cret-canary-0042")
    )
    yield live
    live.stop()


def test_with_a_token_every_route_but_liveness_and_readiness_needs_it(token_service, caplog):
    caplog.set_level(logging.DEBUG)
    with token_service.client() as anonymous:
        assert anonymous.get("/healthz").status_code == 200 and anonymous.get("/readyz").status_code == 200
        for path in ("/v1/jobs", "/metrics", "/docs", "/openapi.json", "/v1/jobs/x/last-good-epoch"):
            response = anonymous.get(path)
            assert response.status_code == 401 and response.json()["error"] == "unauthorized", path
            assert "s3cret" not in response.text
        wrong = anonymous.get("/v1/jobs", headers={"Authorization": "Bearer s3cret-canarx"})
        assert wrong.status_code == 401
    with token_service.client(headers={"Authorization": "Bearer s3cret-canary-0042"}) as client:
        assert client.put("/v1/jobs/authjob", json={"nodes": ["n0"]}).status_code == 201
        assert client.get("/v1/jobs").status_code == 200
        assert "s3cret" not in client.get("/metrics").text
    assert "/v1/jobs" in caplog.text, "requests are logged"
    assert "s3cret" not in caplog.text, "the token never reaches a log"


def test_sqlite_pragmas_hold_on_every_pooled_connection(tmp_path):
    from ckptstore.server.db.engine import Database, make_engine

    database = Database(make_engine(f"sqlite:///{tmp_path}/p.db"))
    connections = [database.engine.connect() for _ in range(4)]
    try:
        for connection in connections:
            read = {
                name: connection.exec_driver_sql(f"PRAGMA {name}").scalar()
                for name in ("journal_mode", "synchronous", "busy_timeout", "foreign_keys")
            }
            assert read == {"journal_mode": "wal", "synchronous": 2, "busy_timeout": 30000, "foreign_keys": 1}
    finally:
        for connection in connections:
            connection.close()
        database.dispose()


def raw_exchange(port: int, request: bytes) -> bytes:
    """Send `request` as is on a new connection; return the whole answer (the server closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        try:
            sock.sendall(request)
        except OSError:  # the server answered and closed before reading everything: fine
            pass
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


def test_a_10_mb_url_or_header_gets_431_and_is_not_buffered(tmp_path):
    """`python -m ckptstore.server` as shipped (uvicorn + httptools bounds neither the URL nor the headers)."""
    port = free_port()
    process = start_service_process(tmp_path, port)
    try:
        ten_mb = b"x" * 10_000_000
        for request in (
            b"GET /v1/jobs/" + ten_mb + b"/last-good-epoch HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
            b"GET /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + ten_mb + b"\r\n\r\n",
        ):
            head, _, body = raw_exchange(port, request).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 431 "), head[:100]
            assert json.loads(body)["error"] == "too_large"
        normal = b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"y" * 100_000
        assert raw_exchange(port, normal + b"\r\nConnection: close\r\n\r\n").startswith(b"HTTP/1.1 200 ")
    finally:
        process.kill()
        process.wait()


def test_a_commit_acknowledged_with_201_survives_kill_9(tmp_path):
    port = free_port()
    process = start_service_process(tmp_path, port)
    storage = f"{tmp_path}/storage"
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            assert client.put("/v1/jobs/durable", json={"nodes": ["n0"]}).status_code == 201
            body = commit_body(storage, "durable", "n0", 0)
            assert client.post("/v1/jobs/durable/nodes/n0/checkpoints", json=body).status_code == 201
            process.send_signal(signal.SIGKILL)
            process.wait()
        process = start_service_process(tmp_path, port)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            assert client.get("/v1/jobs/durable/last-good-epoch").json()["epoch"] == 0
    finally:
        process.kill()
        process.wait()


def test_cached_last_good_answers_stay_current_across_workers(tmp_path):
    """Two worker processes, a new connection per request: every answer reflects the latest commit."""
    port = free_port()
    process = start_service_process(tmp_path, port, workers=2)
    storage = f"{tmp_path}/storage"
    try:
        assert httpx.put(f"http://127.0.0.1:{port}/v1/jobs/cached", json={"nodes": ["n0"]}).status_code == 201
        for epoch in range(25):
            body = commit_body(storage, "cached", "n0", epoch)
            assert (
                httpx.post(f"http://127.0.0.1:{port}/v1/jobs/cached/nodes/n0/checkpoints", json=body).status_code == 201
            )
            for _ in range(3):
                answer = httpx.get(f"http://127.0.0.1:{port}/v1/jobs/cached/last-good-epoch").json()
                assert answer["epoch"] == epoch
    finally:
        process.terminate()  # not SIGKILL: the supervisor then stops its workers (killed, they outlived the test)
        process.wait(timeout=30)


def test_head_revision_constant_matches_the_migration_scripts():
    from alembic.script import ScriptDirectory

    from ckptstore.server.db.migrate import HEAD_REVISION, alembic_config

    assert ScriptDirectory.from_config(alembic_config()).get_current_head() == HEAD_REVISION


@pytest.mark.parametrize("db", ["sqlite", "postgres"])
def test_the_migrated_schema_is_the_models_schema(tmp_path, db):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from ckptstore.server.db.engine import make_engine
    from ckptstore.server.db.migrate import migrate
    from ckptstore.server.db.models import Base
    from tests.live import ScratchPostgres

    scratch = ScratchPostgres() if db == "postgres" else None
    url = scratch.url if scratch else f"sqlite:///{tmp_path}/schema.db"
    engine = make_engine(url)
    try:
        migrate(url, engine=engine)
        with engine.connect() as connection:
            differences = compare_metadata(MigrationContext.configure(connection), Base.metadata)
        assert differences == [], "a model changed without a migration (or a migration without the model)"
    finally:
        engine.dispose()
        if scratch:
            scratch.drop()
