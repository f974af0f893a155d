"""`ckptstore.client.hf.BackupAndRestore`: a Hugging Face `Trainer` (a 2-layer GPT-2 from a config, dropout on,
the Trainer's shuffled sampler; tests/hf_job.py) SIGKILLed mid-epoch and run again with a plain
`trainer.train()` ends bit-equal to an uninterrupted run — with the Trainer's own output folder gone
(a new machine), and past a corrupt newest copy; checkpoint folders round-trip byte for byte."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers", reason="the [hf] extra is not installed")
pytest.importorskip("accelerate", reason="the [hf] extra is not installed")

from ckptstore import Position, Store  # noqa: E402
from ckptstore.client.hf import pack_folder, unpack_folder  # noqa: E402
from tests.job_runs import assert_same, damage_own_blob, resumed_position, run_job  # noqa: E402

STEPS_PER_EPOCH = 12  # 96 sequences, batches of 8; a checkpoint every 3 steps


def run(tmp_path, job: str, kill_at: int | None = None) -> tuple[str, dict[str, np.ndarray]]:
    return run_job("hf_job", tmp_path, "--storage", str(tmp_path / "ckpt"), "--job", job, kill_at=kill_at)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, np.ndarray]:
    return run(tmp_path_factory.mktemp("hf-base"), "base")[1]


@pytest.mark.parametrize(
    "kill_at,resumed",
    [
        (STEPS_PER_EPOCH + 5, Position(1, 3)),
        (2 * STEPS_PER_EPOCH - 2, Position(1, 9)),
        (2 * STEPS_PER_EPOCH + 1, Position(1)),
    ],
    ids=["mid-epoch", "near-its-end", "right-after-an-epoch-end"],
)
def test_a_trainer_killed_on_a_machine_that_is_gone_resumes_bit_exactly(tmp_path, uninterrupted, kill_at, resumed):
    """Resumed from epoch 1 batch 3; from batch 9 of 12 — whose save reads the rest of the epoch's
    order without running the sampler to its end (accelerate's counts that as an epoch); and from epoch
    1's end, whose next order the saved run drew after the save (recorded late, beside the copy)."""
    run(tmp_path, "killed", kill_at=kill_at)
    shutil.rmtree(tmp_path / "hf-output")  # the Trainer's own checkpoint folders are gone
    stderr, final = run(tmp_path, "killed")
    assert resumed_position(stderr) == resumed, stderr[-2000:]
    # On one process the Trainer's first batches are seen (its loader's ids) and its global step checked.
    assert "resume audit: exact" in stderr and "sample ids train handed out" in stderr, stderr[-2000:]
    assert_same(final, uninterrupted, at_least=50)


def test_a_corrupt_newest_copy_is_fallen_back_from(tmp_path, uninterrupted):
    run(tmp_path, "damaged", kill_at=STEPS_PER_EPOCH + 8)  # saves at steps 15 and 18: epoch 1 batches 3, 6
    assert Store(str(tmp_path / "ckpt")).latest("damaged", "n0") == Position(1, 6)
    damage_own_blob(str(tmp_path / "ckpt"), "damaged", Position(1, 6), Position(1, 3))
    stderr, final = run(tmp_path, "damaged")
    assert resumed_position(stderr) == Position(1, 3), stderr[-2000:]
    assert_same(final, uninterrupted, at_least=50)


def test_positions_follow_the_trainers_steps_under_gradient_accumulation(tmp_path):
    """25 batches an epoch, 2 accumulated per step: the Trainer takes 13 steps an epoch (the last one of 1
    batch), so step 15 is epoch 1's second step (was labelled epoch 1 batch 3: 25 // 2 = 12 an epoch)."""
    extra = ["--storage", str(tmp_path / "ckpt"), "--job", "accumulated", "--sequences", "200", "--accumulate", "2"]
    run_job("hf_job", tmp_path, *extra)
    steps_per_epoch = 13
    expected = []
    for step in range(3, 3 * steps_per_epoch + 1, 3):  # save_steps=3 over 3 epochs
        epoch, batch = divmod(step, steps_per_epoch)
        expected.append(Position(epoch - 1) if batch == 0 else Position(epoch, batch))
    assert Store(str(tmp_path / "ckpt")).list_positions("accumulated", "n0") == sorted(expected)
    assert Position(1, 2) in expected and Position(2) in expected


def test_a_checkpoint_folder_round_trips_byte_for_byte_with_its_tensors_stored_as_tensors(tmp_path):
    import safetensors.numpy

    folder, back = tmp_path / "checkpoint-3", tmp_path / "restored"
    folder.mkdir()
    tensors = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, dtype=np.int64)}
    safetensors.numpy.save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "trainer_state.json").write_text('{"global_step": 3}')
    (folder / "optimizer.pt").write_bytes(os.urandom(1000))
    arrays, files = pack_folder(str(folder))
    assert arrays["model.safetensors#w"].dtype == np.float32 and arrays["model.safetensors#w"].shape == (3, 4)
    assert files["optimizer.pt"] == "bytes" and sorted(files["model.safetensors"]) == ["b", "w"]
    unpack_folder(arrays, files, str(back))
    for name in os.listdir(folder):
        assert (back / name).read_bytes() == (folder / name).read_bytes(), name
