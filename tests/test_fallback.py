"""Restore reaches the newest intact copy: a bit flip, a truncated or deleted shard, or a whole copy
gone from storage sends restore to the next intact copy (another tier, an older attempt, an older
position), bit-exact, and the service marks the bad copy so no later restart trips on it. Three
nodes with one bad part all resume from the same older position. Local disk and S3 (moto)."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import uuid

import pytest

from ckptstore import Position, Store
from ckptstore.client import ServiceClient
from ckptstore.client.engine.node import NodeCheckpointer
from ckptstore.client.engine.restore import NothingToRestoreError
from ckptstore.format.layout import checkpoint_key
from tests.builders import arrays_for, bit_equal

DAMAGE = ("flip", "truncate", "delete-shard", "delete-copy")


def damage(store: Store, job: str, node: str, position: Position, attempt: str, how: str) -> None:
    """Damage one copy on storage the way a disk, a person or a script would."""
    fs, key = store._storage.fs, checkpoint_key(job, node, position, attempt)
    shard = store._storage.path(store.manifest(store.key(job, node, position, attempt)).shards[0].key(key))
    if how == "delete-copy":
        fs.rm(store._storage.path(key), recursive=True)
    elif how == "delete-shard":
        fs.rm_file(shard)
    else:
        data = bytearray(fs.cat_file(shard))
        if how == "flip":
            data[len(data) // 2] ^= 0x01
        else:
            data = data[: len(data) // 3]
        fs.pipe_file(shard, bytes(data))


@pytest.fixture
def durable(sqlite_service) -> str:
    """A fresh durable root the service allows."""
    return f"{sqlite_service.storage}/{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=["local", "s3"])
def root(request, durable) -> tuple[str, dict]:
    if request.param == "local":
        return durable, {}
    moto = request.getfixturevalue("moto_s3")
    return f"s3://{moto.bucket}/fallback-{uuid.uuid4().hex[:8]}", dict(moto.options)


def node(job: str, storage: str, options: dict, service: str | None, name: str = "n0", **extra) -> NodeCheckpointer:
    return NodeCheckpointer(
        job=job, storage=storage, storage_options=options, service=service, node=name, async_save=False, **extra
    )


def save_epochs(checkpointer: NodeCheckpointer, epochs: int, offset: int = 0) -> None:
    assert checkpointer.start() is None
    for epoch in range(epochs):
        checkpointer.save(Position(epoch), arrays_for(epoch + offset))
    checkpointer.close()


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_newest_copy_resumes_from_the_previous_position_and_is_marked(root, sqlite_service, how):
    storage, options = root
    job, url = f"fb-{uuid.uuid4().hex[:8]}", sqlite_service.live.url
    save_epochs(node(job, storage, options, url), 3)
    damage(Store(storage, storage_options=options), job, "n0", Position(2), "1", how)

    again = node(job, storage, options, url)
    again_restored = again.start()
    assert again_restored is not None and again_restored.copy.position == Position(1)
    assert again_restored is not None and bit_equal(again_restored.checkpoint.arrays, arrays_for(1))
    (skipped,) = again_restored.skipped
    expected_state = "missing" if how.startswith("delete") else "corrupt"
    with ServiceClient(url) as client:
        (record,) = client.list_checkpoints(job, epoch=2)
        assert record.state == expected_state and record.reason.startswith("restore: "), record
        answer = client.last_good_epoch(job)
        assert (answer.epoch, answer.resume.to_position()) == (1, Position(1)), "no restart trips on it again"
        history = client.list_attempts(job, node="n0")[-1]
        assert history.resumed_from.to_position() == Position(1)
        assert [(s.epoch, s.state) for s in history.skipped] == [(2, expected_state)]
        assert history.skipped[0].reason, "the history says why"
    assert skipped.copy.position == Position(2) and skipped.state == expected_state
    again.close()
    third = node(job, storage, options, url)
    third_restored = third.start()
    assert third_restored is not None and third_restored.copy.position == Position(1)
    assert third_restored is not None and not third_restored.skipped, "the bad copy is not tried again"
    third.close()


@pytest.mark.parametrize("how", ["flip", "delete-copy"])
def test_without_a_service_restore_still_skips_the_damaged_copy(root, how):
    storage, options = root
    job = f"fb-offline-{uuid.uuid4().hex[:8]}"
    first = node(job, storage, options, None)
    save_epochs(first, 3)
    damage(Store(storage, storage_options=options), job, "n0", Position(2), first.attempt, how)
    again = node(job, storage, options, None)
    again_restored = again.start()
    assert again_restored is not None and again_restored.copy.position == Position(1)
    assert again_restored is not None and bit_equal(again_restored.checkpoint.arrays, arrays_for(1))


def test_a_corrupt_newest_attempt_falls_back_to_an_older_attempt_of_the_same_position(durable, sqlite_service):
    storage, job, url = durable, f"fb-att-{uuid.uuid4().hex[:8]}", sqlite_service.live.url
    save_epochs(node(job, storage, {}, url), 2)
    store = Store(storage)
    # A second attempt re-committed epoch 1 (a retried save) and its copy rotted.
    with ServiceClient(url) as client:
        attempt = client.start_attempt(job, "n0")
        client.commit(store.save(job, "n0", 1, arrays_for(7), attempt=attempt))
    damage(store, job, "n0", Position(1), attempt, "flip")
    again = node(job, storage, {}, url)
    again_restored = again.start()
    assert again_restored is not None and again_restored.copy.position == Position(1) and again_restored is not None
    assert again_restored.copy.attempt == "1" and bit_equal(again_restored.checkpoint.arrays, arrays_for(1))
    assert [(s.copy.attempt, s.state) for s in again_restored.skipped] == [(attempt, "corrupt")]


def test_no_intact_copy_left_names_every_copy_tried_and_never_starts_fresh(durable, sqlite_service):
    storage, job, url = durable, f"fb-none-{uuid.uuid4().hex[:8]}", sqlite_service.live.url
    save_epochs(node(job, storage, {}, url), 2)
    store = Store(storage)
    damage(store, job, "n0", Position(0), "1", "truncate")
    damage(store, job, "n0", Position(1), "1", "flip")
    with pytest.raises(NothingToRestoreError) as raised:
        node(job, storage, {}, url).start()
    message = str(raised.value)
    assert "epoch 1" in message and "epoch 0" in message and "corrupt" in message, message


def test_a_good_epoch_the_service_records_but_storage_lost_is_marked_missing(durable, sqlite_service):
    storage, job, url = durable, f"fb-lost-{uuid.uuid4().hex[:8]}", sqlite_service.live.url
    save_epochs(node(job, storage, {}, url), 3)
    shutil.rmtree(os.path.join(storage, job, "n0", "0000000002"))  # the whole position, every attempt
    again = node(job, storage, {}, url)
    again_restored = again.start()
    assert again_restored is not None and again_restored.copy.position == Position(1)
    with ServiceClient(url) as client:
        (record,) = client.list_checkpoints(job, epoch=2)
        assert (record.state, record.reason) == ("missing", "restore: recorded, but not on storage")
    again.close()


def test_three_nodes_with_one_corrupt_part_all_resume_from_the_same_older_position(durable, sqlite_service):
    storage, job, url = durable, f"fb-3n-{uuid.uuid4().hex[:8]}", sqlite_service.live.url
    nodes = ["n0", "n1", "n2"]
    with ServiceClient(url) as client:
        client.put_job(job, nodes, storage_root=storage)
    for i, name in enumerate(nodes):
        save_epochs(node(job, storage, {}, url, name), 3, offset=10 * i)
    damage(Store(storage), job, "n1", Position(2), "1", "flip")

    def restart(name: str) -> tuple[Position | None, bool]:
        checkpointer = node(job, storage, {}, url, name, restore_timeout_s=60)
        restored = checkpointer.start()
        assert restored is not None
        position, offset = restored.copy.position, 10 * nodes.index(name)
        intact = bit_equal(restored.checkpoint.arrays, arrays_for(position.epoch + offset))
        checkpointer.close()
        return position, intact

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(restart, nodes))
    assert results == [(Position(1), True)] * 3, "no node resumes a position another node cannot restore"
    with ServiceClient(url) as client:
        resumed = {a.node: a.resumed_from.to_position() for a in client.list_attempts(job) if a.resumed_from}
        assert resumed == dict.fromkeys(nodes, Position(1))
        assert client.resume_agreement(job).agreed


def test_a_node_missing_from_the_restore_is_named_after_the_timeout(durable, sqlite_service):
    storage, job, url = durable, f"fb-wait-{uuid.uuid4().hex[:8]}", sqlite_service.live.url
    with ServiceClient(url) as client:
        client.put_job(job, ["n0", "n1"], storage_root=storage)
    for name in ("n0", "n1"):
        save_epochs(node(job, storage, {}, url, name), 1)
    lonely = node(job, storage, {}, url, "n0", restore_timeout_s=1)
    with pytest.raises(Exception, match="nodes n1 .* did not verify epoch 0"):
        lonely.start()


def test_a_corrupt_local_copy_falls_back_to_the_durable_copy_of_the_same_position(tmp_path, durable, sqlite_service):
    job, url = f"fb-tier-{uuid.uuid4().hex[:8]}", sqlite_service.live.url
    local = str(tmp_path / "local")
    first = node(job, durable, {}, url, local_storage=local)
    save_epochs(first, 3)
    damage(Store(local), job, "n0", Position(2), "1", "flip")
    again = node(job, durable, {}, url, local_storage=local)
    again_restored = again.start()
    assert again_restored is not None and again_restored.copy.position == Position(2), (
        "the same position from the other tier, before any older position"
    )
    assert again_restored is not None and again_restored.copy.tier == "durable"
    assert bit_equal(again_restored.checkpoint.arrays, arrays_for(2))
    with ServiceClient(url) as client:
        states = {(r.tier, r.state) for r in client.list_checkpoints(job, epoch=2)}
        assert states == {("local", "corrupt"), ("durable", "committed")}
        assert client.last_good_epoch(job).epoch == 2
    again.close()
