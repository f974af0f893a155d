"""The manifest parser accepts only committed, self-consistent manifests written for their path."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore import Position, Store
from ckptstore.copykey import CopyKey
from ckptstore.format.crc import checksum, format_crc
from ckptstore.format.manifest import ManifestError, parse_manifest

# CI runs 300; the long run in bench/RESULTS.md sets CKPTSTORE_MANIFEST_EXAMPLES=10000.
FUZZ_EXAMPLES = int(os.environ.get("CKPTSTORE_MANIFEST_EXAMPLES", "300"))


def resealed(body: dict) -> bytes:
    """Re-sign an edited manifest body as a hostile writer could: format 3 over its bytes, formats 1
    and 2 over their canonical JSON."""
    body = {k: v for k, v in body.items() if k != "manifest_crc32c"}
    if body.get("format_version") == 3:
        data = json.dumps(body, separators=(",", ":")).encode()[:-1]
        return data + b',"manifest_crc32c":"' + format_crc(checksum(data)).encode() + b'"}'
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    body["manifest_crc32c"] = format_crc(checksum(canonical))
    return json.dumps(body).encode()


@pytest.fixture
def saved(tmp_path):
    store = Store(str(tmp_path))
    ref = store.save("job", "n", 0, {"a": np.arange(10, dtype=np.float32), "b": np.ones(3)}, attempt=1)
    return store, ref, json.loads(ref.manifest.to_json())


def edit_tensor(body, **changes):
    for field, value in changes.items():
        body["tensor_table"][field][0] = value
    return body


def first(body, field):
    return body["tensor_table"][field][0]


def records_of(body, version):
    """The body as format 1 or 2 wrote it: one record per tensor."""
    table = body["tensor_table"]
    rest = {field: value for field, value in body.items() if field != "tensor_table"}
    return {**rest, "format_version": version, "tensors": [dict(zip(table, row)) for row in zip(*table.values())]}


HOSTILE = {
    "end past the shard": lambda b: edit_tensor(b, end=b["shards"][0]["bytes"] + 8),
    "begin after end": lambda b: edit_tensor(b, begin=first(b, "end") + 4),
    "huge shape": lambda b: edit_tensor(b, shape=[2**40, 2**40]),
    "negative dim": lambda b: edit_tensor(b, shape=[-1, -40]),
    "unknown dtype": lambda b: edit_tensor(b, dtype="F8"),
    "shard out of range": lambda b: edit_tensor(b, shard=5),
    "traversal shard file": lambda b: {**b, "shards": [{**b["shards"][0], "file": "../../../etc/passwd"}]},
    "absolute shard file": lambda b: {**b, "shards": [{**b["shards"][0], "file": "/etc/passwd"}]},
    "duplicate tensor": lambda b: {
        **b,
        "tensor_table": {field: column[:1] * 2 for field, column in b["tensor_table"].items()},
    },
    "columns of different lengths": lambda b: {**b, "tensor_table": {**b["tensor_table"], "probe": []}},
    "records in format 3": lambda b: records_of(b, 2) | {"format_version": 3},
    "a table in format 2": lambda b: {**b, "format_version": 2},
    "a record's unknown field": lambda b: (
        records_of(b, 2)
        | {
            "tensors": [{**records_of(b, 2)["tensors"][0], "extra": 1}],
        }
    ),
    "a record's missing field": lambda b: (
        records_of(b, 2)
        | {
            "tensors": [{k: v for k, v in records_of(b, 2)["tensors"][0].items() if k != "crc32c"}],
        }
    ),
    "a record's bad checksum": lambda b: (
        records_of(b, 2)
        | {
            "tensors": [{**records_of(b, 2)["tensors"][0], "crc32c": "xyz"}],
        }
    ),
    "other job": lambda b: {**b, "job": "other"},
    "other attempt": lambda b: {**b, "attempt": "2"},
    "other position": lambda b: {**b, "batch": 3},
    "bool as epoch": lambda b: {**b, "epoch": True},
    "string epoch": lambda b: {**b, "epoch": "0"},
    "unknown field": lambda b: {**b, "extra": 1},
    "future format": lambda b: {**b, "format_version": 4},
    "format 1 naming a blob": lambda b: {**b, "format_version": 1},
    "blob id not its key's": lambda b: {**b, "shards": [{**b["shards"][0], "blob": "0" * 32}]},
    "blob key out of the pools": lambda b: {
        **b,
        "shards": [{**b["shards"][0], "file": f"../n/.blobs/{b['shards'][0]['blob']}.safetensors"}],
    },
    "blob key in a dot-dot job": lambda b: {
        **b,
        "shards": [{**b["shards"][0], "file": f"a..b/n/.blobs/{b['shards'][0]['blob']}.safetensors"}],
    },
    "traversal job": lambda b: {**b, "job": "../x"},
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_manifests_are_not_committed(saved, name):
    store, ref, body = saved
    data = resealed(HOSTILE[name](body))
    with pytest.raises(ManifestError):
        parse_manifest(data, expect=CopyKey("job", "n", Position(0), "1"))
    store._storage.fs.pipe_file(store._storage.path("job/n/0000000000/1/MANIFEST.json"), data)
    assert store.list_positions("job", "n") == []


def test_the_real_manifest_parses(saved):
    _, ref, body = saved
    assert parse_manifest(resealed(body), expect=CopyKey("job", "n", Position(0), "1")) == ref.manifest


def test_a_format_2_manifest_one_record_per_tensor_still_parses(saved):
    _, ref, body = saved
    parsed = parse_manifest(resealed(records_of(body, 2)), expect=CopyKey("job", "n", Position(0), "1"))
    assert parsed.format_version == 2 and parsed.tensors == ref.manifest.tensors
    assert json.loads(parsed.to_json())["tensors"] == records_of(body, 2)["tensors"]  # written back as it was


def test_each_format_has_its_own_seal(saved):
    """A format 3 body checksummed canonically, or a format 2 body sealed over its bytes, is refused."""
    _, _, body = saved
    body = {k: v for k, v in body.items() if k != "manifest_crc32c"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    with pytest.raises(ManifestError, match="format 3 is not checksummed this way"):
        parse_manifest(json.dumps({**body, "manifest_crc32c": format_crc(checksum(canonical))}).encode())
    legacy = json.dumps({**body, "format_version": 2}, separators=(",", ":")).encode()[:-1]
    with pytest.raises(ManifestError, match="only a format 3 manifest is sealed"):
        parse_manifest(legacy + b',"manifest_crc32c":"' + format_crc(checksum(legacy)).encode() + b'"}')


def test_oversized_manifest_is_refused_without_parsing():
    with pytest.raises(ManifestError, match="limit"):
        parse_manifest(b" " * (64 << 20) + b"{}")


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(st.binary(max_size=2048))
def test_random_bytes_never_parse_and_never_crash_otherwise(data):
    with pytest.raises(ManifestError):
        parse_manifest(data)


@pytest.fixture(scope="module")
def real_manifest(tmp_path_factory) -> dict:
    store = Store(str(tmp_path_factory.mktemp("fuzz")))
    return json.loads(store.save("job", "n", 0, {"a": np.arange(4)}, attempt=1).manifest.to_json())


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(data=st.data())
def test_mutated_real_manifests_are_refused_or_identical(real_manifest, data):
    body = json.loads(json.dumps(real_manifest))
    path = data.draw(st.sampled_from(["epoch", "batch", "step", "attempt", "job"]))
    body[path] = data.draw(st.one_of(st.integers(-5, 10**11), st.text(max_size=5), st.none(), st.booleans()))
    try:
        manifest = parse_manifest(resealed(body), expect=CopyKey("job", "n", Position(0), "1"))
    except ManifestError:
        return
    assert (manifest.job, manifest.epoch, manifest.batch, manifest.attempt) == ("job", 0, None, "1")


def test_a_format_3_copy_reads_without_ckptstore_as_docs_layout_says(tmp_path):
    """docs/layout.md: the i-th entry of each column is one tensor, its bytes at begin:end of its shard's
    file; the seal is the CRC32C of every byte before its member."""
    arrays = {f"w{i}": np.arange(i + 1, dtype=np.float32) for i in range(5)}
    Store(str(tmp_path)).save("job", "n", 0, arrays, attempt=1)
    data = (tmp_path / "job/n/0000000000/1/MANIFEST.json").read_bytes()
    sealed = data.rindex(b',"manifest_crc32c":"')
    assert data[sealed:].decode() == f',"manifest_crc32c":"{format_crc(checksum(data[:sealed]))}"}}'
    m = json.loads(data)
    t = m["tensor_table"]
    for i, name in enumerate(t["name"]):
        shard = (tmp_path / m["shards"][t["shard"][i]]["file"]).read_bytes()
        assert shard[t["begin"][i] : t["end"][i]] == arrays[name].tobytes()
    assert sorted(t["name"]) == sorted(arrays)
