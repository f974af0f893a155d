"""Save cadences (client/engine/cadence.py): every N batches across `steps_per_execution` jumps and resumes,
each epoch, every N seconds, continuous, and "auto" — the service's Young/Daly interval, followed by a
real Keras fit once the job has failed twice; under torch.distributed the ranks agree on every save."""

from __future__ import annotations

import time
import uuid

import pytest

from ckptstore import Position
from ckptstore.client.engine.cadence import MAX_OVERHEAD, SaveCadence
from ckptstore.wire.schema import Advice


def due(cadence: SaveCadence, epoch: int, batch: int | None, *, writing: bool = False) -> bool:
    return cadence.due(Position(epoch, batch), writing=writing)


def test_every_n_batches_saves_where_a_multiple_is_crossed_and_at_every_epoch_end():
    cadence = SaveCadence(4)
    assert [b for b in range(1, 12) if due(cadence, 0, b)] == [4, 5, 6, 7, 8, 9, 10, 11], "until a save is made"
    cadence.saved(Position(0, 6))  # steps_per_execution=3: the callback sees 3, 6, 9 — 6 crosses 4
    assert not due(cadence, 0, 7) and due(cadence, 0, 9)
    assert due(cadence, 0, None), "every epoch's end"
    cadence.saved(Position(0, None))
    assert not due(cadence, 1, 3) and due(cadence, 1, 4), "a new epoch counts from its start"
    cadence.restart(Position(2, 4))
    assert not due(cadence, 2, 6) and due(cadence, 2, 8), "a resume counts from the resumed batch"


def test_epoch_seconds_and_continuous_cadences():
    epoch = SaveCadence("epoch")
    assert not due(epoch, 0, 5) and due(epoch, 0, None)
    timed = SaveCadence(None, 0.2)
    assert not due(timed, 0, 1) and not due(timed, 0, None), "not before its seconds"
    time.sleep(0.25)
    assert due(timed, 0, 2)
    timed.saved(Position(0, 2))
    assert not due(timed, 0, 3)
    beside = SaveCadence("epoch", 0.2)
    assert due(beside, 0, None) and not due(beside, 0, 1)
    continuous = SaveCadence("continuous")
    assert due(continuous, 0, 1) and not due(continuous, 0, 2, writing=True)
    assert SaveCadence().due(Position(0, 3), writing=True), "no cadence: every call saves"


def advice(interval: float | None, cost: float | None = 1.0) -> Advice:
    mtbf = None if interval is None else 1000.0
    return Advice(job="j", failures=3, mtbf_seconds=mtbf, save_cost_seconds=cost, interval_seconds=interval)


def test_auto_saves_each_epoch_and_within_epochs_the_bounded_recommendation():
    auto = SaveCadence("auto")
    assert due(auto, 0, None) and not due(auto, 0, 5) and auto.interval_seconds() is None
    auto.advice = advice(None)
    assert due(auto, 0, None) and auto.interval_seconds() is None, "fewer than 2 failures: each epoch"
    auto.advice = advice(10.0, cost=1.0)
    assert auto.interval_seconds() == 1.0 / MAX_OVERHEAD, "never above MAX_OVERHEAD of the time"
    auto.advice = advice(60.0, cost=0.5)
    assert auto.interval_seconds() == 60.0
    assert due(auto, 3, None), "an epoch's end stays due with a recommendation: the final model is kept"
    assert not due(auto, 3, 5), "within an epoch, the interval decides"
    capped = SaveCadence("auto", 30.0)
    capped.advice = advice(60.0, cost=0.5)
    assert capped.interval_seconds() == 30.0, "never slower than the user's save_every_seconds"


@pytest.mark.parametrize("every", [0, -3, True, "sometimes", 2.5])
def test_a_bad_cadence_is_refused(every):
    with pytest.raises(ValueError, match="save_every"):
        SaveCadence(every)


@pytest.mark.parametrize("seconds", [0, -1, "10"])
def test_bad_seconds_are_refused(seconds):
    with pytest.raises(ValueError, match="save_every_seconds"):
        SaveCadence(None, seconds)


def test_continuous_takes_no_seconds():
    with pytest.raises(ValueError, match="continuous"):
        SaveCadence("continuous", 5)


def torch_loop(tmp_path, batches: int, pause: float, **cadence) -> tuple[list[tuple[Position, float]], object]:
    """A PyTorch loop that calls save() after every batch; what it saved, and when, and its manager."""
    torch = pytest.importorskip("torch")
    from ckptstore.client.torch import CheckpointManager

    model = torch.nn.Linear(64, 64)
    manager = CheckpointManager(objects={"model": model}, storage=str(tmp_path), job="timed", node="n0", **cadence)
    manager.restore_or_initialize()
    saved = []
    for batch in range(1, batches + 1):
        time.sleep(pause)
        if manager.save(0, batch=batch):
            saved.append((Position(0, batch), time.monotonic()))
    manager.close()
    return saved, manager


