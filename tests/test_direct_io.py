"""O_DIRECT writes: exact bytes whatever the chunking and size, and the buffered fallback."""

from __future__ import annotations

import fcntl
import os

import numpy as np
import pytest
from fsspec.implementations.local import LocalFileSystem

from ckptstore.direct_io import ALIGN, BLOCK, _write_aligned, open_direct, write_direct
from ckptstore.storage import Storage

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
