"""Several service replicas over one PostgreSQL database, each its own process, and behind a real
nginx as a round-robin load balancer: attempts numbered uniquely, commits neither lost nor doubled
when a replica is SIGKILLed mid-run (the clients fail over), no 5xx from the survivors, migrations
run once, and every replica's cached last-good answer coherent with a commit through another."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal

import httpx
import pytest

from ckptstore.client import ServiceClient
from ckptstore.errors import ServiceUnavailableError
from tests.builders import commit_body
from tests.live import ScratchPostgres, postgres_available, start_service_process
from tests.servers import Nginx, free_port

NODES = [f"n{i}" for i in range(6)]
EPOCHS = 12
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def post_commit(client: ServiceClient, job: str, node: str, body: dict) -> None:
    """A commit record through the client's failover (retries go to the next replica)."""
    client._request(
        "POST",
        f"/v1/jobs/{job}/nodes/{node}/checkpoints",
        content=json.dumps(body),
        headers={"content-type": "application/json"},
    )


@pytest.fixture
def database():
    if not postgres_available():
        pytest.fail("PostgreSQL is not reachable on 127.0.0.1:5432 and could not be started")
    scratch = ScratchPostgres()
    yield scratch.url
    scratch.drop()


@pytest.fixture
def replicas(tmp_path, database):
    """Three `python -m ckptstore.server` processes on one database, started together (migrations race)."""
    ports = [free_port() for _ in range(3)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        processes = list(pool.map(lambda p: start_service_process(tmp_path, p, db_url=database), ports))
    yield [f"http://127.0.0.1:{p}" for p in ports], processes
    for process in processes:
        process.kill()
        process.wait()


def test_three_replicas_survive_one_killed_mid_run_with_nothing_lost_or_doubled(replicas, tmp_path):
    urls, processes = replicas
    root = f"{tmp_path}/storage"
    server_errors: list[str] = []

    def client_for(i: int) -> ServiceClient:
        ordered = urls[i % 3 :] + urls[: i % 3]  # committers spread over the replicas
        client = ServiceClient(ordered, retries=6, backoff=0.05)

        def watch(response: httpx.Response) -> None:
            if response.status_code >= 500:
                server_errors.append(f"{response.request.url} {response.status_code}")

        client._http.event_hooks["response"].append(watch)
        return client

    with client_for(0) as client:
        client.put_job("big", NODES, storage_root=root)

    def committer(i: int) -> list[str]:
        node = NODES[i]
        with client_for(i) as client:
            attempt = client.start_attempt("big", node)
            for epoch in range(EPOCHS):
                post_commit(client, "big", node, commit_body(root, "big", node, epoch, attempt=attempt))
                if i == 0 and epoch == EPOCHS // 3:
                    processes[0].send_signal(signal.SIGKILL)  # mid-run: the first replica dies
        return [attempt]

    with concurrent.futures.ThreadPoolExecutor(len(NODES)) as pool:
        attempts = [a for found in pool.map(committer, range(len(NODES))) for a in found]
    processes[0].wait()
    assert attempts == ["1"] * len(NODES), "one attempt per node, numbered once across replicas"
    assert not server_errors, server_errors
    for url in urls[1:]:
        with ServiceClient(url) as client:
            records = client.list_checkpoints("big", limit=10_000)
            keys = [(r.node, r.epoch, r.attempt) for r in records]
            assert len(keys) == len(set(keys)) == len(NODES) * EPOCHS, "every commit exactly once"
            assert client.last_good_epoch("big").epoch == EPOCHS - 1


def test_a_commit_through_one_replica_is_in_the_next_answer_of_another(replicas, tmp_path):
    urls, _ = replicas
    root = f"{tmp_path}/storage"
    with ServiceClient(urls[0]) as a, ServiceClient(urls[1]) as b, ServiceClient(urls[2]) as c:
        a.put_job("coherent", ["n0"], storage_root=root)
        assert b.last_good_epoch("coherent").epoch is None  # cached on b now
        for epoch in range(30):
            writer, reader = (a, b) if epoch % 2 else (c, a)
            post_commit(writer, "coherent", "n0", commit_body(root, "coherent", "n0", epoch))
            assert reader.last_good_epoch("coherent").epoch == epoch, f"{reader.url} served a stale answer"


def test_migrations_ran_once(replicas, database):
    from sqlalchemy import create_engine, text

    engine = create_engine(database)
    with engine.connect() as connection:
        revisions = connection.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
    engine.dispose()
    assert len(revisions) == 1


@pytest.fixture
def nginx(tmp_path, replicas):
    """Debian's nginx as a round-robin proxy in front of the three replicas."""
    urls, _ = replicas
    try:
        proxy = Nginx(str(tmp_path / "nginx"), [u.removeprefix("http://") for u in urls])
    except RuntimeError as exc:
        pytest.fail(str(exc))
    yield proxy.url
    proxy.stop()


def test_replicas_behind_nginx_round_robin(nginx, replicas, tmp_path):
    root = f"{tmp_path}/storage"
    with ServiceClient(nginx) as client:
        client.put_job("lb", ["n0"], storage_root=root)
        assert [client.start_attempt("lb", "n0") for _ in range(6)] == [str(n) for n in range(1, 7)]
        for epoch in range(9):
            post_commit(client, "lb", "n0", commit_body(root, "lb", "n0", epoch, attempt=6))
            assert client.last_good_epoch("lb").epoch == epoch, "round robin: every answer coherent"
    _, processes = replicas
    processes[1].send_signal(signal.SIGKILL)
    processes[1].wait()
    with httpx.Client(base_url=nginx) as http:
        statuses = {http.get("/v1/jobs/lb/last-good-epoch").status_code for _ in range(12)}
    assert statuses == {200}, f"nginx passes over the dead replica: {statuses}"
    with pytest.raises(ServiceUnavailableError):
        ServiceClient("http://127.0.0.1:9", retries=1).list_jobs()
