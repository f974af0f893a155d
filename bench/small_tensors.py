"""Many small tensors (issue 35, part 2): 10,000 × 4 KiB saved and loaded by `Store` against a raw
write and read of the same bytes.

    python bench/small_tensors.py [--reps 5] [--tree PATH ...]

Local disk, warm page cache, one process per tree. Raw: the bytes written into one file (+ fsync),
then read back whole and cut into 10,000 arrays. Store: `save` of a new epoch (its dedup base the
previous one, as in training), then `load`. Interleaved raw / Store each repetition; medians in ms and
ratios raw ÷ Store (1.0: as fast as raw). `--tree`: also measure these source trees (a `git archive`
of an older commit), each in its own process.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.trees import main_per_tree  # noqa: E402


def measure(tree: str, reps: int) -> dict:
    import numpy as np

    from ckptstore import Store

    rng = np.random.default_rng(0)
    arrays = {f"p{i:05d}": rng.random(1024, dtype=np.float32) for i in range(10_000)}
    folder = tempfile.mkdtemp(prefix="ckptstore-small-tensors-")

    def raw() -> tuple[float, float]:
        path = os.path.join(folder, "raw")
        started = time.perf_counter()
        with open(path, "wb") as handle:
            for array in arrays.values():
                handle.write(array.tobytes())
            handle.flush()
            os.fsync(handle.fileno())
        written = time.perf_counter() - started
        started = time.perf_counter()
        with open(path, "rb") as handle:
            data = handle.read()
        loaded = {name: np.frombuffer(data, np.float32, 1024, i * 4096).copy() for i, name in enumerate(arrays)}
        assert len(loaded) == len(arrays)
        return written, time.perf_counter() - started

    store = Store(folder)

    def ours(epoch: int) -> tuple[float, float]:
        for array in arrays.values():
            array[0] = epoch  # a training step changed every tensor
        started = time.perf_counter()
        store.save("small", "n0", epoch, arrays, attempt="1")
        written = time.perf_counter() - started
        started = time.perf_counter()
        loaded = store.load("small", "n0", epoch)
        assert len(loaded) == len(arrays)
        return written, time.perf_counter() - started

    ours(0)
    raws, stores = [], []
    for epoch in range(1, reps + 1):
        raws.append(raw())
        stores.append(ours(epoch))
    median = statistics.median
    return {
        "save_ms": median(s[0] for s in stores) * 1000,
        "load_ms": median(s[1] for s in stores) * 1000,
        "raw_write_ms": median(r[0] for r in raws) * 1000,
        "raw_read_ms": median(r[1] for r in raws) * 1000,
    }


def show(r: dict) -> str:
    save, load = r["raw_write_ms"] / r["save_ms"], r["raw_read_ms"] / r["load_ms"]
    return (
        f"save {r['save_ms']:.0f} ms (raw {r['raw_write_ms']:.0f}: {save:.2f}), "
        f"load {r['load_ms']:.0f} ms (raw {r['raw_read_ms']:.0f}: {load:.2f})"
    )


if __name__ == "__main__":
    main_per_tree(__file__, __doc__, measure, show, reps=5)
