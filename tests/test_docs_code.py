"""The documented training loops, run as written (tests/docs_job.py): README's TensorFlow custom
loop over a reshuffling tf.data pipeline and docs/pytorch.md's plain PyTorch loop, each SIGKILLed
mid-epoch and run again, end bit-equal to an uninterrupted run, and their resume audit says exact."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from tests.job_runs import documented_block, run_job, settled_verdict


def run_block(tmp_path, block: str, job: str, kill_at: int | None = None) -> tuple[str, dict[str, np.ndarray]]:
    return run_job(
        "docs_job", tmp_path, "--block", block, "--storage", str(tmp_path / "ckpt"), "--job", job, kill_at=kill_at
    )


@pytest.mark.parametrize("block", ["tf-loop", "torch-loop", "jax-loop"])
def test_a_documented_loop_killed_mid_epoch_resumes_bit_exactly(block, tmp_path):
    if block == "torch-loop":
        pytest.importorskip("torch", reason="the [torch] extra is not installed")
    if block == "jax-loop":
        pytest.importorskip("optax", reason="the [jax] extra is not installed")
    _, baseline = run_block(tmp_path, block, f"base-{uuid.uuid4().hex[:6]}")
    job = f"killed-{uuid.uuid4().hex[:6]}"
    # Epoch 1, after its first mid-epoch save: batch 5 of 12 (tf, torch), batch 3 of 8 (jax).
    kill_at = int(np.random.default_rng().integers(*((12, 17) if block == "jax-loop" else (18, 25))))
    run_block(tmp_path, block, job, kill_at=kill_at)
    stderr, resumed = run_block(tmp_path, block, job)
    # A TensorFlow or JAX loop shows its batches (observe_batch); the torch loop's loader is watched.
    assert "resumed from epoch 1 batch" in stderr and settled_verdict(stderr) == "exact", stderr[-2000:]
    assert sorted(resumed) == sorted(baseline)
    for key, want in baseline.items():
        assert resumed[key].tobytes() == want.tobytes(), key


@pytest.mark.parametrize(
    "heading, doc, after",
    [
        ("### 3c. JAX", "docs/jax.md", "## A training loop"),
        ("### 3d. Hugging Face", "docs/hf.md", "## The callback"),
        ("### 3e. PyTorch Lightning", "docs/lightning.md", "## The callback"),
    ],
)
def test_the_readme_framework_blocks_are_the_documented_ones(heading, doc, after):
    """The README's blocks are the docs' blocks, which run as written (tests/docs_job.py, hf_job.py, lightning_job.py)."""
    assert documented_block("README.md", heading, {}) == documented_block(doc, after, {})
