"""The training-side client without TensorFlow: identity, ServiceClient errors, failure behaviour."""

from __future__ import annotations

import json
import logging
import uuid

import numpy as np
import pytest

from ckptstore import Position, Store
from ckptstore.client import ServiceClient
from ckptstore.client.engine.identity import resolve_identity
from ckptstore.client.engine.node import NodeCheckpointer
from ckptstore.errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    FencedError,
    RequestRejectedError,
    ServiceUnavailableError,
)
from ckptstore.server.settings import Settings
from tests.live import LiveService
from tests.servers import MotoS3, free_port

STATE = {"w": np.arange(1000, dtype=np.float32), "b": np.ones(10, dtype=np.float32)}


@pytest.mark.parametrize(
    ("env", "node", "chief", "checkpoint_node"),
    [
        ({"CKPTSTORE_NODE": "trainer-7"}, "trainer-7", True, "trainer-7"),
        (
            {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a", "b"]}, "task": {"type": "worker", "index": 0}})},
            "worker-0",
            True,
            "worker-0",
        ),
        (
            {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a", "b"]}, "task": {"type": "worker", "index": 1}})},
            "worker-1",
            False,
            "worker-0",
        ),
        (
            {
                "TF_CONFIG": json.dumps(
                    {"cluster": {"chief": ["c"], "worker": ["a"]}, "task": {"type": "worker", "index": 0}}
                )
            },
            "worker-0",
            False,
            "chief-0",
        ),
        ({"JOB_COMPLETION_INDEX": "3"}, "node-3", False, "node-3"),
        ({"RANK": "0"}, "node-0", True, "node-0"),
        ({"SLURM_PROCID": "2"}, "node-2", False, "node-2"),
    ],
)
def test_node_identity(monkeypatch, env, node, chief, checkpoint_node):
    for variable in ("CKPTSTORE_NODE", "TF_CONFIG", "JOB_COMPLETION_INDEX", "RANK", "SLURM_PROCID"):
        monkeypatch.delenv(variable, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    identity = resolve_identity()
    assert (identity.node, identity.is_chief, identity.checkpoint_node) == (node, chief, checkpoint_node)
    assert resolve_identity("explicit").node == "explicit"


def test_service_client_maps_errors_to_typed_exceptions(sqlite_service, job_name):
    with ServiceClient(sqlite_service.live.url) as client:
        with pytest.raises(CheckpointNotFoundError):
            client.last_good_epoch(job_name)
        client.put_job(job_name, ["n0"], storage_root=sqlite_service.storage)
        store = Store(sqlite_service.storage)
        ref = store.save(job_name, "n0", 0, STATE, attempt=1)
        assert client.commit(ref).state == "committed"
        assert client.commit(ref).state == "committed", "a re-post is idempotent"
        other = store.save(job_name, "n0", 0, STATE, attempt=1, batch=3)
        forged = type(ref)(**{**ref.__dict__, "bytes": ref.bytes + 1})
        with pytest.raises(CommitConflictError):
            client.commit(forged)
        assert client.start_attempt(job_name, "n0") == "2"
        with pytest.raises(FencedError):
            client.commit(other)
        with pytest.raises(RequestRejectedError) as rejected:
            client.put_job(job_name, ["n0"], storage_root="s3://elsewhere")
        assert rejected.value.status == 403 and rejected.value.code == "forbidden"
        assert client.last_good_epoch(job_name).epoch == 0


def test_unreachable_service_raises_service_unavailable_after_retries():
    client = ServiceClient(f"http://127.0.0.1:{free_port()}", retries=3, backoff=0.01, timeout=1)
    with pytest.raises(ServiceUnavailableError, match="after 3 tries"):
        client.list_jobs()


def test_service_down_mid_training_commits_are_reposted_when_it_returns(tmp_path):
    port = free_port()
    settings = Settings(db_url=f"sqlite:///{tmp_path}/db.sqlite", storage=str(tmp_path / "storage"))
    live = LiveService(settings, port=port)
    node = NodeCheckpointer(
        job="outage", storage=str(tmp_path / "storage"), service=live.url, node="n0", async_save=False
    )
    node.client.retries, node.client.backoff = 2, 0.01
    assert node.start() is None
    node.save(Position(0), STATE)
    live.stop()
    node.save(Position(1), STATE)
    node.save(Position(2), STATE)
    assert node.reports.pending_commits == 2, "checkpoints go to storage; their commits wait for the service"
    assert node.store.list_epochs("outage", "n0") == [0, 1, 2]
    live = LiveService(settings, port=port)
    try:
        node.save(Position(3), STATE)
        assert node.reports.pending_commits == 0
        with ServiceClient(live.url) as client:
            assert client.last_good_epoch("outage").epoch == 3
            records = client.list_checkpoints("outage")
            assert [r.epoch for r in records] == [0, 1, 2, 3], "re-posted exactly once"
    finally:
        node.close()
        live.stop()


def test_storage_down_skips_saves_reports_health_and_training_goes_on(tmp_path, sqlite_service, caplog):
    moto = MotoS3()
    job = f"storage-down-{uuid.uuid4().hex[:6]}"
    node = NodeCheckpointer(
        job=job,
        storage=f"s3://{moto.bucket}/{job}",
        service=sqlite_service.live.url,
        node="n0",
        async_save=True,
        storage_options=dict(moto.options, config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 1}),
    )
    with ServiceClient(sqlite_service.live.url) as client:
        client.put_job(job, ["n0"], storage_root=f"s3://{moto.bucket}/{job}")
    try:
        node.start()
        node.save(Position(0), STATE)
        node.wait()
        moto.stop()
        with caplog.at_level(logging.WARNING, logger="ckptstore.client"):
            node.save(Position(1), STATE)
            node.wait()
        assert node.skipped_saves == 1
        assert "checkpoint save skipped" in caplog.text
        with ServiceClient(sqlite_service.live.url) as client:
            health = {h.node: h for h in client.health(job).nodes}
            assert health["n0"].cp_accessible is False and health["n0"].error
            assert client.last_good_epoch(job).epoch == 0
    finally:
        node.close()


def test_a_zombie_attempt_is_fenced_and_stops_whatever_on_error_says(tmp_path, sqlite_service):
    job = f"fence-{uuid.uuid4().hex[:6]}"
    zombie = NodeCheckpointer(
        job=job, storage=sqlite_service.storage, service=sqlite_service.live.url, node="n0", on_error="warn"
    )
    zombie.start()
    zombie.save(Position(0), STATE)
    zombie.wait()
    successor = NodeCheckpointer(job=job, storage=sqlite_service.storage, service=sqlite_service.live.url, node="n0")
    assert successor.start().copy.position == Position(0)
    zombie.save(Position(1), STATE)
    with pytest.raises(FencedError):
        zombie.wait()
    with pytest.raises(FencedError):
        zombie.save(Position(2), STATE)
    successor.save(Position(1), STATE)
    successor.wait()
    with ServiceClient(sqlite_service.live.url) as client:
        answer = client.last_good_epoch(job)
        assert answer.epoch == 1 and answer.nodes["n0"].attempt == "2"
    successor.close()
