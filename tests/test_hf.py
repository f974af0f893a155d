"""`client.hf.BackupAndRestore`: a Hugging Face `Trainer` (a 2-layer GPT-2 from a config, dropout on,
the Trainer's shuffled sampler; tests/hf_job.py) SIGKILLed mid-epoch and run again with a plain
`trainer.train()` ends bit-equal to an uninterrupted run — with the Trainer's own output folder gone
(a new machine), and past a corrupt newest copy; checkpoint folders round-trip byte for byte."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid

import numpy as np
import pytest

pytest.importorskip("transformers", reason="the [hf] extra is not installed")
pytest.importorskip("accelerate", reason="the [hf] extra is not installed")

from ckptstore import Position, Store  # noqa: E402
from client.hf import pack_folder, unpack_folder  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS_PER_EPOCH = 12  # 96 sequences, batches of 8; a checkpoint every 3 steps


def run(storage: str, job: str, out_dir, kill_at: int | None = None) -> tuple[str, dict[str, np.ndarray]]:
    out = str(out_dir / f"{uuid.uuid4().hex[:6]}.npz")
    command = [sys.executable, "-m", "tests.hf_job", "--storage", storage, "--job", job, "--out", out]
    command += [] if kill_at is None else ["--kill-at", str(kill_at)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if kill_at is not None:
        assert result.returncode == -9, result.stderr[-3000:]
        return result.stderr, {}
    assert result.returncode == 0, result.stderr[-3000:]
    with np.load(out) as archive:
        return result.stderr, {key: archive[key] for key in archive.files}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, np.ndarray]:
    tmp_path = tmp_path_factory.mktemp("hf-base")
    return run(str(tmp_path / "ckpt"), "base", tmp_path)[1]


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want) and len(want) > 50
    different = [key for key, value in want.items() if got[key].tobytes() != value.tobytes()]
    assert not different, different[:5]


def resumed_position(stderr: str) -> Position:
    match = re.search(r"resumed from epoch (\d+)(?: batch (\d+))?", stderr)
    assert match is not None, stderr[-2000:]
    return Position(int(match.group(1)), None if match.group(2) is None else int(match.group(2)))


def test_a_trainer_killed_mid_epoch_on_a_machine_that_is_gone_resumes_bit_exactly(tmp_path, uninterrupted):
    storage = str(tmp_path / "ckpt")
    kill_at = int(np.random.default_rng().integers(STEPS_PER_EPOCH + 4, 2 * STEPS_PER_EPOCH))  # mid epoch 1
    run(storage, "killed", tmp_path, kill_at=kill_at)
    shutil.rmtree(os.path.join(storage, "hf-output"))  # the Trainer's own checkpoint folders are gone
    stderr, final = run(storage, "killed", tmp_path)
    assert resumed_position(stderr) >= Position(1, 3), stderr[-2000:]
    assert_same(final, uninterrupted)


def test_a_corrupt_newest_copy_is_fallen_back_from(tmp_path, uninterrupted):
    storage = str(tmp_path / "ckpt")
    run(storage, "damaged", tmp_path, kill_at=STEPS_PER_EPOCH + 8)  # saves at steps 15 and 18 of epoch 1
    store = Store(storage)
    newest = store.latest("damaged", "n0")
    assert newest == Position(1, 6)
    manifest = store.manifest(store.copies("damaged", "n0", newest)[-1])
    before = {s.file for s in store.manifest(store.copies("damaged", "n0", Position(1, 3))[-1]).shards}
    shard = max((s for s in manifest.shards if s.file not in before), key=lambda s: s.bytes)  # its own blob
    path = os.path.join(storage, shard.file)
    data = bytearray(open(path, "rb").read())
    data[-7] ^= 0x04
    open(path, "wb").write(bytes(data))
    stderr, final = run(storage, "damaged", tmp_path)
    assert resumed_position(stderr) == Position(1, 3), stderr[-2000:]
    assert_same(final, uninterrupted)


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
