"""A loop that picks its batches from (epoch, batch) — TensorFlow's MultiWorkerMirroredStrategy
tutorial loop does — declares how with `data=` on the TF manager, as on the JAX one, and shows the
resume proof its batches with `observe_batch`: resumed mid-epoch and from an epoch's end it is proven
`exact` (its first batch is the one the saved run trained after the save) and trains bit-equal to an
uninterrupted run; a loop that draws another order after the restore is `drift`; one that shows no
batches is `unverified`, never exact, and refused mid-epoch under raise; a declared batch size that
changed is named."""

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
    observe: bool = True,
    first_epoch_order: int | None = None,
):
    """`first_epoch_order`: the resumed epoch's batches are drawn in that epoch's order instead (a bug)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam(1e-2)
    manager = CheckpointManager(objects={"model": model, "optimizer": optimizer}, storage=root, job=job, node="n0",
                                async_save=False, data=data, resume_check=resume_check)  # fmt: skip
    start = manager.restore_or_initialize()
    first = manager.first_batch(start)
    for epoch in range(start, EPOCHS):
        for batch in range(first if epoch == start else 0, BATCHES):
            order = first_epoch_order if first_epoch_order is not None and epoch == start else epoch
            x, y = batch_at(order, batch, size)
            if observe:
                manager.observe_batch((x, y))
            if (epoch, batch) == stop_at:  # the job is lost as it trains this batch
                manager.close()
                return manager, None
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            manager.save(epoch, batch=batch + 1)
        manager.save(epoch)
    manager.close()
    return manager, [v.numpy() for v in model.weights]


DECLARED = {"seed": 7, "batch_size": BATCH, "length": SAMPLES, "shuffle": True}


@pytest.mark.parametrize("stop_at", [(1, 3), (1, 0)], ids=["mid-epoch", "right-after-an-epoch-end"])
def test_a_loop_that_shows_its_batches_is_proven_exact_and_bit_equal(tmp_path, stop_at):
    _, want = train(str(tmp_path / "base"), "base", data=DECLARED)
    root, job = str(tmp_path / "ckpt"), f"loop-{uuid.uuid4().hex[:6]}"
    train(root, job, stop_at=stop_at, data=DECLARED)
    manager, got = train(root, job, data=DECLARED)
    assert manager.audit.verdict == "exact", manager.audit
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_loop_that_draws_another_order_after_the_restore_is_drift_and_refused_under_raise(tmp_path):
    root, job = str(tmp_path / "ckpt"), f"loop-{uuid.uuid4().hex[:6]}"
    train(root, job, stop_at=(1, 3), data=DECLARED)
    with pytest.raises(ResumeDriftError, match="is not the one the saved run trained after the save"):
        train(root, job, data=DECLARED, first_epoch_order=0, resume_check="raise")
    manager, _ = train(root, job, data=DECLARED, first_epoch_order=0)
    assert manager.audit.verdict == "drift", manager.audit


def test_a_loop_that_shows_no_batches_is_unverified_never_exact(tmp_path):
    _, want = train(str(tmp_path / "base"), "base", data=DECLARED)
    root, job = str(tmp_path / "ckpt"), f"loop-{uuid.uuid4().hex[:6]}"
    train(root, job, stop_at=(1, 3), data=DECLARED, observe=False)
    manager, got = train(root, job, data=DECLARED, observe=False)
    assert manager.audit.verdict == "unverified", manager.audit
    assert any("manager.observe_batch(batch)" in d for d in manager.audit.differences), manager.audit
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), "the premise: bit-equal"


def test_without_data_the_same_resume_is_not_called_exact_and_is_refused_mid_epoch_under_raise(tmp_path):
    root, job = str(tmp_path / "ckpt"), f"loop-{uuid.uuid4().hex[:6]}"
    train(root, job, stop_at=(1, 3), observe=False)
    manager, _ = train(root, job, observe=False)
    assert manager.audit.verdict == "unverified"
    refused = f"loop-{uuid.uuid4().hex[:6]}"
    train(root, refused, stop_at=(1, 3), observe=False)
    with pytest.raises(ResumeDriftError, match="a mid-epoch resume it cannot verify"):
        train(root, refused, resume_check="raise", observe=False)


def test_a_declared_batch_size_that_changed_is_named(tmp_path):
    root, job = str(tmp_path / "ckpt"), f"loop-{uuid.uuid4().hex[:6]}"
    train(root, job, stop_at=(1, 3), data=DECLARED)
    manager, _ = train(root, job, data=DECLARED | {"batch_size": 4}, size=4)
    assert manager.audit.verdict == "drift"
    assert any("batch size 8 → 4" in d for d in manager.audit.differences), manager.audit.differences
