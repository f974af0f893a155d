"""What the resume audit and its proof cost: the fingerprint and the proof's record each save
writes, and the audit and proof each restore runs, against a save's blocked time and a restore's
total time, for ≈ 1 GiB of PyTorch state and a data loader over `--samples` samples.

    python bench/audit.py [--gib 1] [--reps 5] [--samples 1000000] [--epoch-end [--verbose]]

Two layouts of the same bytes: `model_like` (8 large matrices, 200 biases) and 4,000 tensors (a
deep model's many small parameters: the fingerprint lists each one); beside them, in `objects`, the
docs loop's DataLoader over a ResumableSampler, mid-epoch. Each repetition saves through
`ckptstore.client.torch.CheckpointManager` (async: the blocked time is what training waits) into a
fresh directory, then restores it cold into a new manager (page cache dropped where the OS allows)
and draws the first batch, where the proof settles. The fingerprint, the proof's record (the next
sample ids), the audit and the proof (watching the loader, comparing its first ids) are timed where
they run, inside those very calls (their functions wrapped with a timer), so the ratios do not rest
on two noisy totals. Reports medians.

`--epoch-end`: the late record instead (client/audit/late_record.py) — torchdata's
`StatefulDataLoader(shuffle=True)` drained over its epoch, saved at the epoch's end (its next order
cannot be told at the save), its first batch after the save drawn (the ids recorded and written beside
the copy, on a thread of its own: timed apart, off the training path); the restore reads the record
with the audit and checks the first batch against it. `--verbose` prints each run's parts of the save's
record (the next ids, the watch, the first draw handed on, the record's thread started).
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

import ckptstore.client.audit.late_record  # noqa: E402
import ckptstore.client.audit.proof  # noqa: E402
import ckptstore.client.engine.manager  # noqa: E402
import ckptstore.client.engine.node  # noqa: E402
import ckptstore.client.torch.manager  # noqa: E402
import ckptstore.store  # noqa: E402
from bench.save_restore import drop_caches, model_like  # noqa: E402
from bench.torch_save import Holder  # noqa: E402
from ckptstore.client.torch import CheckpointManager, ResumableSampler  # noqa: E402


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


def loader(samples: int) -> torch.utils.data.DataLoader:
    """docs/pytorch.md's loader, over `samples` samples (indices: nothing to fetch but the ids)."""
    dataset = torch.arange(samples)
    return torch.utils.data.DataLoader(dataset, batch_size=32, sampler=ResumableSampler(dataset, seed=1))


def restored(tensors: dict[str, torch.Tensor], root: str, data: Any, timers: dict[str, Timed]) -> dict[str, float]:
    """A cold restore into a new manager over `data`, its first batch drawn and its first step over (the
    proof settles): its seconds, and the audit's and the proof's within them."""
    drop_caches()
    fresh = {name: torch.empty_like(tensor) for name, tensor in tensors.items()}
    restorer = CheckpointManager(objects={"model": Holder(fresh), "data": data}, storage=root, job="audit", node="n0")
    started = time.perf_counter()
    restorer.restore_or_initialize()
    next(iter(data))  # the first batch: the proof compares its ids
    restorer.checkpoint_if_preempted(1, 1)  # the first step is over: the proof settles
    seconds = time.perf_counter() - started
    restorer.close()
    assert restorer.audit is not None and restorer.audit.verdict == "exact", restorer.audit
    proof = sum(timers[name].seconds for name in ("watch", "drawn", "settle"))
    return {"restore": seconds, "audit": timers["audit"].seconds, "proof": proof}


