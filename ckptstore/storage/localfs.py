"""Local-disk operations behind `Storage`: durable writes (fsync of files and directories, atomic
publish), fast reads, and listings that never follow a symbolic link out of the storage root.

Invariant: nothing here follows a symbolic link while walking a tree, and `escapes` tells the
callers that delete whether a path leaves its root (a link anywhere on the way, or a real path
outside), so retention never deletes another tree through a link.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable, Iterator

import numpy as np

from ckptstore.format.shard import ALIGN
from ckptstore.storage.direct_io import open_direct, read_direct, write_direct

__all__ = [
    "aligned_empty",
    "write_file",
    "publish",
    "fsync_path",
    "fsync_directories",
    "read_whole",
    "read_buffered",
    "iter_file",
    "walk_files",
    "escapes",
]

_READ_CHUNK = 16 << 20


def aligned_empty(size: int, align: int = ALIGN) -> np.ndarray:
    """An uninitialised byte buffer whose start is `align`-aligned (by default as the large tensors in a shard)."""
    raw = np.empty(size + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + size]


def write_file(path: str, chunks: Iterable[memoryview | bytes], size: int | None) -> None:
    """Write chunks to `path` with O_DIRECT where the filesystem allows it, else buffered (not fsynced)."""
    fd = open_direct(path, size)
    if fd is None:
        with open(path, "wb") as handle:
            for chunk in chunks:
                handle.write(chunk)
        return
    try:
        write_direct(fd, chunks)
    finally:
        os.close(fd)


def publish(path: str, data: bytes, temp_prefix: str) -> None:
    """Write `data` to a temp file, fsync it, rename it to `path`, fsync the directory: readers see
    nothing or all of it, and it survives a crash once this returns."""
    directory = os.path.dirname(path)
    temp = os.path.join(directory, temp_prefix + secrets.token_hex(6))
    try:
        with open(temp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.rename(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    fsync_directories(directory)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directories(path: str, up_to: int = 0) -> None:
    """fsync a directory and `up_to` of its parents, making their entries durable."""
    for _ in range(up_to + 1):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        path = os.path.dirname(path)


def read_whole(path: str) -> np.ndarray:
    """A whole file in one new buffer: O_DIRECT where possible (no page-cache copy), else buffered."""
    direct = read_direct(path)
    return direct if direct is not None else read_buffered(path)


def read_buffered(path: str, buffer: np.ndarray | None = None) -> np.ndarray:
    """A whole file read through the page cache into `buffer` (grown to an ALIGN-aligned one when
    it is too small); the bytes stay cached for a second read."""
    with open(path, "rb", buffering=0) as handle:
        size = os.fstat(handle.fileno()).st_size
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        if buffer is None or buffer.size < size:
            buffer = aligned_empty(size)
        view = buffer.data
        filled = 0
        # Moderate chunks keep readahead streaming; one huge read measured ~40 % slower cold.
        while filled < size:
            got = handle.readinto(view[filled : filled + _READ_CHUNK])
            if not got:
                break
            filled += got
        return buffer[:filled]


def iter_file(path: str, chunk_size: int) -> Iterator[memoryview]:
    """A file as chunks of at most `chunk_size` bytes, reusing one buffer (use each chunk before the next)."""
    with open(path, "rb", buffering=0) as handle:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        buffer = bytearray(chunk_size)
        while got := handle.readinto(buffer):
            yield memoryview(buffer)[:got]


def walk_files(top: str) -> Iterator[tuple[str, os.stat_result]]:
    """(path relative to `top`, stat) of every regular file below `top`, not following symbolic links."""
    for directory, _, files in os.walk(top, followlinks=False):
        for name in files:
            path = os.path.join(directory, name)
            info = os.lstat(path)
            if not os.path.islink(path):
                yield os.path.relpath(path, top), info


def escapes(root: str, relpath: str) -> bool:
    """Whether `root/relpath` leaves `root`: a symbolic link on the way, or a real path outside it."""
    path = root
    for part in relpath.split("/"):
        path = os.path.join(path, part)
        if os.path.islink(path):
            return True
    real_root = os.path.realpath(root)
    return os.path.commonpath([real_root, os.path.realpath(path)]) != real_root
