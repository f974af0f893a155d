"""The storage face: the handful of fsspec operations ckptstore needs, durable on every backend.

Invariant (commit): every shard is fully written — and, on local disk, fsynced together with its
directory — before the manifest is published; the manifest is published atomically (local: temp
file, fsync, rename, fsync of the directory; object stores: a single PUT). "What exists" is read
from filesystems opened with `skip_instance_cache=True, use_listings_cache=False`, so another
process's new checkpoint is never hidden by a cached listing.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from ckptstore.direct_io import open_direct, write_direct
from ckptstore.layout import MANIFEST_TEMP_PREFIX

__all__ = ["Storage", "StoredFile", "open_storage"]

_READ_CHUNK = 16 << 20


@dataclass(frozen=True)
class StoredFile:
    """A file found under a prefix: its path relative to that prefix, size and modification time."""

    relpath: str
    size: int
    mtime: float | None


def _mtime(info: dict[str, Any]) -> float | None:
    for key in ("mtime", "LastModified", "updated", "mtime_ns"):
        value = info.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        if isinstance(value, (int, float)):
            return float(value) / (1e9 if key == "mtime_ns" else 1)
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                return None
    return None


class Storage:
    """One fsspec filesystem plus a root path; every path argument is relative to the root."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str):
        self.fs = fs
        self.root = root.rstrip("/") or root
        self.is_local = isinstance(fs, LocalFileSystem)

    def path(self, relpath: str) -> str:
        return f"{self.root}/{relpath}" if relpath else self.root

    # -- writing -------------------------------------------------------------------------------

    def write_object(self, relpath: str, chunks: Iterable[memoryview | bytes], size: int | None = None) -> None:
        """Write a whole object from chunks (`size`: their total, if known). Local files are written
        with O_DIRECT where the filesystem allows it (else into the page cache); either way
        `sync_files` makes them durable."""
        path = self.path(relpath)
        if self.is_local:
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
        else:
            # Object stores need one bytes body (botocore refuses memoryviews): this is the one copy.
            self.fs.pipe_file(path, b"".join(chunks))

    def publish_object(self, relpath: str, data: bytes) -> None:
        """Publish `data` at `relpath` atomically: readers see nothing or all of it."""
        path = self.path(relpath)
        if not self.is_local:
            self.fs.pipe_file(path, data)
            return
        directory = os.path.dirname(path)
        temp = os.path.join(directory, MANIFEST_TEMP_PREFIX + secrets.token_hex(6))
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
        self.sync_directory(os.path.dirname(relpath))

    def make_prefix(self, relpath: str) -> None:
        """Create a directory prefix (local disk only; object stores have no directories)."""
        if self.is_local:
            os.makedirs(self.path(relpath), exist_ok=True)

    def sync_files(self, relpaths: Iterable[str], pool: Executor) -> None:
        """fsync local files written by `write_object`, all at once, so the disk gets large batches
        (3 GiB measured: 1.6 GB/s, as fast as one raw file, vs 1.0 GB/s with an fsync per file). No-op on object stores."""
        if not self.is_local:
            return

        def sync(relpath: str) -> None:
            fd = os.open(self.path(relpath), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        for _ in pool.map(sync, relpaths):
            pass

    def sync_directory(self, relpath: str, *, up_to: int = 0) -> None:
        """fsync a local directory and `up_to` of its parents, making their entries durable."""
        if not self.is_local:
            return
        path = self.path(relpath)
        for _ in range(up_to + 1):
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            path = os.path.dirname(path)

    # -- reading -------------------------------------------------------------------------------

    def read_object(self, relpath: str) -> bytes | np.ndarray:
        """A whole object as a buffer (local: read straight into one numpy buffer)."""
        path = self.path(relpath)
        if not self.is_local:
            return self.fs.cat_file(path)
        with open(path, "rb", buffering=0) as handle:
            size = os.fstat(handle.fileno()).st_size
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            buffer = np.empty(size, dtype=np.uint8)
            view = memoryview(buffer)
            filled = 0
            # Moderate chunks keep readahead streaming; one huge read measured ~40 % slower cold.
            while filled < size:
                got = handle.readinto(view[filled : filled + _READ_CHUNK])
                if not got:
                    break
                filled += got
            return buffer[:filled]

    def read_objects(
        self,
        relpaths: Sequence[str],
        *,
        concurrency: int,
        check: Callable[[str, bytes | np.ndarray], None] | None = None,
    ) -> dict[str, bytes | np.ndarray | Exception]:
        """Several whole objects, fetched concurrently; failures (and `check`'s raises) come back as exceptions.

        On local disk `check` runs in the reading thread, overlapping verification with I/O.
        """

        def checked(relpath: str, blob: bytes | np.ndarray | Exception) -> bytes | np.ndarray | Exception:
            if check is None or isinstance(blob, Exception):
                return blob
            try:
                check(relpath, blob)
            except Exception as exc:
                return exc
            return blob

        if self.is_local or len(relpaths) <= 1:

            def read(relpath: str) -> bytes | np.ndarray | Exception:
                try:
                    return checked(relpath, self.read_object(relpath))
                except OSError as exc:
                    return exc

            with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(relpaths)))) as pool:
                return dict(zip(relpaths, pool.map(read, relpaths)))
        paths = [self.path(r) for r in relpaths]
        fetched = self.fs.cat(paths, on_error="return", batch_size=concurrency)
        by_path = {self.fs._strip_protocol(p): v for p, v in fetched.items()}
        return {
            r: checked(r, by_path.get(self.fs._strip_protocol(p), FileNotFoundError(p)))
            for r, p in zip(relpaths, paths)
        }

    def read_ranges(self, relpaths: Sequence[str], starts: Sequence[int], ends: Sequence[int]) -> list[bytes]:
        """Byte ranges `[start, end)` of objects (range requests on object stores)."""
        paths = [self.path(r) for r in relpaths]
        return self.fs.cat_ranges(paths, list(starts), list(ends), on_error="raise")

    def size(self, relpath: str) -> int | None:
        """The object's size, or None if it does not exist."""
        try:
            return int(self.fs.info(self.path(relpath))["size"])
        except FileNotFoundError:
            return None

    def list_names(self, relpath: str) -> list[str]:
        """Names of the entries directly under a prefix (uncached); [] if there is none."""
        try:
            entries = self.fs.ls(self.path(relpath), detail=False)
        except FileNotFoundError:
            return []
        return sorted({entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries})

    def find(self, relpath: str) -> list[StoredFile]:
        """Every file under a prefix, recursively (uncached), with sizes and modification times."""
        base = self.fs._strip_protocol(self.path(relpath)).rstrip("/")
        try:
            found = self.fs.find(self.path(relpath), detail=True)
        except FileNotFoundError:
            return []
        files = []
        for path, info in found.items():
            stripped = self.fs._strip_protocol(path)
            if info.get("type", "file") == "directory" or not stripped.startswith(base + "/"):
                continue
            files.append(StoredFile(stripped[len(base) + 1 :], int(info.get("size") or 0), _mtime(info)))
        return files

    # -- deleting ------------------------------------------------------------------------------

    def remove_file(self, relpath: str) -> bool:
        """Delete one object; False if it did not exist."""
        try:
            self.fs.rm_file(self.path(relpath))
        except FileNotFoundError:
            return False
        return True

    def remove_prefix(self, relpath: str) -> None:
        """Delete everything under a prefix (and the local directory itself)."""
        try:
            self.fs.rm(self.path(relpath), recursive=True)
        except FileNotFoundError:
            pass

    def remove_empty_directory(self, relpath: str) -> None:
        """Remove a local directory if it is empty (object stores have none to remove)."""
        if self.is_local:
            try:
                os.rmdir(self.path(relpath))
            except OSError:
                pass


def open_storage(url: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """Open any fsspec URL without instance or listing caches."""
    options = {"skip_instance_cache": True, "use_listings_cache": False, **(storage_options or {})}
    fs, root = fsspec.core.url_to_fs(url, **options)
    if isinstance(fs, LocalFileSystem):
        root = os.path.abspath(root)
    return Storage(fs, root)
