"""O_DIRECT writes: exact bytes whatever the chunking and size, large chunks written from their own
memory where the shard layout lines them up, and the buffered fallback."""

from __future__ import annotations

import fcntl
import os

import numpy as np
import pytest
import safetensors.numpy
from fsspec.implementations.local import LocalFileSystem

from ckptstore.format.shard import ALIGN as SHARD_ALIGN
from ckptstore.format.shard import iter_shard_chunks, plan_shards
from ckptstore.storage import direct_io
from ckptstore.storage.direct_io import ALIGN, BLOCK, DIRECT_MIN, _write_aligned, open_direct, write_direct
from ckptstore.storage.filesystem import Storage
from ckptstore.storage.localfs import aligned_empty

SIZES = [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 12345]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("piece", [1000, ALIGN + 1, 3 * BLOCK])
def test_direct_writes_give_exactly_the_chunks_bytes(tmp_path, size, piece):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    fd = open_direct(str(tmp_path / "f"))
    if fd is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    try:
        chunks = [memoryview(data)[start : start + piece] for start in range(0, size, piece)]
        assert write_direct(fd, chunks) == size
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == data


def test_ckptstore_direct_io_0_writes_buffered_with_the_same_bytes(tmp_path, monkeypatch):
    """The buffered path, also taken where O_DIRECT is missing (macOS) or refused at open."""
    monkeypatch.setenv("CKPTSTORE_DIRECT_IO", "0")
    assert open_direct(str(tmp_path / "probe")) is None
    storage = Storage(LocalFileSystem(), str(tmp_path))
    storage.write_object("f", [b"header", memoryview(np.arange(1000, dtype=np.float32))])
    assert (tmp_path / "f").read_bytes() == b"header" + np.arange(1000, dtype=np.float32).tobytes()


def test_a_write_the_filesystem_refuses_under_o_direct_goes_on_buffered(tmp_path):
    """A misaligned address makes the kernel refuse an O_DIRECT write (EINVAL), as a filesystem with
    other alignment rules would: the descriptor drops O_DIRECT and the bytes still land."""
    fd = open_direct(str(tmp_path / "f"))
    if fd is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    backing = np.arange(2 * ALIGN, dtype=np.uint8)
    try:
        _write_aligned(fd, backing[1 : 1 + ALIGN])  # off by one byte from a page boundary
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == backing[1 : 1 + ALIGN].tobytes()


def _at_page_offset(data: np.ndarray, offset: int) -> np.ndarray:
    """A copy of `data` whose first byte lies `offset` bytes into a page."""
    backing = aligned_empty(data.nbytes + ALIGN, ALIGN)[offset : offset + data.nbytes]
    backing[:] = data
    return backing


