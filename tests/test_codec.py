"""The optional lossless codec: encoded blobs round-trip bit-exactly through every read path, say so in
the manifest, are stored plain where encoding does not pay, dedup across encodings, are transcoded by
copies and replication, are found damaged like any blob, and are readable without ckptstore as
docs/layout.md shows."""

from __future__ import annotations

import os
import re
import uuid

import ml_dtypes
import numpy as np
import pytest

from ckptstore import Position, Store
from ckptstore.client.engine.node import NodeCheckpointer
from ckptstore.errors import CorruptCheckpointError
from ckptstore.format.codec import CODEC_NAME, blob_items, decode, encode
from ckptstore.format.manifest import ManifestError, parse_manifest
from tests.builders import assert_bit_equal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def weights(seed: int, scale: float = 0.02) -> dict[str, np.ndarray]:
    """Real-shaped state: bf16 weights, fp32 Adam moments, and the small odd ones (counters, flags)."""
    rng = np.random.default_rng(seed)
    return {
        "layer.0.weight": (rng.standard_normal((256, 512)) * scale).astype(ml_dtypes.bfloat16),
        "layer.1.weight": (rng.standard_normal((512, 256)) * scale).astype(ml_dtypes.bfloat16),
        "opt.exp_avg": (rng.standard_normal(64 << 10) * 1e-3).astype(np.float32),
        "opt.exp_avg_sq": np.abs(rng.standard_normal(64 << 10) * 1e-6).astype(np.float32),
        "opt.step": np.array(1234, dtype=np.int64),
        "mask": rng.integers(0, 2, 333).astype(np.bool_),
        "empty": np.zeros((0, 4), dtype=np.float16),
        "odd": rng.standard_normal(7).astype(np.float64),
    }


def noise(seed: int) -> dict[str, np.ndarray]:
    return {"noise": np.random.default_rng(seed).integers(0, 256, 1 << 20, dtype=np.uint8)}


def pool_files(root: str, job: str, node: str) -> list[str]:
    pool = os.path.join(root, job, node, ".blobs")
    return sorted(f for f in os.listdir(pool) if not f.startswith("."))


def test_encoding_round_trips_a_blob_and_groups_its_bytes(tmp_path):
    ref = Store(str(tmp_path)).save("j", "n0", 0, weights(0), attempt=1)
    plain = open(ref.shard_locations[0], "rb").read()
    encoded = encode(blob_items(plain), len(plain))
    assert encoded is not None and len(encoded) < 0.9 * len(plain)
    assert decode(encoded, len(plain)).tobytes() == plain
    with pytest.raises(ValueError):
        decode(encoded, len(plain) + 1)
    with pytest.raises(ValueError):
        decode(b"not zstd at all", len(plain))
    assert encode([(np.random.default_rng(0).bytes(1 << 16), 1)], 1 << 16) is None  # random bytes do not pay


def test_a_store_with_the_codec_saves_encoded_blobs_that_restore_bit_exactly(tmp_path):
    root = str(tmp_path)
    store = Store(root, codec=CODEC_NAME, shard_size=256 << 10)
    ref = store.save("j", "n0", 0, weights(0), attempt=1)
    encoded = [s for s in ref.manifest.shards if s.codec is not None]
    assert encoded and all(s.file.endswith(".grouped.zst") and s.codec == CODEC_NAME for s in encoded)
    assert sum(s.stored_size for s in ref.manifest.shards) < 0.85 * ref.manifest.total_bytes
    for s in encoded:
        assert os.path.getsize(os.path.join(root, s.file)) == s.stored_bytes != s.bytes
    # Every reader decodes: a plain store in another process, a partial read, the deferred local read.
    reader = Store(root)
    assert_bit_equal(reader.load("j", "n0", 0), weights(0))
    names = ["opt.exp_avg", "empty", "mask"]
    assert_bit_equal(reader.load("j", "n0", 0, names=names), {name: weights(0)[name] for name in names})
    deferred = reader.read_copy(ref.key, deferred=True).arrays
    assert_bit_equal(dict(deferred), weights(0))
    report = reader.verify("j", "n0", 0)
    assert report.ok and report.bytes_checked == ref.manifest.total_bytes