def shuffling_loader(samples: int) -> Any:
    """torchdata's StatefulDataLoader(shuffle=True) over `samples` samples, in batches of 1,024."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(torch.arange(samples), batch_size=1024, shuffle=True)


def one_epoch_end(
    tensors: dict[str, torch.Tensor], root: str, samples: int, timers: dict[str, Timed], verbose: bool = False
) -> dict[str, float]:
    """The late record's costs: a save at an epoch's end and the first batch after it, then the restore."""
    for timer in timers.values():
        timer.seconds = 0.0
    data = shuffling_loader(samples)
    saver = CheckpointManager(objects={"model": Holder(tensors), "data": data}, storage=root, job="audit", node="n0")
    saver.restore_or_initialize()
    for _ in data:  # the epoch, drawn to its end
        pass
    started = time.perf_counter()
    saver.save(0)
    next(iter(data))  # the next epoch's first batch: recorded late
    blocked = time.perf_counter() - started
    saver.close()
    # (`drew` hands the record to `record_drawn_next`, which starts its thread: timed within `drew`.)
    on_path = sum(timers[name].seconds for name in ("fingerprint", "next_ids", "watch_after", "drew"))
    if verbose:
        print({name: round(timers[name].seconds * 1e3, 3) for name in ("next_ids", "watch_after", "drew", "record")})
    save = {"fingerprint": timers["fingerprint"].seconds, "record": on_path - timers["fingerprint"].seconds}
    save["written"] = timers["write_record"].seconds
    timers["watch"].seconds = 0.0  # the save's watch is the record's (above), not the proof's
    restore = restored(tensors, root, shuffling_loader(samples), timers)
    return {"blocked": blocked, **save, **restore}


def one(tensors: dict[str, torch.Tensor], root: str, samples: int, timers: dict[str, Timed]) -> dict[str, float]:
    for timer in timers.values():
        timer.seconds = 0.0
    data = loader(samples)
    saver = CheckpointManager(objects={"model": Holder(tensors), "data": data}, storage=root, job="audit", node="n0")
    saver.restore_or_initialize()
    batches = iter(data)
    for _ in range(10):  # mid-epoch: the save's next ids are the epoch's 321st on
        next(batches)
    started = time.perf_counter()
    saver.save(0, batch=10)
    blocked = time.perf_counter() - started
    saver.close()
    save = {"fingerprint": timers["fingerprint"].seconds, "record": timers["next_ids"].seconds}
    restore = restored(tensors, root, loader(samples), timers)
    return {"blocked": blocked, **save, **restore}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--epoch-end", action="store_true", help="the late record's costs (see the docstring)")
    parser.add_argument("--verbose", action="store_true", help="with --epoch-end: each run's parts of the record")
    args = parser.parse_args()
    timers = {
        "watch_after": Timed(ckptstore.client.torch.manager.CheckpointManager, "_watch_after_save"),
        "drew": Timed(ckptstore.client.audit.late_record.LateRecord, "drew"),
        "record": Timed(ckptstore.client.engine.node.NodeCheckpointer, "record_drawn_next"),
        "write_record": Timed(ckptstore.store.Store, "record_drawn_next"),  # on its own thread
        "fingerprint": Timed(ckptstore.client.torch.manager, "fingerprint"),
        "next_ids": Timed(ckptstore.client.torch.manager, "next_ids"),
        "audit": Timed(ckptstore.client.engine.manager.LoopManager, "_audit"),  # declared, and the proof begun
        "watch": Timed(ckptstore.client.torch.manager, "watch_first_draws"),
        "drawn": Timed(ckptstore.client.audit.proof.ResumeProof, "drawn"),
        "settle": Timed(ckptstore.client.audit.proof.ResumeProof, "settle"),
    }
    total = int(args.gib * 2**30)
    layouts: dict[str, Callable[[int], dict[str, np.ndarray]]] = {
        "model_like": model_like,
        "4000 tensors": many_tensors,
    }
    print(
        f"{platform.node()} {platform.processor()} torch {torch.__version__}; {args.gib} GiB; "
        f"{args.samples:,} samples; {args.reps} reps"
    )
    for name, make in layouts.items():
        tensors = {k: torch.from_numpy(v) for k, v in make(total).items()}
        runs = []
        for _ in range(args.reps):
            root = tempfile.mkdtemp(prefix="ckpt-audit-", dir=os.environ.get("BENCH_DIR"))
            try:
                if args.epoch_end:
                    runs.append(one_epoch_end(tensors, root, args.samples, timers, args.verbose))
                else:
                    runs.append(one(tensors, root, args.samples, timers))
            finally:
                shutil.rmtree(root, ignore_errors=True)
        med = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        at_save, at_restore = med["fingerprint"] + med["record"], med["audit"] + med["proof"]
        print(
            f"{name:13s} {len(tensors):5d} tensors: save blocked {med['blocked'] * 1e3:7.1f} ms, fingerprint "
            f"{med['fingerprint'] * 1e3:6.2f} ms + proof record {med['record'] * 1e3:6.2f} ms "
            f"({100 * at_save / med['blocked']:.2f} %); restore {med['restore']:.2f} s, audit "
            f"{med['audit'] * 1e3:6.2f} ms + proof {med['proof'] * 1e3:6.2f} ms ({100 * at_restore / med['restore']:.2f} %)"
            + (f"; the record written off the path in {med['written'] * 1e3:.2f} ms" if args.epoch_end else "")
        )


if __name__ == "__main__":
    main()