@pytest.mark.parametrize("filled", [0, 100, BLOCK - 64])
@pytest.mark.parametrize("offset", [0, 64, ALIGN - 64])
def test_a_chunk_whose_address_agrees_with_its_file_offset_is_written_from_its_own_memory(
    tmp_path, monkeypatch, filled, offset
):
    lead = (-offset) % ALIGN
    big = _at_page_offset(np.random.default_rng(offset).integers(0, 256, 3 * DIRECT_MIN + 777, dtype=np.uint8), offset)
    head = np.full(filled // ALIGN * ALIGN + offset, 7, np.uint8)  # `big`'s file offset agrees with its address
    writes: list[np.ndarray] = []

    def spy(fd: int, data: np.ndarray) -> None:
        writes.append(data)
        _write_aligned(fd, data)

    monkeypatch.setattr(direct_io, "_write_aligned", spy)
    fd = open_direct(str(tmp_path / "f"))
    if fd is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    try:
        assert write_direct(fd, [memoryview(head), memoryview(big)]) == head.size + big.size
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == head.tobytes() + big.tobytes()
    from_source = sum(w.nbytes for w in writes if np.shares_memory(w, big))
    assert from_source == (big.size - lead) // ALIGN * ALIGN


def test_small_chunks_over_several_blocks_land_in_order(tmp_path):
    rng = np.random.default_rng(1)
    chunks = [rng.integers(0, 256, int(size), dtype=np.uint8) for size in rng.integers(1, 300_000, 200)]
    assert sum(c.size for c in chunks) > 2 * BLOCK  # the block is written and refilled more than once
    fd = open_direct(str(tmp_path / "f"))
    if fd is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    try:
        assert write_direct(fd, [memoryview(c) for c in chunks]) == sum(c.size for c in chunks)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"".join(c.tobytes() for c in chunks)


def test_shards_put_large_aligned_tensors_at_file_offsets_that_agree_with_their_addresses(tmp_path):
    """The header's padding lines up the large tensors for O_DIRECT; the file stays plain safetensors.
    Where 64-byte-aligned tensors (frameworks' memory) hold most of a shard's bytes, they decide the
    padding and every large tensor stays 64-byte aligned (a numpy buffer 16 bytes past a page among
    them goes through the block)."""
    rng = np.random.default_rng(0)
    arrays = {
        "a": _at_page_offset(rng.random(DIRECT_MIN // 4 + 16, dtype=np.float32).view(np.uint8), 64).view(np.float32),
        "b": _at_page_offset(rng.random(DIRECT_MIN // 4, dtype=np.float32).view(np.uint8), 128).view(np.float32),
        "unaligned": _at_page_offset(rng.random(DIRECT_MIN // 4, dtype=np.float32).view(np.uint8), 16).view(np.float32),
        "small": np.arange(3, dtype=np.int16),
    }
    plan = plan_shards(arrays, 64 << 20)[0]
    slots = {slot.name: slot for slot in plan.slots}
    assert slots["a"].begin % ALIGN == 64 and slots["b"].begin % ALIGN == 128  # "a" ends 64 bytes past a page
    assert all(slots[name].begin % SHARD_ALIGN == 0 for name in ("a", "b", "unaligned"))
    storage = Storage(LocalFileSystem(), str(tmp_path))
    storage.write_object("s.safetensors", (chunk for _, chunk in iter_shard_chunks(plan, arrays)), plan.size)
    loaded = safetensors.numpy.load_file(tmp_path / "s.safetensors")
    assert set(loaded) == set(arrays) and all(np.array_equal(loaded[k], v) for k, v in arrays.items())


def test_numpy_own_buffers_are_lined_up_too_and_written_from_their_own_memory(tmp_path, monkeypatch):
    """numpy's large buffers start 16 bytes past a page (malloc's header): a shard they dominate puts
    them at file offsets that agree with their addresses (16-byte aligned in the file, enough for
    every item size), so O_DIRECT writes them without a copy through the block."""
    rng = np.random.default_rng(2)
    arrays = {
        "w": _at_page_offset(rng.random(DIRECT_MIN, dtype=np.float32).view(np.uint8), 16).view(np.float32),
        "v": _at_page_offset(rng.random(DIRECT_MIN // 2, dtype=np.float64).view(np.uint8), 16).view(np.float64),
        "odd": np.arange(5, dtype=np.complex64),
        "short": np.arange(3, dtype=np.int16),
        "bytes": np.arange(7, dtype=np.uint8),
    }
    plan = plan_shards(arrays, 64 << 20)[0]
    slots = {slot.name: slot for slot in plan.slots}
    assert slots["w"].begin % ALIGN == 16 and slots["v"].begin % ALIGN == 16
    assert all(slots[name].begin % arrays[name].itemsize == 0 for name in arrays), "every tensor item-aligned"
    writes: list[np.ndarray] = []

    def spy(fd: int, data: np.ndarray) -> None:
        writes.append(data)
        _write_aligned(fd, data)

    monkeypatch.setattr(direct_io, "_write_aligned", spy)
    storage = Storage(LocalFileSystem(), str(tmp_path))
    storage.write_object("s.safetensors", (chunk for _, chunk in iter_shard_chunks(plan, arrays)), plan.size)
    if not writes:
        pytest.skip("this filesystem refuses O_DIRECT")
    for name in ("w", "v"):
        from_source = sum(w.nbytes for w in writes if np.shares_memory(w, arrays[name]))
        assert from_source >= arrays[name].nbytes - 2 * ALIGN, name
    loaded = safetensors.numpy.load_file(tmp_path / "s.safetensors")
    assert set(loaded) == set(arrays) and all(np.array_equal(loaded[k], v) for k, v in arrays.items())
