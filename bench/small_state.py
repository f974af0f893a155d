"""A small PyTorch state's restore against `torch.load` + `load_state_dict` (issue 35: fixed costs).

    python bench/small_state.py [--reps 15] [--tree PATH ...]

A 3-layer MLP with its Adam state (12.7 MB), saved once on local disk by `ckptstore.client.torch.CheckpointManager`
(no service) and by `torch.save`. Each repetition, interleaved: a fresh model and optimizer, then
(a) a new `CheckpointManager` and `restore_or_initialize()` — what a restarting script runs —, and
(b) `torch.load(weights_only=True)` + `load_state_dict` for both; warm page cache, one process.
`--tree`: also time the manager from these source trees (a `git archive` of an older commit), each in
its own process, for a before/after in one run. Prints medians in ms and the ratio a / b.
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.trees import main_per_tree  # noqa: E402


def measure(tree: str, reps: int) -> dict:
    import torch

    from ckptstore.client.torch import CheckpointManager

    def make():
        torch.manual_seed(0)
        layers = [torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512), torch.nn.Linear(512, 10)]
        model = torch.nn.Sequential(*layers)
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.randn(4, 512)).sum().backward()
        optimizer.step()
        return model, optimizer

    root = tempfile.mkdtemp(prefix="ckptstore-small-")
    model, optimizer = make()
    with contextlib.redirect_stderr(io.StringIO()):
        manager = CheckpointManager(objects={"model": model, "opt": optimizer}, storage=root, job="small")
        manager.restore_or_initialize()
        manager.save(0)
        manager.close()
    path = os.path.join(root, "state.pt")
    torch.save({"model": model.state_dict(), "opt": optimizer.state_dict()}, path)

    def ours() -> float:
        model, optimizer = make()
        started = time.perf_counter()
        with contextlib.redirect_stderr(io.StringIO()):
            manager = CheckpointManager(objects={"model": model, "opt": optimizer}, storage=root, job="small")
            manager.restore_or_initialize()
        elapsed = time.perf_counter() - started
        manager.close()
        return elapsed

    def theirs() -> float:
        model, optimizer = make()
        started = time.perf_counter()
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["opt"])
        return time.perf_counter() - started

    ours(), theirs()  # warm
    a, b = zip(*((ours(), theirs()) for _ in range(reps)), strict=True)
    return {"ckptstore_ms": statistics.median(a) * 1000, "torch_ms": statistics.median(b) * 1000}


def show(result: dict) -> str:
    ratio = result["ckptstore_ms"] / result["torch_ms"]
    return f"ckptstore {result['ckptstore_ms']:.1f} ms, torch {result['torch_ms']:.1f} ms, ratio {ratio:.2f}"


if __name__ == "__main__":
    main_per_tree(__file__, __doc__, measure, show, reps=15)
