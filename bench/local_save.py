"""A local save against the disk's best raw pattern (issue 35, part 5): `Store.save` of a 1 GiB dense
model against 4 threads writing the same number of bytes with O_DIRECT + fsync.

    python bench/local_save.py [--reps 5] [--tree PATH ...]   (BENCH_GIB=1, BENCH_SOURCE=numpy|torch)

Raw: 4 threads, each its own preallocated file, writing a quarter of the bytes from a page-aligned
buffer in 32 MiB pieces with O_DIRECT, then fsync — no copy, no checksum: the disk's limit for this
many bytes. Raw per file: the same 4 threads writing the files a save writes (one per tensor over the
shard size, one for the rest) from the tensors' own memory, the page-aligned part of each — what the
same writes cost without checksums, hashes or a manifest. Store: a save of `bench.save_restore.model_like` (a few 128 MiB matrices and many small
biases; numpy's own allocations, or with BENCH_SOURCE=torch the same values in tensors PyTorch
allocated) to a new root each time (no earlier copy to share blobs with), the
default store (64 MiB shards, 4 writers, O_DIRECT). Page cache dropped before each (`sync` first, so
no earlier write is still being flushed); raw and Store interleaved; medians; ratio = raw ÷ Store time
(1.0: as fast as the raw writers). `--tree`: also measure these source trees, each in its own process.
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.save_restore import drop_caches, model_like, nbytes  # noqa: E402
from bench.trees import main_per_tree  # noqa: E402

WRITERS = 4
PIECE = 32 << 20
GIB = float(os.environ.get("BENCH_GIB", "1"))
SOURCE = os.environ.get("BENCH_SOURCE", "numpy")


def allocated(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays where SOURCE allocates them: numpy's own memory starts 16 bytes past a page, PyTorch's
    is 64-byte aligned (what lets a save write a large tensor from its own memory with O_DIRECT)."""
    if SOURCE == "numpy":
        return arrays
    import torch

    return {name: torch.from_numpy(array).clone().numpy() for name, array in arrays.items()}


def raw_write(folder: str, parts: list[list[memoryview]]) -> float:
    """4 O_DIRECT writers over one file per entry of `parts` (its page-aligned pieces back to back),
    each fsynced."""

    def write(index: int) -> None:
        fd = os.open(os.path.join(folder, f"raw{index}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
        try:
            os.posix_fallocate(fd, 0, sum(len(part) for part in parts[index]))
            offset = 0
            for part in parts[index]:
                for start in range(0, len(part), PIECE):
                    offset += os.pwrite(fd, part[start : start + PIECE], offset)
            os.fsync(fd)
        finally:
            os.close(fd)

    started = time.perf_counter()
    with ThreadPoolExecutor(WRITERS) as pool:
        list(pool.map(write, range(len(parts))))
    return time.perf_counter() - started


def page_aligned(array: np.ndarray) -> memoryview:
    """The whole pages of an array's memory (O_DIRECT writes them from there)."""
    view = np.frombuffer(array.data.cast("B"), np.uint8)
    lead = -view.ctypes.data % mmap.PAGESIZE
    return view[lead : lead + (view.size - lead) // mmap.PAGESIZE * mmap.PAGESIZE].data


def measure(tree: str, reps: int) -> dict:
    from ckptstore import Store

    arrays = allocated(model_like(int(GIB * 2**30)))
    size = nbytes(arrays)
    aligned = mmap.mmap(-1, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
    aligned.write(b"\x01" * len(aligned))
    quarter = -(-len(aligned) // WRITERS // mmap.PAGESIZE) * mmap.PAGESIZE
    quarters = [[memoryview(aligned)[i * quarter : (i + 1) * quarter]] for i in range(WRITERS)]
    large = [a for a in arrays.values() if a.nbytes > 64 << 20]
    per_file = [[page_aligned(a)] for a in large] + [[page_aligned(a) for a in arrays.values() if a.nbytes <= 64 << 20]]
    work = tempfile.mkdtemp(prefix="ckptstore-local-save-", dir=os.environ.get("BENCH_DIR"))
    seconds: dict[str, list[float]] = {"raw": [], "raw_per_file": [], "store": []}
    cold = True
    for rep in range(reps):
        for variant in list(seconds)[:: 1 if rep % 2 == 0 else -1]:
            cold = drop_caches() and cold
            folder = os.path.join(work, f"{variant}{rep}")
            os.makedirs(folder)
            if variant == "store":
                started = time.perf_counter()
                Store(folder).save("job", "n0", 0, arrays, attempt="1")
                seconds[variant].append(time.perf_counter() - started)
            else:
                seconds[variant].append(raw_write(folder, quarters if variant == "raw" else per_file))
            shutil.rmtree(folder)
    shutil.rmtree(work, ignore_errors=True)
    return {"bytes": size, "cold": cold, "source": SOURCE, **{f"{k}_s": v for k, v in seconds.items()}}


def show(r: dict) -> str:
    raw, per_file, store = (statistics.median(r[k]) for k in ("raw_s", "raw_per_file_s", "store_s"))
    listed = "; ".join(
        f"{k[:-2]} {', '.join(f'{s:.2f}' for s in r[k])}" for k in ("store_s", "raw_s", "raw_per_file_s")
    )
    return (
        f"{r['bytes'] / 1e9:.2f} GB from {r['source']}: save {store:.3f} s ({r['bytes'] / store / 1e9:.2f} GB/s); 4 O_DIRECT writers "
        f"{raw:.3f} s, ratio {raw / store:.2f}; the same writers over the save's files {per_file:.3f} s, ratio "
        f"{per_file / store:.2f} ({listed})" + ("" if r["cold"] else " — page cache NOT dropped")
    )


if __name__ == "__main__":
    main_per_tree(__file__, __doc__, measure, show, reps=5)
