"""An fsspec filesystem whose reads are range requests: `cat_ranges` is the one read a subclass writes,
`cat` of one path or many goes through it, and an open file is its `file_class`, unbuffered (each read
one request) — the presigned data path's and a peer's blob server's filesystems
(`ckptstore.client.service.presigned`, `ckptstore.client.peers.filesystem`)."""

from __future__ import annotations

import errno
from typing import Any

from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from ckptstore.storage.filesystem import UPLOAD_PART_SIZE

__all__ = ["RangedReadFileSystem", "range_header"]


class RangedReadFileSystem(AbstractFileSystem):  # type: ignore[misc]  # fsspec has no types
    """`cat` as whole-object `cat_ranges` (ranges None to None), which the subclass implements; files
    opened as `file_class` in blocks of UPLOAD_PART_SIZE (`read_only`: for reading only)."""

    file_class: type[AbstractBufferedFile]
    read_only = False

    def cat(
        self, path: Any, recursive: bool = False, on_error: str = "raise", batch_size: int | None = None, **kwargs: Any
    ) -> Any:
        paths = [path] if isinstance(path, str) else list(path)
        found = self.cat_ranges(paths, [None] * len(paths), [None] * len(paths), on_error=on_error)
        return found[0] if isinstance(path, str) else dict(zip(paths, found))

    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: Any = None,
        autocommit: bool = True,
        cache_options: Any = None,
        **kwargs: Any,
    ) -> AbstractBufferedFile:
        if self.read_only and mode != "rb":
            raise PermissionError(errno.EROFS, f"{path} is read-only here")
        kwargs["cache_type"] = "none"
        return self.file_class(self, path, mode, block_size or UPLOAD_PART_SIZE, **kwargs)


def range_header(start: int, end: int | None) -> str:
    """The HTTP Range header's value for bytes [start, end) (end None: to the end)."""
    return f"bytes={start}-{'' if end is None else end - 1}"
