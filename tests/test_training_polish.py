"""What a training user tripped over (issue 18), each reproduced first: per-node jobs declared by their
first start, a hand-declared job honouring max_to_keep, health that tells the truth, retention that
counts mid-epoch positions, a resume the user sees, typos that fail loudly at once, a changed
optimizer named precisely, and the exact state words (missing / corrupt / deleted)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

import numpy as np
import pytest

from ckptstore import Position, Store
from ckptstore.client import ServiceClient
from ckptstore.client.engine.node import NodeCheckpointer
from ckptstore.client.engine.options import CheckpointOptions
from ckptstore.errors import InvalidNameError
from tests.builders import arrays_for
from tests.faults import FaultProxy


@pytest.fixture
def root(sqlite_service) -> str:
    return f"{sqlite_service.storage}/{uuid.uuid4().hex[:8]}"


def node(job: str, root: str, url: str | None, name: str = "n0", **extra) -> NodeCheckpointer:
    return NodeCheckpointer(job=job, storage=root, service=url, node=name, async_save=False, **extra)


def test_per_node_jobs_declare_themselves_with_nodes(root, sqlite_service):
    url, job = sqlite_service.live.url, f"pernode-{uuid.uuid4().hex[:6]}"
    workers = [node(job, root, url, name, nodes=["worker-0", "worker-1"]) for name in ("worker-0", "worker-1")]
    for worker in workers:
        assert worker.start() is None  # the second is not refused: both are expected
    for worker in workers:
        worker.save(Position(0), arrays_for(0))
    with ServiceClient(url) as client:
        assert client.get_job(job).nodes == ["worker-0", "worker-1"]
        assert client.last_good_epoch(job).epoch == 0, "good once both committed"
    for worker in workers:
        worker.close()


def test_world_size_gives_the_node_count_and_the_cli_declares_a_job(root, sqlite_service, monkeypatch):
    url, job = sqlite_service.live.url, f"ranks-{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    rank = NodeCheckpointer(job=job, storage=root, service=url, async_save=False)
    rank.start()
    with ServiceClient(url) as client:
        assert client.get_job(job).nodes == ["node-0", "node-1", "node-2"]
    rank.close()
    declared = f"declared-{uuid.uuid4().hex[:6]}"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptstore.client.cli.main",
            "jobs",
            "declare",
            declared,
            "--nodes",
            "a,b",
            "--keep-last",
            "4",
            "--storage-root",
            root,
            "--url",
            url,
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    with ServiceClient(url) as client:
        info = client.get_job(declared)
        assert (info.nodes, info.retention.keep_last) == (["a", "b"], 4)


def test_a_job_declared_by_hand_honours_the_clients_max_to_keep(root, sqlite_service):
    url, job = sqlite_service.live.url, f"byhand-{uuid.uuid4().hex[:6]}"
    with ServiceClient(url) as client:
        client.put_job(job, ["n0"], storage_root=root, retention={"keep_last": 50, "grace_seconds": 0})
    checkpointer = node(job, root, url, max_to_keep=2)
    checkpointer.start()
    for epoch in range(5):
        checkpointer.save(Position(epoch), arrays_for(epoch))
    checkpointer.close()
    with ServiceClient(url) as client:
        assert client.get_job(job).retention.keep_last == 2
    assert Store(root).list_positions(job, "n0") == [Position(3), Position(4)]


def test_retention_counts_mid_epoch_positions_so_storage_stays_bounded(root, sqlite_service):
    url, job = sqlite_service.live.url, f"midepoch-{uuid.uuid4().hex[:6]}"
    checkpointer = node(job, root, url, max_to_keep=3)
    checkpointer.start()
    for epoch in range(3):
        for batch in range(5, 45, 5):  # save_freq=5 over 44 batches
            checkpointer.save(Position(epoch, batch), arrays_for(batch))
        checkpointer.save(Position(epoch), arrays_for(epoch))
    checkpointer.close()
    kept = Store(root).list_positions(job, "n0")
    assert kept == [Position(2, 35), Position(2, 40), Position(2)], kept
    default = node(f"{job}-default", root, url)  # max_to_keep defaults to 5
    default.start()
    for batch in range(5, 105, 5):
        default.save(Position(0, batch), arrays_for(batch))
    default.close()
    assert len(Store(root).list_positions(f"{job}-default", "n0")) == 5


def test_health_says_ok_after_storage_recovers_and_for_nodes_that_never_failed(root, sqlite_service, moto_s3):
    url, job = sqlite_service.live.url, f"health-{uuid.uuid4().hex[:6]}"
    proxy = FaultProxy(moto_s3.endpoint_url)
    options = dict(moto_s3.options, endpoint_url=proxy.endpoint_url, config_kwargs={"retries": {"max_attempts": 1}})
    try:
        with ServiceClient(url) as client:
            client.put_job(job, ["flaky", "steady"], storage_root=f"s3://{moto_s3.bucket}/{job}")
        flaky = node(job, f"s3://{moto_s3.bucket}/{job}", url, "flaky", storage_options=options)
        steady = node(job, f"s3://{moto_s3.bucket}/{job}", url, "steady", storage_options=dict(moto_s3.options))
        flaky.start(), steady.start()
        steady.save(Position(0), arrays_for(0))
        proxy.rate, proxy.kinds = 1.0, ("503",)
        flaky.save(Position(0), arrays_for(0))
        with ServiceClient(url) as client:
            health = {h.node: h.cp_accessible for h in client.health(job).nodes}
            assert health == {"flaky": False, "steady": True}, "a node that only ever succeeded reports ok"
        proxy.rate = 0.0
        flaky.save(Position(1), arrays_for(1))
        with ServiceClient(url) as client:
            assert {h.node: h.cp_accessible for h in client.health(job).nodes}["flaky"] is True, "recovered"
        flaky.close(), steady.close()
    finally:
        proxy.stop()


def test_a_resume_prints_one_line_the_user_sees(root, capsys):
    first = node("visible", root, None)
    first.start()
    first.save(Position(2, 40), arrays_for(1))
    first.close()
    again = node("visible", root, None)
    restored = again.start()
    assert restored is not None and restored.copy.position == Position(2, 40)
    assert "resumed from" not in capsys.readouterr().err, "said only once the state is in place"
    again.resumed(restored, 0.1)
    err = capsys.readouterr().err
    assert "ckptstore: visible/n0 resumed from epoch 2 batch 40 (durable copy, attempt" in err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"storage": "s3:/ckpt/jobs"}, "did you mean 's3://"),
        ({"storage": "/tmp/x", "service": "localhost:8080"}, "invalid service URL"),
        ({"storage": "/tmp/x", "service": "http://[::1"}, "invalid service URL"),
        ({"storage": "/tmp/x", "local_storage": "file:/tmp"}, "not a URL"),
        ({"storage": "/tmp/x", "nodes": 0}, "count from 1"),
    ],
)
def test_typos_fail_at_construction_in_one_line(options, message):
    with pytest.raises(ValueError, match=message) as raised:
        CheckpointOptions.resolve(job="j", **options)
    assert "\n" not in str(raised.value)


def test_a_bad_job_name_is_invalid_before_any_request(sqlite_service):
    with pytest.raises(InvalidNameError):
        NodeCheckpointer(job="my job/1", storage="/tmp/x", service=sqlite_service.live.url)
    with pytest.raises(InvalidNameError), ServiceClient(sqlite_service.live.url) as client:
        client.last_good_epoch("bad/name")


def test_verify_and_last_good_use_the_exact_state_words(root, sqlite_service):
    url, job = sqlite_service.live.url, f"words-{uuid.uuid4().hex[:6]}"
    checkpointer = node(job, root, url, max_to_keep=None)
    checkpointer.start()
    for epoch in range(3):
        checkpointer.save(Position(epoch), arrays_for(epoch))
    checkpointer.delete(
        checkpointer.store.key(job, "n0", Position(2), checkpointer.attempt), cause="operator", reason="by hand"
    )
    checkpointer.close()
    shutil.rmtree(os.path.join(root, job, "n0", "0000000001"))
    result = subprocess.run(
        [sys.executable, "-m", "ckptstore.client.cli.main", "verify", job, "--url", url], capture_output=True, text=True
    )
    assert result.returncode == 1 and "MISSING (marked in the service)" in result.stdout, result.stdout
    assert "CORRUPT" not in result.stdout
    with ServiceClient(url) as client:
        answer = client.last_good_epoch(job)
        by_epoch = {n.epoch: n for n in answer.not_good}
        assert by_epoch[2].deleted == ["n0"] and by_epoch[2].missing == []
        assert by_epoch[1].missing == ["n0"]


def test_restoring_into_another_optimizer_says_what_differs_and_strict_false_loads_the_model(tmp_path, caplog):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    from ckptstore.client.tensorflow.manager import CheckpointManager
    from ckptstore.client.tensorflow.state import StateMismatchError

    def model(optimizer):
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
        m.compile(optimizer=optimizer, loss="mse")
        m.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
        return m

    def manager(m, **extra):
        objects = {"model": m, "optimizer": m.optimizer}
        return CheckpointManager(
            storage=str(tmp_path), job="opt", node="n0", objects=objects, async_save=False, **extra
        )

    saved = model(keras.optimizers.Adam())
    with manager(saved) as mgr:
        mgr.restore_or_initialize()
        mgr.save(0)
    with pytest.raises(StateMismatchError) as raised:
        manager(model(keras.optimizers.SGD())).restore_or_initialize()
    message = str(raised.value)
    assert "optimizer: the checkpoint has" in message and "momentum, velocity" in message and "strict=False" in message
    sgd = model(keras.optimizers.SGD())
    mgr = manager(sgd, strict=False)
    assert mgr.restore_or_initialize() == 1
    assert mgr.restore_report.notes and all(k.startswith("model/") for k in mgr.restore_report.restored)
    for a, b in zip(saved.variables, sgd.variables):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    with caplog.at_level("WARNING", logger="ckptstore.client"):
        manager(model(keras.optimizers.AdamW())).restore_or_initialize()
    assert "optimizer: the checkpoint was saved from adam, restoring into adam_w" in caplog.text
    assert "model: the checkpoint was saved" not in caplog.text, "renumbered layer names are no change"
