"""The Store contract, run unchanged on every backend: local disk, S3 (moto server), GCS (emulator)."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from ckptstore import (
    CheckpointNotFoundError,
    CommitConflictError,
    CorruptCheckpointError,
    Position,
    Store,
)
from ckptstore.format.layout import MANIFEST_NAME
from tests.builders import assert_bit_equal


def spread() -> dict[str, np.ndarray]:
    """Every supported dtype and the awkward shapes: 0-d, empty, multi-dim, non-contiguous, big-endian."""
    rng = np.random.default_rng(7)
    arrays = {
        "f64": rng.standard_normal((3, 5)),
        "f32": rng.standard_normal((64, 33)).astype(np.float32),
        "f16": rng.standard_normal(17).astype(np.float16),
        "bf16": rng.standard_normal((4, 4)).astype(ml_dtypes.bfloat16),
        "c64": (rng.standard_normal(5) + 1j).astype(np.complex64),
        "bool": rng.random((3, 3)) > 0.5,
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.int32),
        "noncontig": np.arange(60, dtype=np.int64).reshape(6, 10)[:, ::3],
        "bigendian": np.arange(9, dtype=">u2"),
        "nan": np.array([np.nan, np.inf, -0.0], dtype=np.float32),
    }
    for dtype in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64):
        info = np.iinfo(dtype)
        arrays[f"int_{np.dtype(dtype).name}"] = np.array([info.min, 0, info.max], dtype=dtype)
    return arrays


@pytest.fixture
def store(backend) -> Store:
    return Store(backend.url, storage_options=backend.options, shard_size=4096)


def test_round_trip_is_bit_exact_for_every_dtype_and_shape(store):
    arrays = spread()
    ref = store.save("job", "node-0", 3, arrays, attempt=1, step=42, metadata={"loss": 0.5})
    assert len(ref.manifest.shards) > 1, "small shard size must spread tensors over several shards"
    assert ref.location == f"{store.url}/job/node-0/0000000003/1"
    assert set(ref.checksums) == {s.file.rsplit("/", 1)[-1] for s in ref.manifest.shards}
    assert_bit_equal(store.load("job", "node-0", 3), arrays)
    manifest = store.manifest(ref.key)
    assert (manifest.step, manifest.metadata, manifest.attempt) == (42, {"loss": 0.5}, "1")


def test_loaded_arrays_are_read_only(store):
    store.save("job", "n", 0, {"w": np.ones(4, np.float32)}, attempt=1)
    assert not store.load("job", "n", 0)["w"].flags.writeable


def test_positions_order_mid_epoch_before_end_of_epoch(store):
    for epoch, batch in [(1, None), (0, 5), (1, 7), (0, None), (1, 2)]:
        store.save("job", "n", epoch, {"x": np.array(epoch)}, batch=batch, attempt=1)
    assert store.list_positions("job", "n") == [
        Position(0, 5),
        Position(0, None),
        Position(1, 2),
        Position(1, 7),
        Position(1, None),
    ]
    assert store.list_epochs("job", "n") == [0, 1]
    assert store.latest("job", "n") == Position(1, None)
    assert store.latest("job", "other") is None
    assert store.list_positions("job", "other") == []


def test_newest_attempt_wins_and_older_attempts_stay_readable(store):
    store.save("job", "n", 2, {"x": np.array([1])}, attempt=3)
    store.save("job", "n", 2, {"x": np.array([2])}, attempt=10)
    assert store.load("job", "n", 2)["x"][0] == 2, "attempt 10 is newer than 3 (numeric, not lexical)"
    assert store.load("job", "n", 2, attempt=3)["x"][0] == 1


def test_offline_attempts_count_up_and_never_share_a_prefix(store):
    first = store.save("job", "n", 0, {"x": np.array([1])})
    second = store.save("job", "n", 0, {"x": np.array([2])})
    assert first.key.attempt.startswith("1-") and second.key.attempt.startswith("2-")
    assert store.load("job", "n", 0)["x"][0] == 2
    twins = {store.next_attempt("job", "n") for _ in range(20)}
    assert len(twins) == 20 and all(a.startswith("3-") for a in twins)


def test_recommitting_the_same_attempt_and_position_conflicts(store):
    store.save("job", "n", 0, {"x": np.array([1])}, attempt=1)
    with pytest.raises(CommitConflictError, match="already committed"):
        store.save("job", "n", 0, {"x": np.array([2])}, attempt=1)
    assert store.load("job", "n", 0)["x"][0] == 1


def test_partial_load_returns_only_named_tensors_verified(store):
    arrays = spread()
    store.save("job", "n", 0, arrays, attempt=1)
    got = store.load("job", "n", 0, names=["f32", "empty", "scalar"])
    assert_bit_equal(got, {k: arrays[k] for k in ("f32", "empty", "scalar")})
    with pytest.raises(CheckpointNotFoundError, match="nope"):
        store.load("job", "n", 0, names=["nope"])


def test_missing_checkpoint_raises_not_found(store):
    with pytest.raises(CheckpointNotFoundError):
        store.load("job", "n", 9)
    with pytest.raises(CheckpointNotFoundError):
        store.verify("job", "n", 9)
    with pytest.raises(CheckpointNotFoundError):
        store.delete("job", "n", 9)


def test_delete_removes_the_checkpoint(store):
    store.save("job", "n", 0, {"x": np.array([1])}, attempt=1)
    store.save("job", "n", 1, {"x": np.array([1])}, attempt=1)
    assert store.delete("job", "n", 0) == [f"{store.url}/job/n/0000000000/1"]
    assert store.list_positions("job", "n") == [Position(1)]
    assert store._storage.find("job/n/0000000000") == []


def test_verify_reports_ok_for_a_good_checkpoint(store):
    ref = store.save("job", "n", 0, spread(), attempt=1)
    report = store.verify("job", "n", 0)
    assert report.ok and report.committed and report.bytes_checked == ref.bytes


def test_accessible_writes_reads_and_cleans_up(store):
    report = store.accessible()
    assert report.ok and report.error is None and report.latency_ms >= 0
    assert store._storage.find(".ckptstore-probe") == []


def test_a_second_reader_sees_a_new_commit_despite_its_earlier_listing(backend):
    reader = Store(backend.url, storage_options=backend.options)
    writer = Store(backend.url, storage_options=backend.options)
    writer.save("job", "n", 0, {"x": np.array([0])}, attempt=1)
    assert reader.list_positions("job", "n") == [Position(0)]
    writer.save("job", "n", 1, {"x": np.array([1])}, attempt=1)
    assert reader.latest("job", "n") == Position(1)


# -- corruption: every defect is CorruptCheckpointError naming the file, or "not committed" -----


def _corrupt(store: Store, relpath: str, mutate) -> None:
    path = store._storage.path(relpath)
    data = bytes(store._storage.read_object(relpath))
    store._storage.fs.pipe_file(path, mutate(data))


def _first_shard(ref) -> str:
    return ref.manifest.shards[0].key(ref.key.relpath)


@pytest.mark.parametrize(
    ("mutate", "kind"),
    [
        (lambda d: d[:-100] + bytes([d[-100] ^ 0x01]) + d[-99:], "checksum_mismatch"),
        (lambda d: d[: len(d) // 2], "short_shard"),
        (lambda d: b"", "short_shard"),
        (lambda d: d + b"\x00", "size_mismatch"),
    ],
    ids=["flipped-byte", "truncated", "empty", "extended"],
)
def test_damaged_shard_is_detected_and_named(store, mutate, kind):
    ref = store.save("job", "n", 0, {"w": np.arange(1000, dtype=np.float32)}, attempt=1)
    shard = ref.manifest.shards[0].file
    _corrupt(store, _first_shard(ref), mutate)
    with pytest.raises(CorruptCheckpointError, match=shard) as caught:
        store.load("job", "n", 0)
    assert caught.value.file == shard
    report = store.verify("job", "n", 0)
    assert not report.ok and [p.kind for p in report.problems] == [kind]


def test_flipped_byte_inside_a_requested_tensor_fails_a_partial_load(store):
    arrays = {"a": np.arange(100, dtype=np.float32), "b": np.arange(100, dtype=np.float32)}
    ref = store.save("job", "n", 0, arrays, attempt=1)
    record = ref.manifest.tensor("b")
    _corrupt(
        store,
        _first_shard(ref),
        lambda d: d[: record.begin + 5] + bytes([d[record.begin + 5] ^ 0x80]) + d[record.begin + 6 :],
    )
    assert store.load("job", "n", 0, names=["a"])["a"][3] == 3, "an undamaged tensor still loads"
    with pytest.raises(CorruptCheckpointError, match="'b'"):
        store.load("job", "n", 0, names=["b"])


def test_missing_shard_is_reported(store):
    ref = store.save("job", "n", 0, {"w": np.arange(10)}, attempt=1)
    store._storage.remove_file(_first_shard(ref))
    with pytest.raises(CorruptCheckpointError):
        store.load("job", "n", 0)
    assert [p.kind for p in store.verify("job", "n", 0).problems] == ["missing_shard"]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d[: len(d) // 2],
        lambda d: b"",
        lambda d: re.sub(rb'"step":\s*1', b'"step":2', d),
        lambda d: b"\xff" + d,
    ],
    ids=["truncated", "empty", "edited-without-checksum", "garbled"],
)
def test_damaged_manifest_means_not_committed(store, mutate):
    store.save("job", "n", 0, {"w": np.arange(10)}, attempt=1, step=1)
    _corrupt(store, f"job/n/0000000000/1/{MANIFEST_NAME}", mutate)
    assert store.list_positions("job", "n") == []
    with pytest.raises(CheckpointNotFoundError):
        store.load("job", "n", 0)
    report = store.verify("job", "n", 0)
    assert not report.committed and report.problems[0].kind == "unreadable_manifest"


def test_corrupt_newest_attempt_falls_back_to_an_older_good_one(store):
    store.save("job", "n", 0, {"w": np.zeros(10)}, attempt=1)
    ref = store.save("job", "n", 0, {"w": np.ones(10)}, attempt=2)
    _corrupt(store, _first_shard(ref), lambda d: d[:-1] + bytes([d[-1] ^ 1]))
    assert store.load("job", "n", 0)["w"][0] == 0.0
    with pytest.raises(CorruptCheckpointError):
        store.load("job", "n", 0, attempt=2)
