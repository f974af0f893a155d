"""Keras `fit` over the everyday reshuffling pipeline — `from_tensor_slices(…).shuffle(N).batch(b)`,
which reshuffles each epoch — interrupted and fitted again: bit-equal to an uninterrupted fit at
every kill point (mid-epoch, at an epoch's last batch, right after an epoch's end; `save_freq=5` and
"epoch"). The pipeline's N-th iterator draws the N-th order, and a new process starts from N = 0:
the callback makes the iterators the saved run had made (the control below shows the resume is
not exact without that). The resume proof says `exact` mid-epoch — the batch before the position,
drawn again to skip it, is the saved run's — and from an epoch's end — the first batch trained is
the one the saved run trained after the save (recorded late, beside the copy); never `exact` of the
controls, which it refuses or calls drift."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from ckptstore.client.keras import BackupAndRestore, _DataIterations  # noqa: E402

EPOCHS, BATCHES = 3, 12  # 96 samples in batches of 8


class Interrupted(Exception):
    pass


class InterruptAt(keras.callbacks.Callback):
    """Ends the fit (as a crash would) once batch `batch` of `epoch` is trained (0: as the epoch begins)
    and the save in flight committed."""

    def __init__(self, backup: BackupAndRestore, epoch: int, batch: int):
        super().__init__()
        self.backup, self.epoch, self.batch, self.current = backup, epoch, batch, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch
        if (epoch, 0) == (self.epoch, self.batch):  # right after an epoch's end, before a batch trains
            self.backup.manager.wait()
            raise Interrupted

    def on_train_batch_end(self, batch, logs=None):
        if (self.current, batch + 1) == (self.epoch, self.batch):
            self.backup.manager.wait()
            raise Interrupted


def fit(
    storage: str, save_freq: int | str, interrupt: tuple[int, int] | None = None, check: str = "raise"
) -> list[np.ndarray] | None:
    keras.utils.set_random_seed(0)
    tf.config.experimental.enable_op_determinism()
    x = np.random.default_rng(1).standard_normal((96, 4)).astype(np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((x, x.sum(axis=1, keepdims=True))).shuffle(96).batch(8)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    backup = BackupAndRestore(storage=storage, job="tfdata", save_freq=save_freq, resume_check=check)
    callbacks = [backup] + ([InterruptAt(backup, *interrupt)] if interrupt else [])
    try:
        model.fit(dataset, epochs=EPOCHS, callbacks=callbacks, verbose=0)
    except Interrupted:
        return None
    return [np.array(v) for v in model.weights + model.optimizer.variables]


def assert_bit_equal(resumed: list[np.ndarray], uninterrupted: list[np.ndarray]) -> None:
    assert len(resumed) == len(uninterrupted)
    differing = [i for i, (a, b) in enumerate(zip(resumed, uninterrupted, strict=True)) if a.tobytes() != b.tobytes()]
    assert not differing, f"{len(differing)}/{len(resumed)} arrays differ"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return fit(str(tmp_path_factory.mktemp("tfdata-base")), "epoch")


@pytest.mark.parametrize(
    "save_freq,interrupt,resumed_at",
    [(5, (1, 7), "mid"), (5, (1, BATCHES), "mid"), (5, (2, 1), "end"), ("epoch", (1, 7), "end")],
    ids=["mid-epoch", "at-an-epochs-last-batch", "right-after-an-epoch-end", "save-freq-epoch-mid-epoch"],
)
def test_a_reshuffling_pipeline_resumes_bit_exactly(tmp_path, uninterrupted, save_freq, interrupt, resumed_at, capsys):
    assert fit(str(tmp_path), save_freq, interrupt) is None
    resumed = fit(str(tmp_path), save_freq)
    assert_bit_equal(resumed, uninterrupted)
    err = capsys.readouterr().err
    assert "resume audit: exact" in err and "reshuffling order is the saved run's" in err, err[-2000:]
    seen = "batch before the position (drawn again to skip it)" if resumed_at == "mid" else "first batch (the one the"
    assert f"proven: fit's {seen}" in err, err[-2000:]


def test_from_an_epochs_end_another_first_batch_is_drift_and_no_record_is_unverified(
    tmp_path, uninterrupted, monkeypatch, capsys
):
    """The controls from an epoch's end: the catching up switched off, the resumed epoch draws another
    order than the saved run trained after the save — drift, not bit-equal; a run interrupted right at
    its epoch-end save (before it trained a batch after it) left no record — unverified, never exact."""
    assert fit(str(tmp_path / "a"), "epoch", (1, 1)) is None
    monkeypatch.setattr(_DataIterations, "catch_up", lambda self, saved: 0)
    with pytest.raises(AssertionError, match="arrays differ"):
        assert_bit_equal(fit(str(tmp_path / "a"), "epoch", check="warn"), uninterrupted)
    err = capsys.readouterr().err
    assert "resume audit: DRIFT" in err and "is not the one the saved run trained after the save" in err, err[-2000:]
    monkeypatch.undo()
    assert fit(str(tmp_path / "b"), "epoch", (1, 0)) is None
    assert_bit_equal(fit(str(tmp_path / "b"), "epoch", check="warn"), uninterrupted)
    err = capsys.readouterr().err
    assert "resume audit: unverified" in err and "recorded nothing it drew after it" in err, err[-2000:]


def test_without_making_the_saved_runs_iterators_the_resume_is_drift_never_exact(
    tmp_path, uninterrupted, monkeypatch, capsys
):
    """The control: the same resume with the catching up switched off draws epoch 0's order again —
    not bit-equal, said as drift, and refused under resume_check="raise" before a batch trains."""
    monkeypatch.setattr(_DataIterations, "catch_up", lambda self, saved: 0)
    assert fit(str(tmp_path), 5, (1, 7)) is None
    from ckptstore.errors import ResumeDriftError

    with pytest.raises(ResumeDriftError, match="the batch before the resumed position"):
        fit(str(tmp_path), 5)
    resumed = fit(str(tmp_path), 5, check="warn")
    with pytest.raises(AssertionError, match="arrays differ"):
        assert_bit_equal(resumed, uninterrupted)
    err = capsys.readouterr().err
    assert "resume audit: DRIFT" in err and "resume audit: exact" not in err, err[-2000:]
