"""Storage faults on the real request path: a fault-injecting proxy in front of moto's S3 server
(500, 503 SlowDown, connection resets, lost answers, latency, truncated bodies), a store that is
fully down, and a full disk (ENOSPC at random write offsets)."""

from __future__ import annotations

import errno
import random
import uuid

import pytest

from ckptstore import Position, Store
from ckptstore.errors import CkptStoreError
from ckptstore.storage.filesystem import Storage
from tests.builders import arrays_for, bit_equal
from tests.faults import FaultProxy

pytestmark = pytest.mark.s3


@pytest.fixture
def proxy(moto_s3):
    proxy = FaultProxy(moto_s3.endpoint_url, seed=7)
    yield proxy
    proxy.stop()


def stores(moto_s3, proxy) -> tuple[Store, Store]:
    """(through the faults, straight to moto) on one fresh root."""
    root = f"s3://{moto_s3.bucket}/faults-{uuid.uuid4().hex[:8]}"
    faulty = Store(root, storage_options=moto_s3.options | {"endpoint_url": proxy.endpoint_url}, shard_size=256 << 10)
    return faulty, Store(root, storage_options=moto_s3.options)


@pytest.mark.parametrize("rate", [0.0, 0.1, 0.3])
def test_saves_and_restores_succeed_verified_through_up_to_30_percent_faults(moto_s3, proxy, rate):
    faulty, direct = stores(moto_s3, proxy)
    proxy.rate = rate
    for epoch in range(3):
        faulty.save("job", "n0", epoch, arrays_for(epoch), attempt="1")
        assert bit_equal(faulty.load("job", "n0", epoch), arrays_for(epoch)), "restores never return wrong bytes"
    assert [p.epoch for p in direct.list_positions("job", "n0")] == [0, 1, 2]
    assert all(direct.verify("job", "n0", e).ok for e in range(3))
    assert (sum(proxy.injected.values()) > 0) == (rate > 0), proxy.injected


@pytest.mark.slow
def test_at_90_percent_every_save_commits_verified_or_fails_cleanly(moto_s3, proxy):
    faulty, direct = stores(moto_s3, proxy)
    proxy.rate = 0.9
    outcomes = []
    for epoch in range(3):
        try:
            faulty.save("job", "n0", epoch, arrays_for(epoch), attempt="1")
            outcomes.append("committed")
        except (OSError, CkptStoreError):
            outcomes.append("failed")
    committed = {p.epoch for p in direct.list_positions("job", "n0")}
    for epoch, outcome in enumerate(outcomes):
        if outcome == "committed":
            assert epoch in committed and bit_equal(direct.load("job", "n0", epoch), arrays_for(epoch))
        else:
            assert epoch not in committed or direct.verify("job", "n0", epoch).ok, "never a partial commit"
    assert sum(proxy.injected.values()) > 10


@pytest.mark.slow  # a long run: scripts/test.sh -m slow runs it (the default run stays near 30 minutes)
def test_a_store_that_is_fully_down_skips_saves_reports_health_and_recovers(moto_s3, proxy, sqlite_service):
    from ckptstore.client import ServiceClient
    from ckptstore.client.engine.node import NodeCheckpointer

    job = f"down-{uuid.uuid4().hex[:6]}"
    root = f"s3://{moto_s3.bucket}/{job}"
    options = moto_s3.options | {"endpoint_url": proxy.endpoint_url}
    node = NodeCheckpointer(
        job=job, storage=root, storage_options=options, service=sqlite_service.live.url, node="n0", async_save=False
    )
    node.start()
    node.save(Position(0), arrays_for(0))
    proxy.rate, proxy.kinds = 1.0, ("500", "503", "reset")
    node.save(Position(1), arrays_for(1))
    assert node.skipped_saves == 1
    with ServiceClient(sqlite_service.live.url) as client:
        (health,) = client.health(job).nodes
        assert health.cp_accessible is False and health.error
        proxy.rate = 0.0
        node.save(Position(2), arrays_for(2))
        assert [c.epoch for c in client.list_checkpoints(job)] == [0, 2]
        assert client.last_good_epoch(job).epoch == 2
    node.close()
    again = NodeCheckpointer(job=job, storage=root, storage_options=options, service=sqlite_service.live.url, node="n0")
    restored = again.start()
    assert restored is not None and restored.copy.position == Position(2)
    assert bit_equal(restored.checkpoint.arrays, arrays_for(2))
    again.close()


def test_disk_full_at_random_write_offsets_leaves_no_commit_and_the_previous_position_intact(tmp_path, monkeypatch):
    store = Store(str(tmp_path / "root"), shard_size=256 << 10)
    store.save("job", "n0", 0, arrays_for(0), attempt="1")
    real_write = Storage.write_object
    total = sum(a.nbytes for a in arrays_for(1).values())
    offsets = random.Random(3).sample(range(1, total), 8) + [0]

    for trial, offset in enumerate(offsets):
        budget = {"left": offset}

        def write_until_full(self, relpath, chunks, size=None, budget=budget):
            def limited():
                for chunk in chunks:
                    size = memoryview(chunk).nbytes
                    if size > budget["left"]:
                        raise OSError(errno.ENOSPC, "No space left on device (injected)")
                    budget["left"] -= size
                    yield chunk

            real_write(self, relpath, limited(), size)

        monkeypatch.setattr(Storage, "write_object", write_until_full)
        with pytest.raises(OSError) as raised:
            store.save("job", "n0", 1 + trial, arrays_for(1), attempt="1")
        assert raised.value.errno == errno.ENOSPC
        monkeypatch.setattr(Storage, "write_object", real_write)
        assert [p.epoch for p in store.list_positions("job", "n0")] == [0], f"offset {offset}: nothing new committed"
        assert [c.key.position.epoch for c in store.list_checkpoints("job", "n0")] == [0], "no leftovers"
    assert bit_equal(store.load("job", "n0", 0), arrays_for(0))


def test_disk_full_while_publishing_the_manifest_leaves_no_commit(tmp_path, monkeypatch):
    store = Store(str(tmp_path / "root"))
    store.save("job", "n0", 0, arrays_for(0), attempt="1")

    def full(self, relpath, data):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(Storage, "publish_object", full)
    with pytest.raises(OSError):
        store.save("job", "n0", 1, arrays_for(1), attempt="1")
    monkeypatch.undo()
    assert [p.epoch for p in store.list_positions("job", "n0")] == [0]
    assert bit_equal(store.load("job", "n0", 0), arrays_for(0))
