"""Failure behaviour inside a real Keras fit (TensorFlow on CPU, in this process): the service going
away and coming back, the object store going away, and a zombie attempt being fenced."""

from __future__ import annotations

import logging
import uuid

import pytest

from ckptstore.errors import FencedError
from tests.conftest import service_settings
from tests.live import LiveService, ScratchPostgres, postgres_available
from tests.servers import MotoS3


def fit(callback, *extra, epochs: int = 6, extra_callbacks=()):
    """The deterministic tiny job of tests.train_job, in this process (`extra`: hooks called with each
    epoch as it begins)."""
    import keras

    from tests.train_job import BATCH, data, make_model

    class Hooks(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            for hook in extra:
                hook(epoch)

    model = make_model()
    model.fit(
        *data(),
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[callback, Hooks(), *extra_callbacks],
    )
    return model


def test_service_down_mid_training_commits_arrive_after_it_returns(tmp_path):
    from ckptstore.client import ServiceClient
    from ckptstore.client.keras import BackupAndRestore

    settings = service_settings(str(tmp_path), f"sqlite:///{tmp_path}/svc.db")
    live = LiveService(settings)
    port, job = live.port, f"outage-{uuid.uuid4().hex[:6]}"
    callback = BackupAndRestore(
        storage=settings.default_storage, service=live.url, job=job, node="n0", delete_checkpoint=False
    )
    state = {"live": live}

    def outage(epoch):
        if epoch == 2:  # epochs 0 and 1 are committed; 2 and 3 are saved while the service is away
            state["live"].stop()
        if epoch == 4:
            state["live"] = LiveService(settings, port=port)

    fit(callback, outage)
    callback.checkpointer.close()
    try:
        with ServiceClient(state["live"].url) as client:
            committed = [(c.epoch, c.attempt) for c in client.list_checkpoints(job)]
            assert committed == [(e, "1") for e in range(6)], "every save committed exactly once"
            assert client.last_good_epoch(job).epoch == 5
    finally:
        state["live"].stop()


def test_a_fit_whose_replica_dies_goes_on_through_the_other_with_every_commit_once(tmp_path):
    """Two replicas over one PostgreSQL; the client knows both; the one it uses stops at epoch 2."""
    from ckptstore.client import ServiceClient
    from ckptstore.client.keras import BackupAndRestore

    if not postgres_available():
        pytest.fail("PostgreSQL is not reachable on 127.0.0.1:5432 and could not be started")
    database = ScratchPostgres()
    settings = service_settings(str(tmp_path), database.url)
    replicas = [LiveService(settings), LiveService(settings)]
    job = f"failover-{uuid.uuid4().hex[:6]}"
    callback = BackupAndRestore(
        storage=settings.default_storage,
        service=[r.url for r in replicas],
        job=job,
        node="n0",
        delete_checkpoint=False,
    )

    def kill_first(epoch):
        if epoch == 2:
            replicas[0].stop()

    try:
        fit(callback, kill_first)
        callback.checkpointer.close()
        with ServiceClient(replicas[1].url) as client:
            committed = [(c.epoch, c.attempt) for c in client.list_checkpoints(job)]
            assert committed == [(e, "1") for e in range(6)], "every save committed exactly once"
            assert client.last_good_epoch(job).epoch == 5
    finally:
        for replica in replicas:
            replica.stop()
        database.drop()


def test_storage_down_saves_are_skipped_training_completes_and_health_says_so(tmp_path, sqlite_service, caplog, capsys):
    from ckptstore.client import ServiceClient
    from ckptstore.client.keras import BackupAndRestore

    moto = MotoS3()  # its own server: stopping it must not take the session's S3 away
    options = moto.options | {"config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    job = f"s3down-{uuid.uuid4().hex[:6]}"
    callback = BackupAndRestore(
        storage=f"s3://{moto.bucket}/{job}",
        storage_options=options,
        service=sqlite_service.live.url,
        job=job,
        node="n0",
        delete_checkpoint=False,
    )

    def outage(epoch):
        if epoch == 3:
            callback.checkpointer.wait()
            moto.stop()

    with caplog.at_level(logging.WARNING, logger="ckptstore.client"):
        model = fit(callback, outage)
    callback.checkpointer.close()
    assert model.optimizer.iterations.numpy() == 6 * 12, "training ran to the end"
    # Epoch 3's save retries the store (in the background); 4 and 5 are skipped rather than waited behind
    # it; the end of the fit waits for it a little, then gives up on it and says so.
    assert callback.checkpointer.skipped_saves == 3, "the saves of epochs 3, 4, 5 were not committed"
    skipped = [r.message for r in caplog.records if "skipped: the save at epoch 3 is still retrying" in r.message]
    assert skipped and "save at epoch 4 skipped" in skipped[0]
    assert "ckptstore: " + job + "/n0: 3 of 6 saves committed, 3 skipped" in capsys.readouterr().err
    with ServiceClient(sqlite_service.live.url) as client:
        assert [c.epoch for c in client.list_checkpoints(job)] == [0, 1, 2]
        assert client.last_good_epoch(job).epoch == 2
        health = client.health(job)
        node = next(n for n in health.nodes if n.node == "n0")
        assert node.cp_accessible is False and node.error


def test_a_zombie_attempt_is_fenced_and_its_training_stops(tmp_path, sqlite_service):
    from ckptstore.client import ServiceClient
    from ckptstore.client.keras import BackupAndRestore

    job = f"zombie-{uuid.uuid4().hex[:6]}"
    callback = BackupAndRestore(
        storage=sqlite_service.storage, service=sqlite_service.live.url, job=job, node="n0", delete_checkpoint=False
    )
    client = ServiceClient(sqlite_service.live.url)

    def newer_process_starts(epoch):
        if epoch == 2:  # a replacement of this node registers while this process still trains
            callback.checkpointer.wait()
            client.start_attempt(job, "n0")

    with pytest.raises(FencedError, match="fenced"):
        fit(callback, newer_process_starts)
    assert [c.epoch for c in client.list_checkpoints(job)] == [0, 1], "nothing committed after the fence"
    client.close()
