"""Keras `fit` over a tf.data pipeline (`from_tensor_slices(…).shuffle(96).batch(8)`, reshuffling each
epoch unless told not to), interrupted as a crash would and fitted again — in this process: the
reshuffling tests (tests/test_keras_tfdata_resume.py) and the resume matrix (tests/test_resume_matrix.py)."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from ckptstore.client.keras import BackupAndRestore  # noqa: E402

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
    storage: str,
    save_freq: int | str,
    interrupt: tuple[int, int] | None = None,
    check: str = "raise",
    *,
    reshuffle: bool = True,
) -> list[np.ndarray] | None:
    """The fit, to its end (every weight and optimizer variable), or None once `interrupt` (epoch, batch)
    ended it; `reshuffle=False`: one shuffled order for every epoch."""
    keras.utils.set_random_seed(0)
    tf.config.experimental.enable_op_determinism()
    x = np.random.default_rng(1).standard_normal((96, 4)).astype(np.float32)
    pairs = tf.data.Dataset.from_tensor_slices((x, x.sum(axis=1, keepdims=True)))
    dataset = pairs.shuffle(96, reshuffle_each_iteration=reshuffle).batch(8)
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
