"""What the resume audit costs: the fingerprint each save records, and the audit each restore runs,
against a save's blocked time and a restore's total time, for ≈ 1 GiB of PyTorch state.

    python bench/audit.py [--gib 1] [--reps 5]

Two layouts of the same bytes: `model_like` (8 large matrices, 200 biases) and 4,000 tensors (a
deep model's many small parameters: the fingerprint lists each one). Each repetition saves through
`ckptstore.client.torch.CheckpointManager` (async: the blocked time is what training waits) into a fresh
directory, then restores it cold into a new manager (page cache dropped where the OS allows). The
fingerprint and the audit are timed where they run, inside those very calls (their functions
wrapped with a timer), so the ratios do not rest on two noisy totals. Reports medians.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import ckptstore.client.engine.manager  # noqa: E402
import ckptstore.client.torch.manager  # noqa: E402
from bench.save_restore import drop_caches, model_like  # noqa: E402
from bench.torch_save import Holder  # noqa: E402
from ckptstore.client.torch import CheckpointManager  # noqa: E402


def many_tensors(total_bytes: int, count: int = 4000) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    size = total_bytes // count // 4
    return {f"block{i // 8}/param{i % 8}": rng.random(size, dtype=np.float32) for i in range(count)}


class Timed:
    """Wraps `owner.name` so every call's seconds add up in `seconds`."""

    def __init__(self, owner: Any, name: str):
        self.seconds, original = 0.0, getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        setattr(owner, name, timed)


def one(tensors: dict[str, torch.Tensor], root: str, fingerprint: Timed, audit: Timed) -> dict[str, float]:
    fingerprint.seconds = audit.seconds = 0.0
    saver = CheckpointManager(objects={"model": Holder(tensors)}, storage=root, job="audit", node="n0")
    saver.restore_or_initialize()
    started = time.perf_counter()
    saver.save(0)
    blocked = time.perf_counter() - started
    saver.close()
    save_fingerprint = fingerprint.seconds
    drop_caches()
    fresh = {name: torch.empty_like(tensor) for name, tensor in tensors.items()}
    restorer = CheckpointManager(objects={"model": Holder(fresh)}, storage=root, job="audit", node="n0")
    started = time.perf_counter()
    restorer.restore_or_initialize()
    restore = time.perf_counter() - started
    restorer.close()
    assert restorer.audit is not None and restorer.audit.verdict == "exact", restorer.audit
    return {"blocked": blocked, "fingerprint": save_fingerprint, "restore": restore, "audit": audit.seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    fingerprint = Timed(ckptstore.client.torch.manager, "fingerprint")
    audit = Timed(ckptstore.client.engine.manager.LoopManager, "_audit")
    total = int(args.gib * 2**30)
    layouts: dict[str, Callable[[int], dict[str, np.ndarray]]] = {
        "model_like": model_like,
        "4000 tensors": many_tensors,
    }
    print(f"{platform.node()} {platform.processor()} torch {torch.__version__}; {args.gib} GiB; {args.reps} reps")
    for name, make in layouts.items():
        tensors = {k: torch.from_numpy(v) for k, v in make(total).items()}
        runs = []
        for _ in range(args.reps):
            root = tempfile.mkdtemp(prefix="ckpt-audit-", dir=os.environ.get("BENCH_DIR"))
            try:
                runs.append(one(tensors, root, fingerprint, audit))
            finally:
                shutil.rmtree(root, ignore_errors=True)
        med = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(
            f"{name:13s} {len(tensors):5d} tensors: save blocked {med['blocked'] * 1e3:7.1f} ms, fingerprint "
            f"{med['fingerprint'] * 1e3:6.2f} ms ({100 * med['fingerprint'] / med['blocked']:.2f} %); restore "
            f"{med['restore']:.2f} s, audit {med['audit'] * 1e3:6.2f} ms ({100 * med['audit'] / med['restore']:.2f} %)"
        )


if __name__ == "__main__":
    main()
