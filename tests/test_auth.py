"""Auth over real HTTP: every route of the app (enumerated, so a new one is covered) needs a token
but /healthz and /readyz; per-job tokens reach only their job; tokens are compared with
hmac.compare_digest; canary secrets reach no log, error body or metric."""

from __future__ import annotations

import logging
import re

import httpx
import pytest
from starlette.routing import Route

from ckptstore.server.app import create_app
from ckptstore.server.settings import Settings
from tests.live import LiveService

ADMIN = "admin-canary-7d41e2"
JOB_A, JOB_B = "jobalpha", "jobbeta"
TOKEN_A, TOKEN_B = "token-a-canary-91c3", "token-b-canary-08f7"
STORAGE_SECRET = "aws-secret-canary-55aa"
VALUES = {"job": JOB_A, "node": "n0", "name": "app.css", "attempt": "1"}


def settings(tmp, **extra) -> Settings:
    return Settings(
        db_url=f"sqlite:///{tmp}/auth.db",
        storage=f"{tmp}/storage",
        storage_roots=f"{tmp}/storage,s3://ckpt",
        token=ADMIN,
        job_tokens={JOB_A: TOKEN_A, JOB_B: TOKEN_B},
        **extra,
    )


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    service = LiveService(settings(tmp_path_factory.mktemp("auth")))
    with httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {ADMIN}"}) as admin:
        for job in (JOB_A, JOB_B):
            assert admin.put(f"/v1/jobs/{job}", json={"nodes": ["n0"]}).status_code == 201
    yield service
    service.stop()


def _flatten(routes, prefix: str = ""):
    """Routes, with included routers (newer FastAPI keeps them as objects) opened up."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from _flatten(included.routes, prefix + route.include_context.prefix)
            continue
        assert isinstance(route, Route), f"{route!r}: a mount would escape this enumeration"
        yield Route(prefix + route.path, endpoint=route.endpoint, methods=list(route.methods or ()))


def every_route(path_job: str = JOB_A) -> list[tuple[str, str]]:
    """(method, concrete path) for every route the app has, path parameters filled in."""
    found = []
    for route in _flatten(create_app(Settings(db_url="sqlite://")).routes):
        path = re.sub(r"\{(\w+)(:\w+)?\}", lambda m: (VALUES | {"job": path_job})[m.group(1)], route.path)
        found += [(method, path) for method in sorted(route.methods - {"HEAD"})]
    return found


def test_every_route_but_liveness_and_readiness_needs_the_token(live):
    routes = every_route()
    assert len(routes) > 20
    with httpx.Client(base_url=live.url) as anonymous:
        for method, path in routes:
            response = anonymous.request(method, path, json={})
            if path in ("/healthz", "/readyz"):
                assert response.status_code == 200, path
            else:
                assert response.status_code == 401, (method, path, response.status_code)
                assert JOB_B not in response.text and "n0" not in response.text, "no data without the token"


def test_a_job_token_reaches_its_own_job_and_gets_403_everywhere_else(live):
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {TOKEN_A}"}) as client:
        assert client.get(f"/v1/jobs/{JOB_A}/last-good-epoch").status_code == 200
        assert client.post(f"/v1/jobs/{JOB_A}/nodes/n0/attempts", json={}).status_code == 201
        for method, path in every_route(path_job=JOB_B):
            if path.startswith("/ui/") or path in ("/", "/healthz", "/readyz"):
                continue  # the dashboard takes the admin token's session only (checked below)
            if path == "/v1/events":  # the stream of its own job only: asking for another's is refused
                response = client.get(path, params={"job": JOB_B, "format": "json"})
                assert response.status_code == 403 and response.json()["error"] == "forbidden"
                continue
            response = client.request(method, path, json={})
            assert response.status_code == 403 and response.json()["error"] == "forbidden", (method, path)
        assert client.get("/v1/jobs/jobalpha/../jobbeta/last-good-epoch").status_code == 403
        raw = client.get(f"/v1/jobs/{JOB_A}/%2e%2e/{JOB_B}/last-good-epoch")
        assert raw.status_code in (403, 404, 422) and JOB_B not in raw.text.replace(f"/{JOB_B}/", "")
        assert client.get("/ui/").status_code == 401, "a job token opens no dashboard session"


def test_tokens_are_compared_with_hmac_compare_digest(live, monkeypatch):
    import ckptstore.server.http.auth as middleware

    calls = []
    real = middleware.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", spy)
    httpx.get(f"{live.url}/v1/jobs", headers={"Authorization": "Bearer guess-1234"})
    assert (b"guess-1234", ADMIN.encode()) in calls
    assert {(b"guess-1234", TOKEN_A.encode()), (b"guess-1234", TOKEN_B.encode())} <= set(calls), "every job token"


def test_canary_secrets_reach_no_log_error_body_or_metric(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIACANARY00000000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", STORAGE_SECRET)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens: the probe fails
    service = LiveService(settings(tmp_path))
    seen = []
    try:
        with caplog.at_level(logging.DEBUG):
            with httpx.Client(base_url=service.url, timeout=30) as anonymous:
                seen += [anonymous.get("/v1/jobs").text, anonymous.get("/metrics").text]
                seen.append(anonymous.get("/v1/jobs", headers={"Authorization": f"Bearer {ADMIN}x"}).text)
            with httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60) as admin:
                seen.append(admin.put("/v1/jobs/s3job", json={"nodes": ["n0"], "storage_root": "s3://ckpt/x"}).text)
                seen.append(admin.get("/v1/jobs/s3job/health", params={"probe": "true"}).text)
                seen.append(admin.get("/metrics").text)
            with httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {TOKEN_A}"}) as job_a:
                seen.append(job_a.get(f"/v1/jobs/{JOB_B}").text)
    finally:
        service.stop()
    assert '"cp_accessible":false' in seen[4].replace(" ", ""), "the probe ran against the canary credentials"
    text = "\n".join(seen) + "\n" + caplog.text
    for secret in (ADMIN, TOKEN_A, TOKEN_B, STORAGE_SECRET):
        assert secret not in text, secret
