"""Keras `fit` over the everyday reshuffling pipeline — `from_tensor_slices(…).shuffle(N).batch(b)`,
which reshuffles each epoch — interrupted and fitted again: bit-equal to an uninterrupted fit at
every kill point (mid-epoch, at an epoch's last batch, right after an epoch's end; `save_freq=5` and
"epoch"). The pipeline's N-th iterator draws the N-th order, and a new process starts from N = 0:
the callback makes the iterators the saved run had made (the control below shows the resume is
not exact without that). The resume proof says `exact` mid-epoch — the batch before the position,
drawn again to skip it, is the saved run's — and `unverified` from an epoch's end (the next epoch's
order is drawn as its iterator is made); never `exact` of the control, which it refuses."""

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
    """Ends the fit (as a crash would) once batch `batch` of `epoch` is trained and the save in flight committed."""

    def __init__(self, backup: BackupAndRestore, epoch: int, batch: int):
        super().__init__()
        self.backup, self.epoch, self.batch, self.current = backup, epoch, batch, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

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
    "save_freq,interrupt,verdict",
    [(5, (1, 7), "exact"), (5, (1, BATCHES), "exact"), (5, (2, 1), "unverified"), ("epoch", (1, 7), "unverified")],
    ids=["mid-epoch", "at-an-epochs-last-batch", "right-after-an-epoch-end", "save-freq-epoch-mid-epoch"],
)
def test_a_reshuffling_pipeline_resumes_bit_exactly(tmp_path, uninterrupted, save_freq, interrupt, verdict, capsys):
    assert fit(str(tmp_path), save_freq, interrupt) is None
    resumed = fit(str(tmp_path), save_freq)
    assert_bit_equal(resumed, uninterrupted)
    err = capsys.readouterr().err
    assert f"resume audit: {verdict}" in err and "reshuffling order is the saved run's" in err, err[-2000:]
    if verdict == "exact":
        assert "fit's batch before the position (drawn again to skip it)" in err, err[-2000:]


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
