"""Regression tests for what an attacker and a careless user found (issue 14): each failed before
its fix. Real processes and loopback only: the service as users start it, symbolic links and a
case-folding collision on a real directory tree."""

from __future__ import annotations

import json
import math
import os
import sqlite3
import subprocess
import sys
import time
import uuid

import httpx
import numpy as np
import pytest

from ckptstore import Position, Store
from ckptstore.client import ServiceClient
from ckptstore.client.engine.node import NodeCheckpointer
from ckptstore.client.service.operations import apply_retention, reindex
from ckptstore.errors import InvalidNameError
from ckptstore.format.manifest import ManifestError, parse_manifest
from ckptstore.server.settings import Settings, root_is_allowed
from tests.builders import commit_body, declare
from tests.conftest import service_settings
from tests.live import LiveService, start_service_process
from tests.servers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADMIN = "admin-token-4f0e91c2d7"
JOB_TOKEN = "alpha-token-58d2b7e03c"


@pytest.fixture(scope="module")
def with_job_tokens(tmp_path_factory):
    """A service with per-job tokens only (no admin token): the case the dashboard left open."""
    tmp = str(tmp_path_factory.mktemp("job-tokens"))
    live = LiveService(service_settings(tmp, f"sqlite:///{tmp}/db", job_tokens={"alpha": JOB_TOKEN, "beta": ADMIN}))
    for job, token in (("alpha", JOB_TOKEN), ("beta", ADMIN)):
        with live.client(headers={"Authorization": f"Bearer {token}"}) as client:
            declare(client, live.settings.default_storage, job, ["n0"])
    yield live
    live.stop()


def sign_in(live: LiveService, token: str) -> httpx.Client:
    client = live.client(follow_redirects=False)
    response = client.post("/ui/login", data={"token": token}, headers={"Origin": live.url})
    assert response.status_code == 303, response.text
    return client


# -- dashboard with job tokens only (high) -------------------------------------------------------


def test_job_tokens_alone_close_the_dashboard_and_a_job_session_sees_only_its_job(with_job_tokens):
    live = with_job_tokens
    with live.client() as anonymous:
        for path in ("/ui/", "/ui/jobs/alpha", "/ui/jobs/beta", "/ui/static/app.css"):
            response = anonymous.get(path)
            assert response.status_code == 401 and "alpha" not in response.text and "beta" not in response.text, path
    alpha = sign_in(live, JOB_TOKEN)
    jobs = alpha.get("/ui/")
    assert jobs.status_code == 200 and 'data-job="alpha"' in jobs.text and "beta" not in jobs.text
    assert alpha.get("/ui/jobs/alpha").status_code == 200
    other = alpha.get("/ui/jobs/beta")
    assert other.status_code == 403 and "n0" not in other.text
    assert alpha.get("/ui/jobs/no-such-job").status_code == 403, "same answer whether the job exists or not"
    alpha.close()


def test_sessions_expire_end_at_sign_out_and_carry_the_security_headers(tmp_path):
    live = LiveService(service_settings(str(tmp_path), f"sqlite:///{tmp_path}/db", token=ADMIN, session_seconds=2))
    try:
        client = sign_in(live, ADMIN)
        cookie = client.cookies.get("ckptstore_session")
        assert cookie and ADMIN not in cookie
        page = client.get("/ui/")
        assert page.status_code == 200
        csp = page.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert page.headers["x-frame-options"] == "DENY" and page.headers["x-content-type-options"] == "nosniff"
        stolen = httpx.Client(base_url=live.url, cookies={"ckptstore_session": cookie})
        assert stolen.get("/ui/").status_code == 200
        assert client.post("/ui/logout", headers={"Origin": live.url}).status_code == 303
        assert stolen.get("/ui/").status_code == 401, "a copy of the cookie dies with the sign-out"
        again = sign_in(live, ADMIN)
        deadline = time.monotonic() + 10
        while again.get("/ui/").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert again.get("/ui/").status_code == 401, "the session expired"
        secure = httpx.post(f"{live.url}/ui/login", data={"token": ADMIN}, headers={"X-Forwarded-Proto": "https"})
        assert secure.status_code == 303
    finally:
        live.stop()