def test_a_blob_that_does_not_shrink_is_stored_plain(tmp_path):
    ref = Store(str(tmp_path), codec=CODEC_NAME).save("j", "n0", 0, noise(0), attempt=1)
    assert [s.codec for s in ref.manifest.shards] == [None]
    assert ref.manifest.shards[0].file.endswith(".safetensors")
    assert_bit_equal(Store(str(tmp_path)).load("j", "n0", 0), noise(0))


def test_unchanged_tensors_are_not_written_again_whatever_their_blobs_encoding(tmp_path):
    root = str(tmp_path)
    Store(root, codec=CODEC_NAME).save("j", "n0", 0, weights(0), attempt=1)
    before = pool_files(root, "j", "n0")
    state = weights(0) | {"opt.step": np.array(1235, dtype=np.int64)}
    # A later process without the codec points at the encoded blobs for what did not change.
    ref = Store(root).save("j", "n0", 1, state, attempt=2)
    added = sorted(set(pool_files(root, "j", "n0")) - set(before))
    assert len(added) == 1 and added[0].endswith(".safetensors")
    assert {s.codec for s in ref.manifest.shards} == {CODEC_NAME, None}
    assert_bit_equal(Store(root, codec=CODEC_NAME).load("j", "n0", 1), state)


def test_a_damaged_encoded_blob_is_found_by_reads_and_verify(tmp_path):
    root = str(tmp_path)
    store = Store(root, codec=CODEC_NAME)
    store.save("j", "n0", 0, weights(0), attempt=1)
    ref = store.save("j", "n0", 0, weights(1), attempt=2)
    shard = next(s for s in ref.manifest.shards if s.codec is not None)
    path = os.path.join(root, shard.file)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x40
    open(path, "wb").write(bytes(data))
    reader = Store(root)
    with pytest.raises(CorruptCheckpointError, match=re.escape(shard.file)):
        reader.read_copy(ref.key)
    with pytest.raises(CorruptCheckpointError, match=re.escape(shard.file)):
        reader.load("j", "n0", 0, attempt=2, names=["opt.exp_avg"])
    report = reader.verify("j", "n0", 0, attempt=2)
    assert [(p.kind, p.file) for p in report.problems] == [("checksum_mismatch", shard.file)]
    # The position's older attempt is whole: a load without an attempt falls back to it.
    assert_bit_equal(reader.load("j", "n0", 0), weights(0))


def test_a_manifest_whose_codec_and_file_name_disagree_is_not_committed(tmp_path):
    manifest = Store(str(tmp_path), codec=CODEC_NAME).save("j", "n0", 0, weights(0), attempt=1).manifest
    encoded = next(s for s in manifest.shards if s.codec is not None)
    for wrong in (
        encoded.model_copy(update={"file": encoded.plain().file}),
        encoded.model_copy(update={"stored_bytes": None}),
        encoded.plain().model_copy(update={"file": encoded.file}),
        encoded.plain().model_copy(update={"stored_crc32c": encoded.stored_crc32c}),
    ):
        forged = manifest.model_copy(update={"shards": tuple(wrong if s is encoded else s for s in manifest.shards)})
        with pytest.raises(ManifestError, match="invalid shard files"):
            parse_manifest(forged.to_json())
    assert parse_manifest(manifest.to_json()) == manifest


def test_copies_store_blobs_as_the_target_stores_them(tmp_path):
    plain_root, encoded_root, back_root = (str(tmp_path / name) for name in ("plain", "encoded", "back"))
    plain, encoding, back = Store(plain_root), Store(encoded_root, codec=CODEC_NAME), Store(back_root)
    refs = [plain.save("j", "n0", step, weights(0) | {"opt.step": np.array(step)}, attempt=1) for step in range(2)]
    for ref in refs:
        copied = encoding.copy_from(plain, ref.key)
        assert copied.manifest.plain() == ref.manifest
        assert any(s.codec is not None for s in copied.manifest.shards)
        assert copied.manifest == encoding.copy_from(plain, ref.key).manifest  # again: a no-op
    # The second copy sent only the blob that changed (the step); the first's encoded blobs are shared.
    assert len(pool_files(encoded_root, "j", "n0")) == len({s.file for r in refs for s in r.manifest.shards})
    # Staging back to a plain store decodes; the copy there is the original, byte for byte.
    for ref in refs:
        staged = back.copy_from(encoding, ref.key)
        assert staged.manifest == ref.manifest
        assert_bit_equal(back.load("j", "n0", ref.key.position.epoch), plain.load("j", "n0", ref.key.position.epoch))
    assert all(name.endswith(".safetensors") for name in pool_files(back_root, "j", "n0"))


