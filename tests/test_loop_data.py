"""A loop that picks its batches from (epoch, batch) — TensorFlow's MultiWorkerMirroredStrategy
tutorial loop does — declares how with `data=` on the TF manager, as on the JAX one: a mid-epoch
resume of the same loop is audited `exact` and trains bit-equal to an uninterrupted run; without
`data=` the audit says it cannot see the data position (drift); a declared batch size that changed
is named."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from ckptstore.client.tensorflow import CheckpointManager  # noqa: E402
from ckptstore.errors import ResumeDriftError  # noqa: E402

SAMPLES, BATCH, EPOCHS = 64, 8, 2
BATCHES = SAMPLES // BATCH


def batch_at(epoch: int, batch: int, size: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    """The tutorial's way: the data order is a function of (epoch, batch) alone."""
    order = np.random.default_rng(epoch).permutation(SAMPLES)[batch * size : (batch + 1) * size]
    x = np.random.default_rng(7).normal(size=(SAMPLES, 4)).astype(np.float32)[order]
    return x, x.sum(axis=1, keepdims=True)


def train(
    root: str,
    job: str,
    *,
    stop_at: tuple[int, int] | None = None,
    data=None,
    size: int = BATCH,
    resume_check: str = "warn",
):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam(1e-2)
    manager = CheckpointManager(objects={"model": model, "optimizer": optimizer}, storage=root, job=job, node="n0",
                                async_save=False, data=data, resume_check=resume_check)  # fmt: skip
    start = manager.restore_or_initialize()
    first = manager.first_batch(start)
    for epoch in range(start, EPOCHS):
        for batch in range(first if epoch == start else 0, BATCHES):
            if (epoch, batch) == stop_at:
                manager.close()
                return manager, None
            x, y = batch_at(epoch, batch, size)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            manager.save(epoch, batch=batch + 1)
        manager.save(epoch)
    manager.close()
    return manager, [v.numpy() for v in model.weights]


DECLARED = {"seed": 7, "batch_size": BATCH, "length": SAMPLES, "shuffle": True}


def test_a_declared_loop_resumes_mid_epoch_bit_equal_and_unverified_never_exact(tmp_path):
    """`data=` is compared, not observed: the proof cannot see the loop's batches."""
    _, want = train(str(tmp_path / "base"), "base", data=DECLARED)
    root, job = str(tmp_path / "ckpt"), f"loop-{uuid.uuid4().hex[:6]}"
    train(root, job, stop_at=(1, 3), data=DECLARED)
    manager, got = train(root, job, data=DECLARED)
    assert manager.audit.verdict == "unverified", manager.audit
    assert any("does not see the batches a TensorFlow loop draws" in d for d in manager.audit.differences)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_without_data_the_same_resume_is_not_called_exact_and_is_refused_mid_epoch_under_raise(tmp_path):
    root, job = str(tmp_path / "ckpt"), f"loop-{uuid.uuid4().hex[:6]}"
    train(root, job, stop_at=(1, 3))
    manager, _ = train(root, job)
    assert manager.audit.verdict == "unverified"
    refused = f"loop-{uuid.uuid4().hex[:6]}"
    train(root, refused, stop_at=(1, 3))
    with pytest.raises(ResumeDriftError, match="a mid-epoch resume it cannot verify"):
        train(root, refused, resume_check="raise")


def test_a_declared_batch_size_that_changed_is_named(tmp_path):
    root, job = str(tmp_path / "ckpt"), f"loop-{uuid.uuid4().hex[:6]}"
    train(root, job, stop_at=(1, 3), data=DECLARED)
    manager, _ = train(root, job, data=DECLARED | {"batch_size": 4}, size=4)
    assert manager.audit.verdict == "drift"
    assert any("batch size 8 → 4" in d for d in manager.audit.differences), manager.audit.differences