def test_a_short_admin_token_is_refused(tmp_path):
    with pytest.raises(ValueError, match="shorter than 16"):
        Settings(db_url="sqlite://", token="x")
    env = os.environ | {"CKPTSTORE_TOKEN": "x", "CKPTSTORE_DB_URL": f"sqlite:///{tmp_path}/db"}
    result = subprocess.run(
        [sys.executable, "-m", "ckptstore.server"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "shorter than 16" in result.stderr


# -- cross-site requests and DNS rebinding (medium) ----------------------------------------------


def test_simple_cross_site_requests_and_rebound_hosts_change_nothing(tmp_path):
    port = free_port()
    service = start_service_process(tmp_path, port)  # no token, bound to loopback: the default
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url) as client:
            declare(client, f"{tmp_path}/storage", "victim", ["n0"])
            path = "/v1/jobs/victim/nodes/n0/attempts"
            assert client.post(path, content=b"", headers={"Content-Type": "text/plain"}).status_code == 422
            assert client.post(path).status_code == 422, "a body-less POST is a 'simple' request too"
            cross = client.post(path, json={}, headers={"Origin": "http://evil.example"})
            assert cross.status_code == 403 and cross.json()["error"] == "forbidden"
            rebound = client.post(path, json={}, headers={"Host": "evil.example"})
            assert rebound.status_code == 400, "a DNS name rebound to 127.0.0.1 reaches nothing"
            assert client.get("/v1/jobs", headers={"Host": "evil.example"}).status_code == 400
            assert client.get("/v1/jobs/victim/attempts").json() == [], "no attempt was registered: nobody fenced"
            assert client.post(path, json={}, headers={"Origin": url}).status_code == 201, "same origin is fine"
            assert client.get("/healthz", headers={"Host": "localhost"}).status_code == 200
    finally:
        service.kill()
        service.wait()


# -- retention deletes outside its job (medium) --------------------------------------------------


def arrays(seed: int) -> dict[str, np.ndarray]:
    return {"w": np.full(64, seed, np.float32)}


def test_gc_never_follows_a_symbolic_link_out_of_the_root_nor_deletes_a_foreign_manifest(tmp_path, sqlite_service):
    url, root = sqlite_service.live.url, f"{sqlite_service.storage}/{uuid.uuid4().hex[:8]}"
    other_team = Store(str(tmp_path / "other-team"))
    other_team.save("theirs", "n0", 0, arrays(7), attempt="1")
    ours = Store(root)
    job = "gcjob"
    with ServiceClient(url) as client:
        client.put_job(job, ["n0", "n1"], storage_root=root, retention={"grace_seconds": 0})
    ours.save(job, "n0", 0, arrays(1), attempt="1")
    # n1's folder is a link into another team's tree; a planted attempt folder holds a copied manifest.
    os.symlink(str(tmp_path / "other-team" / "theirs" / "n0"), f"{root}/{job}/n1")
    planted = f"{root}/{job}/n0/0000000003/1"
    os.makedirs(planted)
    src = f"{tmp_path}/other-team/theirs/n0/0000000000/1"
    for name in os.listdir(src):
        os.link(f"{src}/{name}", f"{planted}/{name}") if name == "MANIFEST.json" else None
    with ServiceClient(url) as client:
        deleted = apply_retention(client, job)
    assert all("other-team" not in d.location for d in deleted) and all(d.epoch != 3 for d in deleted), deleted
    assert ours.collect_blobs(job, "n1", grace_seconds=0) == [], "blobs behind the link are not collected"
    assert other_team.list_positions("theirs", "n0") == [Position(0)], "the other team's checkpoint is intact"
    assert os.path.exists(f"{planted}/MANIFEST.json"), "a prefix whose manifest names someone else stays"
    with pytest.raises(InvalidNameError, match="leads outside"):
        ours.delete(job, "n1", 0, attempt="1")
    with pytest.raises(InvalidNameError, match="belongs to another checkpoint"):
        ours.delete(job, "n0", 3, attempt="1")
    assert other_team.load("theirs", "n0", 0)["w"][0] == 7


# -- names that differ only by case (medium) -----------------------------------------------------


def test_names_that_differ_only_by_case_are_refused(tmp_path, sqlite_service):
    store = Store(str(tmp_path / "root"))
    store.save("mnist", "worker-0", 0, arrays(1), attempt="1")
    with pytest.raises(InvalidNameError, match="only by case"):
        store.save("MNIST", "worker-0", 0, arrays(2), attempt="1")
    with pytest.raises(InvalidNameError, match="only by case"):
        store.save("mnist", "Worker-0", 0, arrays(2), attempt="1")
    assert store.load("mnist", "worker-0", 0)["w"][0] == 1
    with sqlite_service.client() as client:
        name = f"Case-{uuid.uuid4().hex[:6]}"
        declare(client, sqlite_service.storage, name.lower(), ["n0"])
        twin = client.put(f"/v1/jobs/{name}", json={"nodes": ["n0"], "storage_root": sqlite_service.storage})
        assert twin.status_code == 409 and "only by case" in twin.json()["detail"]
        nodes = client.put(f"/v1/jobs/{name.lower()}", json={"nodes": ["worker-0", "Worker-0"]})
        assert nodes.status_code == 422 and "ignoring case" in nodes.json()["detail"]


# -- attempt counters (medium) -------------------------------------------------------------------


def test_attempts_the_counter_could_not_follow_are_refused(sqlite_service, job_name):
    with sqlite_service.client() as client:
        declare(client, sqlite_service.storage, job_name, ["n0"])
        body = commit_body(sqlite_service.storage, job_name, "n0", 0, attempt="9999999999")
        huge = client.post(f"/v1/jobs/{job_name}/nodes/n0/checkpoints", json=body)
        assert huge.status_code == 422 and "accepted below" in huge.json()["detail"]
        body = commit_body(sqlite_service.storage, job_name, "n0", 0) | {"attempt": True}
        assert client.post(f"/v1/jobs/{job_name}/nodes/n0/checkpoints", json=body).status_code == 422
        assert client.post(f"/v1/jobs/{job_name}/nodes/n0/attempts", json={}).json()["attempt"] == "1"


def test_reindex_raises_a_counter_in_one_request_and_refuses_a_planted_huge_attempt(tmp_path, sqlite_service):
    root = f"{sqlite_service.storage}/{uuid.uuid4().hex[:8]}"
    store = Store(root)
    store.save("rjob", "n0", 0, arrays(1), attempt="300")
    os.makedirs(f"{root}/rjob/n0/0000000001/9999999999")
    with open(f"{root}/rjob/n0/0000000001/9999999999/tensors-00000.safetensors", "wb") as handle:
        handle.write(b"planted")
    with ServiceClient(sqlite_service.live.url) as client:
        requests = []
        client._http.event_hooks["request"].append(requests.append)
        (result,) = reindex(client, root)
        attempts = [r for r in requests if r.url.path.endswith("/attempts") and r.method == "POST"]
        assert len(attempts) <= 1, f"{len(attempts)} attempt registrations"
        assert result.refused == [f"{root}/rjob/n0/0000000001/9999999999"]
        assert client.start_attempt("rjob", "n0") == "301", "the counter went on from storage's highest"
    node = NodeCheckpointer(job="rjob2", storage=root, node="n0", async_save=False)
    store.save("rjob2", "n0", 0, arrays(1), attempt="9999999999")
    node.start()
    assert int(node.attempt.split("-")[0]) < 10**9, "offline numbering ignores a planted huge id"


# -- non-finite metrics (medium) -----------------------------------------------------------------


def test_non_finite_metrics_are_refused_by_the_service_and_left_out_by_the_client(tmp_path, sqlite_service, caplog):
    url, root = sqlite_service.live.url, f"{sqlite_service.storage}/{uuid.uuid4().hex[:8]}"
    with sqlite_service.client() as client:
        declare(client, root, "nan-job", ["n0"])
        body = commit_body(root, "nan-job", "n0", 0) | {"metrics": {"loss": "NaN"}}
        raw = json.dumps(body).replace('"NaN"', "NaN")
        response = client.post(
            "/v1/jobs/nan-job/nodes/n0/checkpoints", content=raw, headers={"content-type": "application/json"}
        )
        assert response.status_code == 422, response.text
        for field, value in (("latency_ms", "Infinity"),):
            text = '{"cp_accessible": true, "%s": %s}' % (field, value)
            response = client.put(
                "/v1/jobs/nan-job/nodes/n0/health", content=text, headers={"content-type": "application/json"}
            )
            assert response.status_code == 422
    node = NodeCheckpointer(job="nan-job", storage=root, service=url, node="n0", async_save=False)
    node.start()
    node.save(Position(0), arrays(1), metrics={"loss": math.nan, "accuracy": 0.5})
    assert node.skipped_saves == 0 and "metric 'loss' is nan: not recorded" in caplog.text
    with ServiceClient(url) as client:
        (record,) = client.list_checkpoints("nan-job")
        assert record.metrics == {"accuracy": 0.5}
    code = subprocess.run(
        [sys.executable, "-m", "ckptstore.client.cli.main", "epochs", "nan-job", "--url", url],
        capture_output=True,
        text=True,
    )
    assert code.returncode == 0, code.stderr


# -- the rest (low) ------------------------------------------------------------------------------


def test_a_manifest_of_deeply_nested_brackets_is_not_committed(tmp_path):
    with pytest.raises(ManifestError, match="nests too deeply"):
        parse_manifest(b"[" * 100_000 + b"]" * 100_000)
    store = Store(str(tmp_path / "root"))
    store.save("job", "n0", 0, arrays(1), attempt="1")
    path = f"{store.url}/job/n0/0000000000/1/MANIFEST.json"
    with open(path, "wb") as handle:
        handle.write(b"[" * 100_000 + b"]" * 100_000)
    assert store.list_positions("job", "n0") == []
    assert not store.verify("job", "n0", 0).committed
    result = subprocess.run(
        [sys.executable, "-m", "ckptstore.client.cli.main", "inspect", f"{store.url}/job/n0/0000000000/1"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 3 and "Traceback" not in result.stderr, result.stderr


def test_a_double_encoded_name_is_never_answered_as_another_jobs_cached_answer(sqlite_service):
    with sqlite_service.client() as client:
        declare(client, sqlite_service.storage, "A", ["n0"])
        assert client.get("/v1/jobs/A/last-good-epoch").status_code == 200  # now cached
        double = client.get("/v1/jobs/%2541/last-good-epoch")  # decodes once to "%41", never to "A"
        assert double.status_code in (404, 422) and '"job":"A"' not in double.text


@pytest.mark.parametrize(
    ("root", "allowed"),
    [("ckpt/x", False), ("s3://b//jobs", False), ("s3://b/jobs/x", True), ("/srv/ckpt/x", True)],
)
def test_relative_roots_and_empty_segments_are_not_under_an_allowed_root(root, allowed):
    assert root_is_allowed(root, ["s3://b/jobs", "/srv/ckpt", "ckpt"]) is allowed


def test_reports_for_undeclared_nodes_are_refused_and_redeclaring_adds_no_rows(sqlite_service, job_name):
    with sqlite_service.client() as client:
        declare(client, sqlite_service.storage, job_name, ["n0"])
        health = client.put(f"/v1/jobs/{job_name}/nodes/ghost/health", json={"cp_accessible": False})
        assert health.status_code == 422
        stats = client.post(f"/v1/jobs/{job_name}/stats", json={"node": "ghost", "action": "save", "seconds": 1})
        assert stats.status_code == 422
        assert [h["node"] for h in client.get(f"/v1/jobs/{job_name}/health").json()["nodes"]] == ["n0"]
        for nodes in (["n0", "n1"], ["n0"], ["n0", "n1"], ["n0"]) * 5:
            declare(client, sqlite_service.storage, job_name, nodes)
    database = sqlite_service.live.settings.database_url.removeprefix("sqlite:///")
    with sqlite3.connect(database) as connection:
        (count,) = connection.execute(
            "SELECT count(*) FROM node_sets JOIN jobs ON jobs.id = node_sets.job_id WHERE jobs.name = ?", (job_name,)
        ).fetchone()
    assert count == 2, "one row per distinct node set"


def test_the_cli_says_invalid_in_one_line(sqlite_service):
    for argv in (
        ["jobs", "--url", "http://[::1"],
        ["last-good", "bad/name", "--url", sqlite_service.live.url],
        ["last-good", "job?x=1", "--url", sqlite_service.live.url],
        ["epochs", "job#frag", "--url", sqlite_service.live.url],
        ["jobs", "--url", "127.0.0.1:8080"],
    ):
        result = subprocess.run(
            [sys.executable, "-m", "ckptstore.client.cli.main", *argv], capture_output=True, text=True
        )
        assert result.returncode == 2, (argv, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr


def test_serve_on_a_corrupted_or_newer_database_says_what_to_do_in_one_line(tmp_path):
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"this is not an SQLite file at all" * 100)
    newer = tmp_path / "newer.db"
    with sqlite3.connect(newer) as connection:
        connection.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)")
        connection.execute("INSERT INTO alembic_version VALUES ('9999')")
    for path, words in ((corrupt, "restore it from a backup"), (newer, "newer than this ckptstore")):
        env = os.environ | {"CKPTSTORE_DB_URL": f"sqlite:///{path}", "CKPTSTORE_PORT": str(free_port())}
        result = subprocess.run(
            [sys.executable, "-m", "ckptstore.server"], env=env, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 1, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and words in result.stderr, result.stderr
