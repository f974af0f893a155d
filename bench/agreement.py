"""What replica agreement costs a save (issue 47): hashing a rank's state against the save's blocked
time, both on 1 GiB of float32 tensors in this process, interleaved.

    python bench/agreement.py [--gib 1] [--tensors 64] [--reps 5]

The blocked time of an async save is its capture: the state copied into the staging buffers
(`snapshot_arrays`, what training waits for). Agreement adds, on every rank, a CRC32C of every tensor
of the model and optimizer (ckptstore/agreement.py `hashes`) before the save, and a gather of a
few bytes per tensor (not measured here: ~1 ms on 2 gloo ranks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from ckptstore.agreement import hashes  # noqa: E402
from ckptstore.client.engine.staging import snapshot_arrays  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    each = int(args.gib * 2**30 / 4 / args.tensors)
    views = {f"t{i}": np.random.default_rng(i).random(each, dtype=np.float32) for i in range(args.tensors)}
    staging: dict[str, np.ndarray] = {}
    capture, hashing = [], []
    for _ in range(args.reps):
        started = time.perf_counter()
        snapshot_arrays(views, staging)
        capture.append(time.perf_counter() - started)
        started = time.perf_counter()
        hashes(views)
        hashing.append(time.perf_counter() - started)
    c, h = statistics.median(capture), statistics.median(hashing)
    print(f"{args.gib} GiB in {args.tensors} tensors, median of {args.reps} interleaved:")
    print(f"save blocked (capture into staging): {c:.3f} s; agreement hashing: {h:.3f} s; ratio {h / c:.2f}")


if __name__ == "__main__":
    main()
