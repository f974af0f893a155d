"""Restoring Keras state in-process: mismatches are named, strict=False restores what fits,
float16/bfloat16 variables round-trip, and a restore ignores auto-generated layer names."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")

from ckptstore.client.tensorflow.manager import CheckpointManager  # noqa: E402
from ckptstore.client.tensorflow.state import StateMismatchError  # noqa: E402
from ckptstore.errors import CorruptCheckpointError  # noqa: E402


def model(width: int, dtype: str = "float32") -> keras.Model:
    m = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(width, dtype=dtype), keras.layers.Dense(1, dtype=dtype)]
    )
    m.compile(optimizer="adam", loss="mse")
    m.fit(np.ones((8, 4), "float32"), np.ones((8, 1), "float32"), verbose=0, epochs=1)
    return m


def manager(tmp_path, job: str, m: keras.Model, **kwargs) -> CheckpointManager:
    return CheckpointManager(
        storage=str(tmp_path),
        job=job,
        node="n0",
        objects={"model": m, "optimizer": m.optimizer},
        async_save=False,
        **kwargs,
    )


def test_a_mismatched_model_gets_an_error_naming_the_variable_and_both_shapes(tmp_path):
    saved = model(8)
    with manager(tmp_path, "mismatch", saved) as mgr:
        mgr.restore_or_initialize()
        mgr.save(0)
    with pytest.raises(
        StateMismatchError,
        match=r"model/00000: variable .*kernel.* is \(4, 16\) float32, "
        r"checkpoint has \(4, 8\) float32",
    ):
        manager(tmp_path, "mismatch", model(16)).restore_or_initialize()


def test_strict_false_restores_what_matches_and_reports_the_rest(tmp_path):
    saved = model(8)
    with manager(tmp_path, "partial", saved) as mgr:
        mgr.restore_or_initialize()
        mgr.save(0)
    other = model(16)
    mgr = manager(tmp_path, "partial", other, strict=False)
    assert mgr.restore_or_initialize() == 1
    report = mgr.restore_report
    assert report.mismatched and "model/00003" in report.restored  # the output bias (1,) fits
    np.testing.assert_array_equal(np.asarray(other.variables[3]), np.asarray(saved.variables[3]))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_variables_round_trip(tmp_path, dtype):
    saved = model(8, dtype)
    with manager(tmp_path, f"half-{dtype}", saved) as mgr:
        mgr.restore_or_initialize()
        mgr.save(0)
    keras.layers.Dense(3)  # shift auto-generated names
    restored = model(8, dtype)
    assert manager(tmp_path, f"half-{dtype}", restored).restore_or_initialize() == 1
    for a, b in zip(saved.variables + saved.optimizer.variables, restored.variables + restored.optimizer.variables):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_a_local_restore_writes_into_the_variables_own_memory_bit_exact(tmp_path):
    saved = model(64)
    with manager(tmp_path, "inplace", saved) as mgr:
        mgr.restore_or_initialize()
        mgr.save(0)
    expected = [v.numpy() for v in saved.variables + saved.optimizer.variables]
    fresh = model(64)

    def addresses() -> list[int]:  # of the buffers the variables hold (EagerTensor.numpy() would copy)
        return [np.asarray(v.value.read_value()).ctypes.data for v in fresh.variables]

    before = addresses()
    assert manager(tmp_path, "inplace", fresh).restore_or_initialize() == 1
    restored = [v.numpy() for v in fresh.variables + fresh.optimizer.variables]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(expected, restored))
    assert addresses() == before  # written into the variables' memory: no new buffers


def test_bytes_that_change_after_verification_are_refused(tmp_path):
    from ckptstore import Store
    from ckptstore.deferred import VerifiedTensors

    store = Store(str(tmp_path))
    arrays = {"w": np.arange(1 << 16, dtype="float32"), "b": np.ones(3, "float32")}
    ref = store.save("job", "n0", 0, arrays, attempt="1")
    loaded = store.read_copy(ref.key, deferred=True)
    assert isinstance(loaded.arrays, VerifiedTensors)
    assert loaded.arrays.spec("w") == ((1 << 16,), np.dtype("float32"))
    np.testing.assert_array_equal(loaded.arrays["b"], arrays["b"])
    shard = ref.shard_locations[0]
    with open(shard, "r+b") as handle:  # rewritten underneath, after the copy verified
        handle.seek(-8, os.SEEK_END)
        handle.write(b"\xff" * 8)
    targets = {name: np.zeros_like(a) for name, a in arrays.items()}
    with pytest.raises(CorruptCheckpointError, match="changed after it was verified"):
        loaded.arrays.read_into(targets)
