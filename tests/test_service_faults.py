"""Service faults: the service SIGKILLed and restarted again and again under a 3-node job, its
PostgreSQL crashed and restarted under one, and its database's filesystem filling up. Every
acknowledged commit survives; nothing is applied twice."""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable

import httpx
import numpy as np
import pytest

from ckptstore import Position
from ckptstore.client.engine.node import NodeCheckpointer
from ckptstore.client.service.operations import reindex
from ckptstore.client.service.rest import ServiceClient
from tests.live import PrivatePostgres, start_service_process
from tests.servers import free_port

NODES, OUTAGES = ["n0", "n1", "n2"], 3
OUTAGE_S = 3.0  # longer than the client's retries (≈ 2 s): commits must wait for the service


def train_3_nodes_through_outages(
    tmp_path, caplog, outage: Callable[[list, int], None], db_url: str | None = None
) -> None:
    """Three nodes save epoch after epoch while `outage([service process], port)` strikes OUTAGES
    times and a reader asks for the last good epoch; then every acknowledged commit is there exactly
    once, the last good epoch is right, and storage and the service agree."""
    port, root, job = free_port(), str(tmp_path / "storage"), f"outages-{uuid.uuid4().hex[:6]}"
    url = f"http://127.0.0.1:{port}"
    service = [start_service_process(tmp_path, port, db_url=db_url)]
    with ServiceClient(url) as client:
        client.put_job(job, NODES, storage_root=root)
    nodes = [NodeCheckpointer(job=job, storage=root, service=url, node=n, async_save=False) for n in NODES]
    for node in nodes:
        assert node.start() is None
    done = threading.Event()
    trained: dict[str, int] = {}
    answers: list[int] = []

    def train(node: NodeCheckpointer) -> None:
        epoch = 0
        while not done.is_set() or epoch < 5:  # keep saving through every outage
            node.save(Position(epoch), {"w": np.full(64, epoch, np.float32)})
            epoch += 1
            time.sleep(0.05)
        trained[node.node] = epoch

    def query() -> None:  # a reader asking throughout: answers are 200 or 503, never another 5xx
        with httpx.Client(base_url=url, timeout=5) as reader:
            while not done.is_set():
                for path in (f"/v1/jobs/{job}/last-good-epoch", "/readyz"):
                    try:
                        answers.append(reader.get(path).status_code)
                    except httpx.TransportError:
                        pass
                time.sleep(0.02)

    def strike() -> None:
        for _ in range(OUTAGES):
            time.sleep(0.8)
            outage(service, port)
        done.set()

    threads = [threading.Thread(target=strike), threading.Thread(target=query)] + [
        threading.Thread(target=train, args=(n,)) for n in nodes
    ]
    with caplog.at_level(logging.WARNING, logger="ckptstore.client"):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
    assert done.is_set() and len(trained) == len(NODES), "every outage struck and every node finished"
    assert any("will be re-posted" in r.message for r in caplog.records), "commits did wait for the service"
    assert 200 in answers and set(answers) <= {200, 503}, f"readers got {sorted(set(answers))}"
    try:
        for node in nodes:
            node.close()  # re-posts whatever the last outage left pending
        with ServiceClient(url) as client:
            records = client.list_checkpoints(job, limit=10_000)
            keys = [(r.node, r.epoch, r.attempt) for r in records]
            assert len(keys) == len(set(keys)) == sum(trained.values()), "every commit once, none twice"
            assert client.last_good_epoch(job).epoch == min(trained.values()) - 1
            (check,) = [r for r in reindex(client, root, check=True) if r.job == job]
            assert check.differences == 0, "storage and the service agree after the outages"
        assert all(node.skipped_saves == 0 for node in nodes), "the outages never cost a save"
    finally:
        service[0].kill()
        service[0].wait()


@pytest.mark.slow  # a long run: scripts/test.sh -m slow runs it (the default run stays near 30 minutes)
def test_service_killed_repeatedly_under_a_3_node_job_loses_no_commit(tmp_path, caplog):
    def kill_and_restart(service: list, port: int) -> None:
        service[0].send_signal(signal.SIGKILL)
        service[0].wait()
        time.sleep(OUTAGE_S)
        service[0] = start_service_process(tmp_path, port)

    train_3_nodes_through_outages(tmp_path, caplog, kill_and_restart)


@pytest.fixture
def private_postgres():
    try:
        cluster = PrivatePostgres()
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"no private PostgreSQL cluster here: {exc}")
    yield cluster
    cluster.destroy()


def test_postgres_crashed_and_restarted_under_a_3_node_job_loses_no_commit(tmp_path, caplog, private_postgres):
    """The service keeps running; its database crashes (immediate stop: WAL replay on start) 3 times."""

    def crash_and_restart(_service: list, _port: int) -> None:
        private_postgres.crash()
        time.sleep(OUTAGE_S)
        private_postgres.start()

    train_3_nodes_through_outages(tmp_path, caplog, crash_and_restart, db_url=private_postgres.url)


@pytest.fixture
def tiny_filesystem(tmp_path):
    """A 640 KiB tmpfs for the service's database (mount needs root; chmod does not bind root): room
    for the migrated database, folded into its file when migration closes its connections (~330 KiB
    with its write-ahead log), and for some commits."""
    mountpoint = tmp_path / "tiny"
    mountpoint.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=640k", "tmpfs", str(mountpoint)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {result.stderr.decode().strip()}")
    yield mountpoint
    subprocess.run(["umount", "-l", str(mountpoint)], check=False)


def test_a_full_database_filesystem_answers_503_and_keeps_every_acknowledged_commit(tmp_path, tiny_filesystem):
    port, root = free_port(), str(tmp_path / "storage")
    db_url = f"sqlite:///{tiny_filesystem}/ckptstore.db"
    service = start_service_process(tmp_path, port, db_url=db_url)
    acknowledged, statuses = [], []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            assert client.put("/v1/jobs/full", json={"nodes": ["n0"], "storage_root": root}).status_code == 201
            for epoch in range(3000):
                location = f"{root}/full/n0/{epoch:010d}/1"
                body = {"epoch": epoch, "attempt": 1, "location": location, "bytes": 1, "metrics": {"x" * 60: 1.0}}
                status = client.post("/v1/jobs/full/nodes/n0/checkpoints", json=body).status_code
                statuses.append(status)
                if status == 201:
                    acknowledged.append(epoch)
                elif statuses[-3:] == [503] * 3:
                    break
            assert 503 in statuses, "the filesystem filled up"
            assert set(statuses) <= {201, 503}, "full disk is 503 with Retry-After, never 500"
            assert acknowledged, "commits were acknowledged before it filled"
            recorded = [r["epoch"] for r in client.get("/v1/jobs/full/checkpoints", params={"limit": 10000}).json()]
            assert recorded == acknowledged, "every acknowledged commit is there, nothing else"
        service.send_signal(signal.SIGKILL)
        service.wait()
        service = start_service_process(tmp_path, port, db_url=db_url)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            recorded = [r["epoch"] for r in client.get("/v1/jobs/full/checkpoints", params={"limit": 10000}).json()]
            assert recorded == acknowledged, "after a kill -9 and restart on the full filesystem, still all there"
    finally:
        service.kill()
        service.wait()
