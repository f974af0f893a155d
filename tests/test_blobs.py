"""Content-addressed blobs: bytes paid once across saves, attempts and forks; collection by reference;
a damaged shared blob found in every copy that uses it; blobs readable without ckptstore."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import safetensors.numpy

from ckptstore import Position, Store
from ckptstore.errors import CorruptCheckpointError
from tests.builders import assert_bit_equal
from tests.job_runs import ROOT

FROZEN_TENSORS, FROZEN_SIZE = 16, 64 << 10  # 16 × 256 KiB of float32
TRAINED_TENSORS, TRAINED_SIZE = 4, 1 << 10  # 4 × 4 KiB


def lora_state(step: int) -> dict[str, np.ndarray]:
    """A frozen base (the same at every step) and small adapters that change at every step."""
    base = np.random.default_rng(0)
    state = {f"base.{i}.weight": base.standard_normal(FROZEN_SIZE, dtype=np.float32) for i in range(FROZEN_TENSORS)}
    trained = np.random.default_rng(1000 + step)
    for i in range(TRAINED_TENSORS):
        state[f"lora.{i}.A"] = trained.standard_normal(TRAINED_SIZE, dtype=np.float32)
    return state


def pool_bytes(root: str, job: str, node: str) -> int:
    pool = os.path.join(root, job, node, ".blobs")
    return sum(os.path.getsize(os.path.join(pool, f)) for f in os.listdir(pool) if f.endswith(".safetensors"))


def blob_files(root: str, job: str, node: str) -> set[str]:
    pool = os.path.join(root, job, node, ".blobs")
    return {f for f in os.listdir(pool) if f.endswith(".safetensors")}


FROZEN_BYTES = FROZEN_TENSORS * FROZEN_SIZE * 4
TRAINED_BYTES = TRAINED_TENSORS * TRAINED_SIZE * 4


def test_ten_saves_of_a_frozen_base_write_it_once(tmp_path):
    store = Store(str(tmp_path), shard_size=1 << 20)
    for step in range(10):
        store.save("lora", "n0", step, lora_state(step), attempt=1)
    # The base once, plus each save's adapters and shard headers (a few KiB): ≤ 1.02 × (base + 10 adapters).
    assert pool_bytes(str(tmp_path), "lora", "n0") <= 1.02 * (FROZEN_BYTES + 10 * TRAINED_BYTES)
    for step in (0, 5, 9):
        assert_bit_equal(Store(str(tmp_path)).load("lora", "n0", step), lora_state(step))


def test_a_new_attempt_in_a_new_process_compares_with_the_copies_on_storage(tmp_path):
    Store(str(tmp_path)).save("lora", "n0", 0, lora_state(0), attempt=1)
    before = pool_bytes(str(tmp_path), "lora", "n0")
    restarted = Store(str(tmp_path))  # knows nothing of the first save but what storage holds
    ref = restarted.save("lora", "n0", 1, lora_state(1), attempt=2)
    assert pool_bytes(str(tmp_path), "lora", "n0") - before <= TRAINED_BYTES + 4096
    assert ref.key.attempt == "2"
    assert_bit_equal(Store(str(tmp_path)).load("lora", "n0", 1), lora_state(1))


def test_a_fork_first_save_writes_only_what_changed_and_survives_the_parents_retention(tmp_path):
    root = str(tmp_path)
    parent = Store(root)
    for step in range(3):
        parent.save("base-run", "n0", step, lora_state(step), attempt=1)
    fork_point = parent.manifest(parent.key("base-run", "n0", Position(1), "1"))
    child = Store(root)
    child_state = lora_state(100)
    child.write(child.key("lr-sweep", "n0", Position(0), "1"), child_state, bases=[fork_point])
    assert pool_bytes(root, "lr-sweep", "n0") <= 0.01 * (FROZEN_BYTES + TRAINED_BYTES) + 4096
    # The parent deletes every copy it has, the fork point included: the child's copy still restores.
    for step in range(3):
        parent.delete("base-run", "n0", step)
    parent.collect_blobs("base-run", "n0", grace_seconds=0)
    assert_bit_equal(Store(root).load("lr-sweep", "n0", 0), child_state)
    assert Store(root).verify("lr-sweep", "n0", 0).ok
    # Once the child is gone too, the parent's pool is collected to nothing.
    child.delete("lr-sweep", "n0", 0)
    parent.collect_blobs("base-run", "n0", grace_seconds=0)
    assert blob_files(root, "base-run", "n0") == set()


def test_deleting_a_copy_collects_only_the_blobs_no_other_copy_uses(tmp_path):
    root = str(tmp_path)
    store = Store(root, shard_size=1 << 20)
    refs = [store.save("lora", "n0", step, lora_state(step), attempt=1) for step in range(3)]
    shared = {s.file for s in refs[0].manifest.shards} & {s.file for s in refs[2].manifest.shards}
    assert shared, "the frozen base's blobs are shared by every copy"
    store.delete("lora", "n0", 0)
    left = {f"lora/n0/.blobs/{name}" for name in blob_files(root, "lora", "n0")}
    assert shared <= left
    assert left == {s.file for ref in refs[1:] for s in ref.manifest.shards}
    for step in (1, 2):
        assert_bit_equal(store.load("lora", "n0", step), lora_state(step))


def test_a_damaged_shared_blob_fails_every_copy_that_uses_it_until_the_next_save_rewrites_it(tmp_path):
    root = str(tmp_path)
    store = Store(root, shard_size=1 << 20)
    first = store.save("lora", "n0", 0, lora_state(0), attempt=1)
    second = store.save("lora", "n0", 1, lora_state(1), attempt=1)
    frozen = next(s for s in second.manifest.shards if s.file in {f.file for f in first.manifest.shards})
    path = os.path.join(root, frozen.file)
    data = bytearray(open(path, "rb").read())
    data[-5] ^= 0x01
    with open(path, "wb") as handle:
        handle.write(bytes(data))
    restarted = Store(root)  # a new process, which restores first
    for step in (1, 0):
        with pytest.raises(CorruptCheckpointError, match=frozen.file):
            restarted.load("lora", "n0", step)
        report = Store(root).verify("lora", "n0", step)
        assert [(p.kind, p.file) for p in report.problems] == [("checksum_mismatch", frozen.file)]
    # Its next save does not point at the damaged blob: it writes those tensors again.
    ref = restarted.save("lora", "n0", 2, lora_state(2), attempt=2)
    assert frozen.file not in {s.file for s in ref.manifest.shards}
    assert_bit_equal(Store(root).load("lora", "n0", 2), lora_state(2))


def test_blobs_are_plain_safetensors_files(tmp_path):
    ref = Store(str(tmp_path), shard_size=1 << 20).save("lora", "n0", 0, lora_state(0), attempt=1)
    loaded: dict[str, np.ndarray] = {}
    for location in ref.shard_locations:
        loaded |= safetensors.numpy.load_file(location)
    assert_bit_equal(loaded, lora_state(0))


@pytest.mark.slow  # a long run: scripts/test.sh -m slow runs it (the default run stays near 30 minutes)
def test_a_kill_at_200_random_instants_of_retention_never_loses_a_referenced_blob(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "tests.retention_kill_driver", str(tmp_path), "200", "30"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    summary = json.loads(result.stdout)
    assert summary["killed"] == 200
    assert summary["calls_per_retention"] >= 6, "the retention deletes copies and blobs: several instants to hit"
    lost = {k: summary[k] for k in ("referenced_blobs_lost", "kept_positions_lost", "bad_loads")}
    assert lost == {"referenced_blobs_lost": 0, "kept_positions_lost": 0, "bad_loads": 0}
    assert summary["garbage_left_after_rerun"] == 0, "the next run collects what a kill left"


def test_replication_copies_only_the_blobs_the_target_lacks(tmp_path):
    local = Store(str(tmp_path / "local"), tier="local", shard_size=1 << 20)
    durable = Store(str(tmp_path / "durable"), shard_size=1 << 20)
    for step in range(4):
        ref = local.save("lora", "n0", step, lora_state(step), attempt=1)
        durable.copy_from(local, ref.key, verify="sizes")
    assert pool_bytes(str(tmp_path / "durable"), "lora", "n0") <= 1.02 * (FROZEN_BYTES + 4 * TRAINED_BYTES)
    restarted = Store(str(tmp_path / "durable"))  # a new process: the base is found on storage
    ref = local.save("lora", "n0", 4, lora_state(4), attempt=1)
    before = pool_bytes(str(tmp_path / "durable"), "lora", "n0")
    restarted.copy_from(local, ref.key)
    assert pool_bytes(str(tmp_path / "durable"), "lora", "n0") - before <= TRAINED_BYTES + 4096
    for step in (0, 4):
        assert_bit_equal(Store(str(tmp_path / "durable")).load("lora", "n0", step), lora_state(step))


def test_a_format_1_copy_of_the_previous_release_is_read_verified_copied_and_deleted(tmp_path):
    from ckptstore.format.crc import checksum, format_crc
    from ckptstore.format.manifest import Manifest, ShardRecord, TensorRecord, TensorTable

    arrays = {"w": np.arange(6, dtype=np.float32)}
    folder = tmp_path / "old" / "job" / "n0" / "0000000000" / "1"
    folder.mkdir(parents=True)
    safetensors.numpy.save_file(arrays, str(folder / "tensors-00000.safetensors"))
    data = (folder / "tensors-00000.safetensors").read_bytes()
    begin = 8 + int.from_bytes(data[:8], "little")
    shard = ShardRecord(file="tensors-00000.safetensors", bytes=len(data), crc32c=format_crc(checksum(data)))
    tensor = TensorRecord(
        name="w",
        dtype="F32",
        shape=(6,),
        shard=0,
        begin=begin,
        end=begin + 24,
        crc32c=format_crc(checksum(data[begin:])),
    )
    manifest = Manifest(
        format_version=1, job="job", node="n0", epoch=0, batch=None, attempt="1",
        created_at="2026-01-01T00:00:00.000+00:00", shards=(shard,), tensor_table=TensorTable.of([tensor]),
    )  # fmt: skip
    (folder / "MANIFEST.json").write_bytes(manifest.to_json())
    old = Store(str(tmp_path / "old"))
    assert_bit_equal(old.load("job", "n0", 0), arrays)
    assert old.verify("job", "n0", 0).ok
    copied = Store(str(tmp_path / "new")).copy_from(old, old.key("job", "n0", Position(0), "1"))
    assert copied.manifest.format_version == 1 and os.path.exists(f"{copied.location}/tensors-00000.safetensors")
    assert_bit_equal(Store(str(tmp_path / "new")).load("job", "n0", 0), arrays)
    later = old.save("job", "n0", 1, arrays, attempt="1")  # a format-1 base has no hashes: written whole
    assert later.manifest.format_version == 3 and pool_bytes(str(tmp_path / "old"), "job", "n0") > 0
    old.delete("job", "n0", 0)
    assert not folder.exists() and old.list_positions("job", "n0") == [Position(1)]
    assert_bit_equal(old.load("job", "n0", 1), arrays)


def test_crc_combine_gives_the_checksum_of_the_joined_bytes_from_threads_at_once():
    """A large tensor's CRC32C joins its shard's by crc_combine; the writer threads of one save may build
    its table of operators at the same moment, in a fresh process."""
    script = """