@pytest.mark.s3
def test_replication_encodes_and_a_new_machine_restores_from_the_durable_tier_past_a_corrupt_copy(
    tmp_path, moto_s3, sqlite_service
):
    job = f"codec-{uuid.uuid4().hex[:8]}"
    durable, options = f"s3://{moto_s3.bucket}/{job}", dict(moto_s3.options)

    def checkpointer(local: str) -> NodeCheckpointer:
        return NodeCheckpointer(
            job=job,
            storage=durable,
            local_storage=local,
            storage_options=options,
            service=sqlite_service.live.url,
            node="n0",
            codec=CODEC_NAME,
        )

    node = checkpointer(str(tmp_path / "local"))
    node.start()
    for epoch in range(3):
        node.save(Position(epoch), weights(epoch))
    node.wait()
    node.close()
    local_pool = pool_files(str(tmp_path / "local"), job, "n0")
    assert local_pool and all(name.endswith(".safetensors") for name in local_pool), "the local tier stays plain"
    store = Store(durable, storage_options=options)
    newest = store.manifest(store.copies(job, "n0", Position(2))[0])
    assert all(s.codec == CODEC_NAME for s in newest.shards if s.bytes > 4096)
    # The newest durable copy's encoded blob is damaged: a new machine restores the one before, exactly.
    encoded = next(s for s in newest.shards if s.codec is not None)
    fs = store._storage
    data = bytearray(fs.read_object(encoded.file))
    data[100] ^= 0x01
    fs.publish_object(encoded.file, bytes(data))
    new_machine = checkpointer(str(tmp_path / "empty-local"))
    restored = new_machine.start()
    assert restored is not None and restored.copy.tier == "durable" and restored.copy.position == Position(1)
    assert_bit_equal(dict(restored.checkpoint.arrays), weights(1))
    new_machine.close()


def test_the_documented_reader_opens_an_encoded_blob_without_ckptstore(tmp_path):
    torch = pytest.importorskip("torch", reason="the documented reader loads bf16 through safetensors.torch")
    ref = Store(str(tmp_path), codec=CODEC_NAME).save("j", "n0", 0, weights(0), attempt=1)
    shard = next(s for s in ref.manifest.shards if s.codec is not None)
    text = open(os.path.join(ROOT, "docs", "layout.md"), encoding="utf-8").read()
    block = re.search(r"```python\n(.*?)```", text[text.index("## The codec") :], re.S).group(1)
    scope = {"encoded_blob_path": os.path.join(str(tmp_path), shard.file)}
    exec(compile(block, "docs/layout.md", "exec"), scope)
    expected = {t.name: weights(0)[t.name] for t in ref.manifest.tensors if ref.manifest.shards[t.shard] == shard}
    assert expected and sorted(scope["tensors"]) == sorted(expected)
    for name, tensor in scope["tensors"].items():
        assert tuple(tensor.shape) == expected[name].shape, name
        assert tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes() == expected[name].tobytes(), name
    # The documented reader gives back the plain blob byte for byte (what a plain store would hold).
    plain_ref = Store(str(tmp_path / "plain")).save("j", "n0", 0, weights(0), attempt=1)
    plain_shard = next(s for s in plain_ref.manifest.shards if s.blob == shard.blob)
    with open(os.path.join(str(tmp_path / "plain"), plain_shard.file), "rb") as handle:
        assert scope["plain_blob"](scope["encoded_blob_path"]) == handle.read()
