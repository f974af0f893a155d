"""Checkpoints on request: `ckptstore checkpoint-now JOB --wait` against a running training with no
mid-epoch cadence of its own commits a new mid-epoch position within seconds, and training runs on to
rc 0 (the Keras, Lightning and Hugging Face callbacks and the PyTorch manager, real processes); requests coalesce; --wait says which nodes did
not commit, with exit 1."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from ckptstore.client import ServiceClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = os.path.join(os.path.dirname(sys.executable), "ckptstore")


def checkpoint_now(url: str, job: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CLI, "checkpoint-now", job, "--url", url, *extra], capture_output=True, text=True, timeout=180
    )


@pytest.mark.parametrize("framework", ["keras", "torch", "lightning", "hf"])
def test_checkpoint_now_commits_a_mid_epoch_position_and_training_goes_on(framework, tmp_path, sqlite_service):
    pytest.importorskip({"keras": "keras", "torch": "torch", "lightning": "lightning", "hf": "transformers"}[framework])
    job = f"now-{framework}-{uuid.uuid4().hex[:6]}"
    command = [sys.executable, "-m", "tests.request_job", "--framework", framework, "--job", job]
    command += ["--storage", sqlite_service.storage, "--service", sqlite_service.live.url]
    training = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert training.stdout is not None
        first = training.stdout.readline()  # the first batch is under way (or the process ended)
        assert first.strip() == "TRAINING", (first, training.stderr.read() if training.poll() is not None else "")
        asked = time.monotonic()
        result = checkpoint_now(sqlite_service.live.url, job, "--wait", "--timeout", "60", "--reason", "drain")
        took = time.monotonic() - asked
        assert result.returncode == 0, (result.stdout, result.stderr)
        assert "committed since: n0" in result.stdout
        with ServiceClient(sqlite_service.live.url) as client:
            mid_epoch = [c for c in client.list_checkpoints(job) if c.batch is not None]
        assert mid_epoch, "the request made no mid-epoch position"
        out, err = training.communicate(timeout=180)
    finally:
        training.kill()
    assert training.returncode == 0 and "DONE" in out, err[-3000:]
    assert "checkpoint requested (drain): saving at the next step" in err
    assert took < 30, f"the request took {took:.1f} s to be committed"


def test_requests_coalesce_and_wait_names_the_nodes_that_did_not_commit(sqlite_service):
    job = f"coalesce-{uuid.uuid4().hex[:6]}"
    with ServiceClient(sqlite_service.live.url) as client:
        client.put_job(job, nodes=["a", "b"], storage_root=sqlite_service.storage)
        first = client.request_checkpoint(job, reason="maintenance")
        again = client.request_checkpoint(job)
        assert not first.coalesced and first.pending == ["a", "b"] and first.nodes == {"a": None, "b": None}
        assert again.coalesced and again.id == first.id, "a request while one is pending is that one"
        result = checkpoint_now(sqlite_service.live.url, job, "--wait", "--timeout", "1")
        assert result.returncode == 1 and "not committed after 1 s: a, b" in result.stdout, result.stdout
        latest = client.latest_checkpoint_request(job)
        assert latest is not None and latest.id == first.id and latest.reason == "maintenance"
        events = list(_take(client.events(job, after=0, types=["checkpoint.requested"]), 1))
        assert events[0].id == first.id and events[0].data["reason"] == "maintenance"
        client.delete_job(job)  # a new job of the same name inherits no request
        client.put_job(job, nodes=["a"], storage_root=sqlite_service.storage)
        assert client.latest_checkpoint_request(job) is None
        assert not client.request_checkpoint(job).coalesced


def test_a_job_without_requests_answers_none_and_an_answered_request_makes_way_for_a_new_one(sqlite_service):
    import numpy as np

    from ckptstore import Position
    from ckptstore.client.engine.node import NodeCheckpointer

    job = f"answered-{uuid.uuid4().hex[:6]}"
    node = NodeCheckpointer(storage=sqlite_service.storage, service=sqlite_service.live.url, job=job, node="n0")
    try:
        node.start()
        with ServiceClient(sqlite_service.live.url) as client:
            assert client.latest_checkpoint_request(job) is None
            first = client.request_checkpoint(job)
            deadline = time.monotonic() + 30
            while not node.requested and time.monotonic() < deadline:  # the node's stream brings it
                time.sleep(0.02)
            assert node.requested
            node.save(Position(0, 3), {"w": np.ones(4)})
            node.wait()
            assert not node.requested
            answered = client.latest_checkpoint_request(job)
            assert answered is not None and answered.pending == []
            second = client.request_checkpoint(job)
            assert second.id > first.id and not second.coalesced
            assert second.nodes["n0"] is not None and second.nodes["n0"].batch == 3
    finally:
        node.close()


def _take(iterator, count):
    for _, item in zip(range(count), iterator):
        yield item
