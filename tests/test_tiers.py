"""A fast local tier replicated to durable storage (S3 via moto): saves commit locally and replicate
in the background, verified; a restart on the same machine restores from the local copy, a new
machine from the durable one; kill -9 during replication leaves the local copy as the restore
source and nothing half-recorded, and replication resumes; the durable store away for a while
costs training nothing and replication catches up; a full local disk sends saves to durable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import pytest

from ckptstore import Position, Store
from ckptstore.client import ServiceClient
from ckptstore.client.engine.node import NodeCheckpointer
from tests.builders import arrays_for, bit_equal
from tests.faults import FaultProxy
from tests.live import wait_for
from tests.servers import tmpfs

pytestmark = pytest.mark.s3
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAIL_FAST = {"config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}}


@pytest.fixture
def tiers(tmp_path, moto_s3, sqlite_service):
    """(local root, durable root, storage options, service URL, job) for one fresh job."""
    job = f"tier-{uuid.uuid4().hex[:8]}"
    return str(tmp_path / "local"), f"s3://{moto_s3.bucket}/{job}", dict(moto_s3.options), sqlite_service.live.url, job


def checkpointer(local: str | None, durable: str, options: dict, url: str, job: str, **extra) -> NodeCheckpointer:
    return NodeCheckpointer(
        job=job, storage=durable, local_storage=local, storage_options=options, service=url, node="n0", **extra
    )


def test_saves_commit_locally_replicate_verified_and_the_local_tier_keeps_the_newest(tiers):
    local, durable, options, url, job = tiers
    node = checkpointer(local, durable, options, url, job, local_max_to_keep=2)
    assert node.start() is None
    for epoch in range(4):
        node.save(Position(epoch), arrays_for(epoch))
    node.wait()
    assert Store(durable, storage_options=options).list_positions(job, "n0") == [Position(e) for e in range(4)]
    for epoch in range(4):
        assert bit_equal(Store(durable, storage_options=options).load(job, "n0", epoch), arrays_for(epoch))
    assert Store(local).list_positions(job, "n0") == [Position(2), Position(3)], "older local copies pruned"
    with ServiceClient(url) as client:
        answer = client.last_good_epoch(job)
        assert (answer.epoch, answer.durable_epoch) == (3, 3)
        assert {(c.tier, c.state) for c in answer.nodes["n0"].copies} == {
            ("local", "committed"),
            ("durable", "committed"),
        }
        assert answer.nodes["n0"].location.startswith("s3://"), "the location other machines can read"
        (health,) = client.health(job).nodes
        assert health.replication is not None and health.replication.pending == 0
        assert health.replication.newest_durable.to_position() == Position(3)
        states = {(r.epoch, r.tier): r.state for r in client.list_checkpoints(job)}
        assert states[(0, "local")] == "deleted" and states[(0, "durable")] == "committed"
    node.close()


def test_a_restart_on_the_same_machine_restores_locally_a_new_machine_from_durable(tiers, tmp_path):
    local, durable, options, url, job = tiers
    node = checkpointer(local, durable, options, url, job)
    node.start()
    for epoch in range(3):
        node.save(Position(epoch), arrays_for(epoch))
    node.close()
    same_machine = checkpointer(local, durable, options, url, job)
    same_machine_restored = same_machine.start()
    assert same_machine_restored is not None and same_machine_restored.copy.position == Position(2)
    assert same_machine_restored.copy.tier == "local"
    assert bit_equal(same_machine_restored.checkpoint.arrays, arrays_for(2))
    same_machine.close()
    new_machine = checkpointer(str(tmp_path / "empty-local"), durable, options, url, job)
    new_machine_restored = new_machine.start()
    assert new_machine_restored is not None and new_machine_restored.copy.position == Position(2)
    assert new_machine_restored.copy.tier == "durable" and not new_machine_restored.skipped
    assert bit_equal(new_machine_restored.checkpoint.arrays, arrays_for(2))
    new_machine.close()


def test_kill_9_during_replication_keeps_the_local_copy_and_replication_resumes(tiers, moto_s3):
    local, durable, options, url, job = tiers
    slow = FaultProxy(moto_s3.endpoint_url, rate=1.0, kinds=("latency",))
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.tier_job", local, durable, slow.endpoint_url, url, job, "1"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout.readline().strip() == "LOCAL 0"
        wait_for(lambda: slow.methods["PUT"] >= 2, timeout=60, what="shard parts on their way to S3")
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        slow.stop()
    durable_store = Store(durable, storage_options=options)
    assert durable_store.list_positions(job, "n0") == [], "no durable copy is committed half-way"
    assert not durable_store._storage.fs.exists(f"{durable}/{job}/n0/0000000000/1/MANIFEST.json")
    with ServiceClient(url) as client:
        assert [r.tier for r in client.list_checkpoints(job)] == ["local"], "nor recorded"
    restarted = checkpointer(local, durable, options, url, job)
    restarted_restored = restarted.start()
    assert restarted_restored is not None and restarted_restored.copy.position == Position(0)
    assert restarted_restored.copy.tier == "local", "the local copy stays the restore source"
    assert bit_equal(restarted_restored.checkpoint.arrays, arrays_for(0, size=2_500_000))
    restarted.wait()
    assert durable_store.list_positions(job, "n0") == [Position(0)], "replication resumed after the restart"
    assert bit_equal(durable_store.load(job, "n0", 0), arrays_for(0, size=2_500_000))
    with ServiceClient(url) as client:
        assert sorted(r.tier for r in client.list_checkpoints(job)) == ["durable", "local"]
        assert client.last_good_epoch(job).durable_epoch == 0
    restarted.close()


def test_the_durable_store_away_costs_training_nothing_and_replication_catches_up(tiers, moto_s3):
    local, durable, options, url, job = tiers
    proxy = FaultProxy(moto_s3.endpoint_url)
    try:
        node = checkpointer(local, durable, options | {"endpoint_url": proxy.endpoint_url} | FAIL_FAST, url, job)
        node.start()
        node.save(Position(0), arrays_for(0))
        node.wait()
        proxy.rate, proxy.kinds = 1.0, ("503", "reset")
        for epoch in range(1, 4):
            node.save(Position(epoch), arrays_for(epoch))
            node.wait_for_write()
        assert node.skipped_saves == 0, "local saves go on"
        assert not node._replicator.wait(timeout=30), "replication waits: the durable tier refuses every try"
        with ServiceClient(url) as client:
            assert client.last_good_epoch(job).epoch == 3, "good on the local tier"
            assert client.last_good_epoch(job).durable_epoch == 0
            (health,) = client.health(job).nodes
            assert health.replication.pending >= 2 and health.replication.oldest_pending_seconds >= 0
        proxy.rate = 0.0
        node.wait()
        durable_store = Store(durable, storage_options=options)
        assert durable_store.list_positions(job, "n0") == [Position(e) for e in range(4)], "nothing lost"
        assert all(bit_equal(durable_store.load(job, "n0", e), arrays_for(e)) for e in range(4))
        with ServiceClient(url) as client:
            assert client.last_good_epoch(job).durable_epoch == 3
        node.close()
    finally:
        proxy.stop()


def test_copies_retention_deletes_while_they_wait_for_the_durable_tier_are_not_called_lost(
    tiers, moto_s3, caplog, capsys
):
    """After an outage, retention removes the queued local copies outside the job's policy: no warning
    each, no `missing` mark, one summary line at the end of the run (as an S3-only run ends with one)."""
    local, durable, options, url, job = tiers
    proxy = FaultProxy(moto_s3.endpoint_url)
    try:
        node = checkpointer(
            local, durable, options | {"endpoint_url": proxy.endpoint_url} | FAIL_FAST, url, job, max_to_keep=2
        )
        node.start()
        node.save(Position(0), arrays_for(0))
        node.wait()
        proxy.rate, proxy.kinds = 1.0, ("503", "reset")
        for epoch in range(1, 7):
            node.save(Position(epoch), arrays_for(epoch))
            node.wait_for_write()
        assert not node._replicator.wait(timeout=30)
        proxy.kinds = ("latency",)  # back, slowly: retention's plan runs while older copies still wait
        node.close()
    finally:
        proxy.stop()
    assert "cannot be replicated" not in caplog.text
    summary = [line for line in capsys.readouterr().err.splitlines() if "replicated to the durable tier" in line]
    assert len(summary) == 1 and "deleted by retention before they were" in summary[0], summary
    with ServiceClient(url) as client:
        records = client.list_checkpoints(job)
    assert not [r for r in records if r.state in ("missing", "corrupt")], "a copy deleted on purpose is not lost"
    assert Store(durable, storage_options=options).list_positions(job, "n0")[-2:] == [Position(5), Position(6)]


def test_a_waiting_local_copy_that_vanishes_is_still_reported_lost(tiers, moto_s3, caplog):
    """The control: a copy nobody deleted on purpose, gone before it was replicated, is warned about and marked."""
    local, durable, options, url, job = tiers
    proxy = FaultProxy(moto_s3.endpoint_url)
    try:
        node = checkpointer(local, durable, options | {"endpoint_url": proxy.endpoint_url} | FAIL_FAST, url, job)
        node.start()
        proxy.rate, proxy.kinds = 1.0, ("503", "reset")
        node.save(Position(0), arrays_for(0))
        node.wait_for_write()
        (copy,) = Store(local).copies(job, "n0", Position(0))
        Store(local).delete_copy(copy)  # a disk cleaner, not retention
        proxy.rate = 0.0
        node.close()
    finally:
        proxy.stop()
    assert "cannot be replicated" in caplog.text
    with ServiceClient(url) as client:
        assert [(r.tier, r.state) for r in client.list_checkpoints(job)] == [("local", "missing")]


@pytest.fixture
def tiny_local_disk(tmp_path):
    with tmpfs(str(tmp_path / "tiny"), "256k") as mountpoint:
        yield mountpoint


def test_a_full_local_disk_saves_straight_to_the_durable_tier(tiers, tiny_local_disk, caplog):
    _, durable, options, url, job = tiers
    node = checkpointer(tiny_local_disk, durable, options, url, job, async_save=False)
    node.start()
    node.save(Position(0), arrays_for(0))  # 640 KB: more than the local disk holds
    assert node.skipped_saves == 0
    assert "the local tier failed" in caplog.text
    assert Store(durable, storage_options=options).list_positions(job, "n0") == [Position(0)]
    assert Store(tiny_local_disk).list_positions(job, "n0") == []
    with ServiceClient(url) as client:
        assert [(r.tier, r.state) for r in client.list_checkpoints(job)] == [("durable", "committed")]
    node.close()
