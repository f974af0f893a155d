"""Host staging buffers of async saves: prepared while the first epoch trains, page-aligned, reused by every save."""

from __future__ import annotations

import mmap

import numpy as np

from ckptstore.client.tensorflow.manager import CheckpointManager


def test_staging_is_prepared_at_start_and_every_save_copies_into_the_same_buffers(tmp_path):
    import tensorflow as tf

    weights = tf.Variable(np.arange(1 << 20, dtype=np.float32))
    step = tf.Variable(0, dtype=tf.int64)
    manager = CheckpointManager(job="staging", storage=str(tmp_path), objects={"w": weights, "step": step})
    assert manager.restore_or_initialize() == 0
    manager._staging_warm_up.join()
    prepared = dict(manager._staging)
    assert {key: (b.shape, b.dtype) for key, b in prepared.items()} == {
        "w/00000": ((1 << 20,), np.dtype(np.float32)),
        "step/00000": ((), np.dtype(np.int64)),
    }
    assert all(b.ctypes.data % mmap.PAGESIZE == 0 for b in prepared.values()), (
        "page-aligned: O_DIRECT writes them as they are"
    )
    for epoch in range(2):
        weights.assign_add(tf.ones_like(weights))
        step.assign(epoch)
        manager.save(epoch)
        manager.wait()
        assert all(manager._staging[key] is buffer for key, buffer in prepared.items()), "no new buffers"
        saved = manager.checkpointer.store.load(manager.checkpointer.job, manager.checkpointer.node, epoch)
        np.testing.assert_array_equal(saved["w/00000"], weights.numpy())
        assert int(saved["step/00000"]) == epoch
    manager.close()
