"""`ckptstore.client.jax.CheckpointManager`: a JAX/optax loop (tests/jax_job.py) SIGKILLed and run again ends
bit-equal to an uninterrupted run — on a new machine restoring from S3 (moto) with an empty local
tier, and past a corrupt newest copy (docs/jax.md's loop, killed mid-epoch on local disk, runs in
tests/test_docs_code.py); typed PRNG keys round-trip; a state
that does not fit is refused, or restored in part with strict=False."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the [jax] extra is not installed")
pytest.importorskip("optax", reason="the [jax] extra is not installed")

import jax.numpy as jnp  # noqa: E402

from ckptstore import Position, Store  # noqa: E402
from ckptstore.client.jax import CheckpointManager  # noqa: E402
from ckptstore.errors import ResumeDriftError  # noqa: E402
from tests.job_runs import assert_same, damage_own_blob, resumed_position, run_job  # noqa: E402

STEPS_PER_EPOCH = 8


def run(tmp_path, *args: str, kill_at: int | None = None) -> tuple[str, dict[str, np.ndarray]]:
    return run_job("jax_job", tmp_path, *args, kill_at=kill_at)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, np.ndarray]:
    tmp_path = tmp_path_factory.mktemp("jax-base")
    return run(tmp_path, "--storage", str(tmp_path / "ckpt"), "--job", "base")[1]


@pytest.mark.s3
def test_a_new_machine_restores_from_s3_with_an_empty_local_tier(tmp_path, moto_s3, uninterrupted):
    job = f"jax-{uuid.uuid4().hex[:8]}"
    durable = f"s3://{moto_s3.bucket}/{job}"
    tier = ["--storage", durable, "--endpoint", moto_s3.endpoint_url, "--job", job]
    run(tmp_path, *tier, "--local", str(tmp_path / "machine-a"), kill_at=2 * STEPS_PER_EPOCH + 2)
    stderr, final = run(tmp_path, *tier, "--local", str(tmp_path / "machine-b"))
    # The loop shows its batches (observe_batch): what the saved run trained after the save went to S3 with the copy.
    assert "durable copy" in stderr and "resume audit: exact" in stderr, stderr[-2000:]
    assert_same(final, uninterrupted, at_least=10)


def test_a_corrupt_newest_copy_is_fallen_back_from(tmp_path, uninterrupted):
    storage = str(tmp_path / "ckpt")
    run(tmp_path, "--storage", storage, "--job", "damaged", kill_at=2 * STEPS_PER_EPOCH + 5)
    newest = Store(storage).latest("damaged", "n0")
    assert newest == Position(2, 3)  # saves at batches 3 and 6 of each epoch: steps 19 and 22
    damage_own_blob(storage, "damaged", newest, Position(1))
    stderr, final = run(tmp_path, "--storage", storage, "--job", "damaged")
    assert resumed_position(stderr) < newest, stderr[-2000:]
    assert_same(final, uninterrupted, at_least=10)


def test_typed_and_raw_prng_keys_and_python_leaves_round_trip(tmp_path):
    state = {
        "key": jax.random.key(7),
        "keys": jax.random.split(jax.random.key(8), 3),
        "raw": jax.random.PRNGKey(9),
        "bf16": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3),
        "count": 5,
        "host": np.arange(3, dtype=np.int16),
    }
    options = {"storage": str(tmp_path), "job": "keys", "node": "n0"}
    with CheckpointManager(**options) as mgr:
        assert mgr.restore_or_initialize(state) == (0, state)
        mgr.save(0, state)
    blank = jax.tree_util.tree_map(lambda leaf: leaf, state)
    blank.update(key=jax.random.key(0), keys=jax.random.split(jax.random.key(0), 3), count=0)
    with CheckpointManager(**options) as mgr:
        epoch, restored = mgr.restore_or_initialize(blank)
    assert epoch == 1 and restored["count"] == 5 and type(restored["count"]) is int
    for name in ("key", "keys"):
        assert jax.dtypes.issubdtype(restored[name].dtype, jax.dtypes.prng_key)
        assert (jax.random.key_data(restored[name]) == jax.random.key_data(state[name])).all()
    assert restored["raw"].dtype == jnp.uint32 and (restored["raw"] == state["raw"]).all()
    assert restored["bf16"].dtype == jnp.bfloat16 and (restored["bf16"] == state["bf16"]).all()
    assert isinstance(restored["host"], np.ndarray) and restored["host"].tolist() == [0, 1, 2]
    # The next draw from the restored key is the saved run's.
    assert (jax.random.normal(restored["key"], (4,)) == jax.random.normal(state["key"], (4,))).all()


def test_a_state_that_does_not_fit_is_refused_or_restored_in_part(tmp_path):
    options = {"storage": str(tmp_path), "job": "fit", "node": "n0"}
    saved = {"w": jnp.ones((2, 3)), "b": jnp.full(3, 2.0)}
    with CheckpointManager(**options) as mgr:
        mgr.restore_or_initialize(saved)
        mgr.save(0, saved)
    other = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
    with pytest.raises(ResumeDriftError, match=r"w'\] \(2, 3\) float32 → \(4, 3\) float32"):
        with CheckpointManager(resume_check="raise", **options) as mgr:
            mgr.restore_or_initialize(other)
    with pytest.raises(ValueError, match="does not fit 1 leaves"):
        with CheckpointManager(resume_check="off", **options) as mgr:
            mgr.restore_or_initialize(other)
    with CheckpointManager(resume_check="off", strict=False, **options) as mgr:
        _, restored = mgr.restore_or_initialize(other)
    assert restored["w"].shape == (4, 3) and (restored["w"] == 0).all() and (restored["b"] == 2).all()