import os, random
from concurrent.futures import ThreadPoolExecutor
from ckptstore.format.crc import checksum, crc_combine
random.seed(0)
cases = [(os.urandom(a), os.urandom(b)) for a, b in [(0, 0), (0, 7), (9, 0), (1, 1), (4096, 1 << 20), (13, 123457)]]
cases += [(os.urandom(random.randrange(5000)), os.urandom(random.randrange(1, 3 << 20))) for _ in range(24)]
def joined(pair):
    first, second = pair
    return crc_combine(checksum(first), checksum(second), len(second)) == checksum(first + second)
with ThreadPoolExecutor(8) as pool:
    assert all(pool.map(joined, cases))
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("tensor_bytes", [4 << 10, 4 << 20], ids=["small", "large"])
def test_a_shard_the_pool_holds_already_is_written_once_and_no_temporary_stays(tmp_path, monkeypatch, tensor_bytes):
    """A local save names a blob after writing it (its hash is computed beside the write): when the
    name turns out to be a blob the base holds already, the new file is dropped, not kept twice."""
    import ckptstore.commit
    from ckptstore.blobs import Examined

    rng = np.random.default_rng(3)
    state = {f"t{i}": rng.standard_normal(tensor_bytes // 4, dtype=np.float32) for i in range(3)}
    store = Store(str(tmp_path))
    store.save("held", "n0", 0, state, attempt=1)
    first = blob_files(str(tmp_path), "held", "n0")
    # Every tensor "changed" (as when a base's records could not be matched): the same shard is planned again.
    monkeypatch.setattr(ckptstore.commit, "examine", lambda *args, **kwargs: Examined())
    store.save("held", "n0", 1, state, attempt=1)
    pool = os.path.join(tmp_path, "held", "n0", ".blobs")
    assert blob_files(str(tmp_path), "held", "n0") == first
    assert sorted(os.listdir(pool)) == sorted(first), "no temporary blob left in the pool"
    assert (
        store.manifest(store.copies("held", "n0", Position(1))[0]).shards
        == store.manifest(store.copies("held", "n0", Position(0))[0]).shards
    )
    assert_bit_equal(Store(str(tmp_path)).load("held", "n0", 1), state)