def test_the_time_policy_saves_on_time(tmp_path):
    from ckptstore import Store

    began = time.monotonic()
    saved, _ = torch_loop(tmp_path, 40, 0.025, save_every_seconds=0.3)
    moments = [began] + [at for _, at in saved]
    assert len(saved) >= 2, saved
    assert all(later - earlier >= 0.3 for earlier, later in zip(moments, moments[1:])), moments
    on_storage = {i.key.position for i in Store(str(tmp_path)).list_checkpoints("timed", "n0") if i.committed}
    assert on_storage == {position for position, _ in saved}, "what save() said it saved is what is on storage"


def test_continuous_starts_each_save_once_the_previous_is_committed(tmp_path):
    from ckptstore import Store

    saved, manager = torch_loop(tmp_path, 30, 0.01, save_every="continuous")
    assert len(saved) >= 3, saved
    assert manager.checkpointer.skipped_saves == 0, "a continuous save never waits behind one in flight"
    on_storage = {i.key.position for i in Store(str(tmp_path)).list_checkpoints("timed", "n0") if i.committed}
    assert on_storage == {position for position, _ in saved}


def test_keras_auto_saves_each_epoch_on_a_fresh_job_and_follows_the_interval_after_two_failures(
    tmp_path, sqlite_service
):
    """Three fits of one job in this process — each a new attempt, so the job has failed twice when the
    third starts; batches are slowed so that an epoch lasts longer than the interval the service gives."""
    import keras

    from ckptstore.client import ServiceClient
    from ckptstore.client.keras import BackupAndRestore
    from tests.test_fit_outages import fit

    class Slow(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.1)

    job = f"auto-{uuid.uuid4().hex[:6]}"
    callbacks = []
    for epochs in (2, 3, 5):
        callback = BackupAndRestore(
            storage=f"{sqlite_service.storage}/{job}",
            service=sqlite_service.live.url,
            job=job,
            node="n0",
            save_freq="auto",
            delete_checkpoint=False,
        )
        callbacks.append(callback)
        fit(callback, epochs=epochs, extra_callbacks=[Slow()])
    with ServiceClient(sqlite_service.live.url) as client:
        committed = [(c.attempt, c.epoch, c.batch) for c in client.list_checkpoints(job)]
        recommended = client.advice(job)
    assert [(e, b) for a, e, b in committed if a in ("1", "2")] == [(0, None), (1, None), (2, None)], committed
    assert callbacks[0].manager.cadence.interval_seconds() is None, "no history: each epoch"
    assert recommended.failures == 2 and recommended.interval_seconds is not None
    interval = callbacks[2].manager.cadence.interval_seconds()
    assert interval is not None and interval < 1.0, interval  # 12 batches of ≥ 0.1 s: an epoch lasts ≥ 1.2 s
    third = [(e, b) for a, e, b in committed if a == "3"]
    assert any(b is not None for _, b in third), f"the third fit saves mid-epoch on the interval: {third}"
    assert {e for e, b in third if b is None} == {3, 4}, f"and every epoch's end, the final model's too: {third}"
    with ServiceClient(sqlite_service.live.url) as client:
        assert client.last_good_epoch(job).epoch == 4


@pytest.mark.slow  # a long run: scripts/test.sh -m slow runs it (the default run stays near 30 minutes)
def test_ddp_ranks_agree_on_every_timed_save_and_resume_exactly(tmp_path, sqlite_service):
    pytest.importorskip("torch")
    from tests.test_torch import assert_bit_equal, final, ranks

    common = ["--storage", f"{sqlite_service.storage}/timed-{uuid.uuid4().hex[:6]}", "--service"]
    common += [sqlite_service.live.url, "--loader", "shuffle-gen", "--save-every-seconds", "0.01"]
    baseline = ranks(tmp_path, 2, *common, "--job", f"timed-base-{uuid.uuid4().hex[:6]}")
    job = ["--job", f"timed-{uuid.uuid4().hex[:6]}"]
    ranks(tmp_path, 2, *common, *job, "--kill-epoch", "1", "--kill-batch", "8", killed_rank=0)
    resumed = ranks(tmp_path, 2, *common, *job)
    firsts = [r.splitlines()[0] for r in resumed]
    assert firsts[0] == firsts[1] and firsts[0].startswith("RESUMED"), firsts
    for got, want in zip(resumed, baseline, strict=True):
        assert_bit_equal(final(got), final(want))
