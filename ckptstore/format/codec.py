"""The optional lossless codec of a store's blobs: byte grouping, then zstd.

An encoded blob is one zstd frame (its decoded size in the frame header) of the blob's safetensors
bytes with each tensor's bytes **grouped**: for an item size of k bytes, first byte 0 of every
value, then byte 1 of every value, …, byte k−1 of every value. The header (the first 8 + N bytes)
and tensors of 1-byte items are as in the plain file. Grouping puts the exponent bytes of floats
side by side, which is what makes bf16 weights and fp32 optimizer moments compress (bench/RESULTS.md
"bytes paid once": 1.46× on bf16, 1.19× on fp32 Adam moments, zstd level 1).

A blob is stored encoded only where it pays (`MIN_RATIO`): a shard of random or already dense bytes
is stored plain. docs/layout.md shows how to decode one without ckptstore (zstd, then ungroup each
tensor by its dtype's size).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from typing import Literal

import numpy as np
import zstandard

from ckptstore.format.crc import Buffer, byte_view
from ckptstore.format.shard import numpy_dtype
from ckptstore.storage.localfs import aligned_empty

__all__ = ["Codec", "CODEC_NAME", "check_codec", "MIN_RATIO", "LEVEL", "encode", "decode", "blob_items"]

Codec = Literal["bytegroup-zstd"]
CODEC_NAME: Codec = "bytegroup-zstd"
MIN_RATIO = 1.05  # a blob is stored encoded only if it shrinks by at least this factor
LEVEL = 1  # zstd level: ~0.3 GB/s a stream here; negative levels are barely faster and lose most of the ratio
_HEADER_LIMIT = 100 << 20


def check_codec(codec: str | None) -> Codec | None:
    """`codec` if it names the codec (or None: off); ValueError otherwise."""
    if codec not in (None, CODEC_NAME):
        raise ValueError(f"codec must be {CODEC_NAME!r} or None (off), got {codec!r}")
    return None if codec is None else CODEC_NAME


def encode(items: Iterable[tuple[Buffer | memoryview, int]], size: int) -> bytes | None:
    """One zstd frame of the blob whose parts, in file order, are `items` ((bytes, item size) pairs,
    the header's item size 1) of `size` bytes in all; None when encoding would not pay."""
    blob = np.empty(size, dtype=np.uint8)
    offset = 0
    for view, itemsize in items:
        part = np.frombuffer(byte_view(view), dtype=np.uint8)
        target = blob[offset : offset + len(part)]
        if itemsize == 1:
            target[:] = part
        else:  # a strided read per plane: 5-10× a transposed copy here
            for index, plane in enumerate(np.split(target, itemsize)):
                plane[:] = part[index::itemsize]
        offset += len(part)
    # One call on the whole blob: a third faster than streaming it through a compression object.
    encoded = zstandard.ZstdCompressor(level=LEVEL, write_content_size=True).compress(blob.data)
    return encoded if len(encoded) * MIN_RATIO <= size else None


def blob_items(blob: Buffer | memoryview) -> Iterator[tuple[memoryview, int]]:
    """A plain safetensors blob's parts in file order, with the item size each is grouped by: the header
    and any bytes between tensors (1), then each tensor (its dtype's size). ValueError if it is not one."""
    view = byte_view(blob)
    if len(view) < 8:
        raise ValueError("a safetensors file is at least 8 bytes")
    (header_size,) = struct.unpack("<Q", view[:8])
    if header_size > min(_HEADER_LIMIT, len(view) - 8):
        raise ValueError(f"safetensors header of {header_size} bytes does not fit the file")
    try:
        entries = json.loads(bytes(view[8 : 8 + header_size]))
        ranges = sorted(
            (int(entry["data_offsets"][0]), int(entry["data_offsets"][1]), numpy_dtype(entry["dtype"]).itemsize)
            for name, entry in entries.items()
            if name != "__metadata__"
        )
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"not a safetensors header: {exc}") from None
    done = 0
    base = 8 + header_size
    for begin, end, itemsize in ranges:
        begin, end = base + begin, base + end
        if begin < done or end > len(view) or (end - begin) % itemsize:
            raise ValueError("safetensors tensors overlap or leave the file")
        if begin > done:
            yield view[done:begin], 1
        yield view[begin:end], itemsize
        done = end
    if done < len(view):
        yield view[done:], 1


def decode(encoded: Buffer, size: int) -> np.ndarray:
    """The plain safetensors bytes (`size` of them, in new aligned memory) of an encoded blob, streamed:
    each tensor's planes are read in pieces and put in place, so decoding holds the output and one piece,
    not a second copy. `size` comes from the manifest, untrusted: a frame that decodes to more is
    stopped there, and one claiming far more than it holds (`SUSPECT_RATIO`) is first decoded without
    keeping anything, so a small blob claiming gigabytes is found short before they are allocated.
    ValueError when the frame does not decode to a safetensors blob of that size."""
    view = byte_view(encoded)
    if size > SUSPECT_RATIO * max(len(view), 1):
        found = _decoded_size(view, limit=size)
        if found != size:
            raise ValueError(f"decodes to {'more than ' if found > size else ''}{found} bytes, not {size}")
    out = aligned_empty(size)
    try:
        with zstandard.ZstdDecompressor().stream_reader(view, read_across_frames=False) as reader:
            _read_into(reader, out[:8])
            (header_size,) = struct.unpack("<Q", out[:8].tobytes())
            if header_size > min(_HEADER_LIMIT, size - 8):
                raise ValueError(f"safetensors header of {header_size} bytes does not fit the blob")
            _read_into(reader, out[8 : 8 + header_size])
            offset = 0  # the header is not grouped: the plain file's layout is read from it
            for part, itemsize in blob_items(out):
                count = len(part)
                if itemsize == 1:
                    begin = max(offset, 8 + header_size)
                    _read_into(reader, out[begin : offset + count])
                else:
                    for plane in range(itemsize):
                        _read_plane(reader, out[offset + plane : offset + count : itemsize])
                offset += count
            if reader.read(1):
                raise ValueError(f"decodes to more than {size} bytes")
    except zstandard.ZstdError as exc:
        raise ValueError(f"not a zstd frame: {exc}") from None
    return out


SUSPECT_RATIO = 64  # plain bytes per encoded byte above which a claim is checked before memory is taken
_PIECE = 16 << 20


def _decoded_size(view: memoryview, *, limit: int) -> int:
    """How many bytes the frame decodes to, keeping none of them (stopping once past `limit`)."""
    total = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(view, read_across_frames=False) as reader:
            while total <= limit and (piece := reader.read(_PIECE)):
                total += len(piece)
    except zstandard.ZstdError as exc:
        raise ValueError(f"not a zstd frame: {exc}") from None
    return total


def _read_into(reader: zstandard.ZstdDecompressionReader, target: np.ndarray) -> None:
    """Fill `target` (contiguous) from the stream; ValueError if it ends first."""
    done, size = 0, len(target)
    while done < size:
        got = reader.readinto(target[done : done + _PIECE].data)
        if not got:
            raise ValueError("decodes to fewer bytes than its manifest says")
        done += got


def _read_plane(reader: zstandard.ZstdDecompressionReader, target: np.ndarray) -> None:
    """Fill the strided `target` (one byte of every value of a tensor) from the stream, a piece at a time."""
    done, size = 0, len(target)
    while done < size:
        piece = reader.read(min(_PIECE, size - done))
        if not piece:
            raise ValueError("decodes to fewer bytes than its manifest says")
        target[done : done + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
        done += len(piece)
