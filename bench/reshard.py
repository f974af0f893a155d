"""What resharding adds to a restore (issue 46): a resumed epoch's first iterator from a copy saved on
another world size, against the same from a copy saved on this one, beside a 1 GiB restore.

    python bench/reshard.py [--gib 1] [--samples 1000000 10000000] [--reps 3]

Saves --gib GiB of model state with `ckptstore.client.torch.CheckpointManager` to a local folder
and times `restore_or_initialize()` into a fresh model (best of --reps); then times a resumed
epoch's first iterator on 3 ranks (the saved global count loaded into the loader's position, the
epoch's permutation of --samples indices cut at it and shared over the ranks, the first batch drawn)
from a copy saved by 4 ranks and from one saved by 3 at the same count — what resharding adds is the
difference (medians of --reps, alternating which goes first) — beside the DistributedSampler's own start of an epoch
(the same permutation), which a resumed epoch replaces.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from ckptstore.client.torch import CheckpointManager  # noqa: E402
from ckptstore.client.torch.distributed import DistributedLoaderPosition  # noqa: E402


def model(gib: float) -> nn.Module:
    width = 8192
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(max(1, round(gib * 2**30 / (width * width * 4))))])


def best(call, reps: int) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--samples", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        saved = CheckpointManager(objects={"model": model(args.gib)}, storage=root, job="reshard", async_save=False)
        saved.restore_or_initialize()
        saved.save(0)
        saved.close()

        def restore() -> float:
            manager = CheckpointManager(objects={"model": model(args.gib)}, storage=root, job="reshard")
            started = time.perf_counter()  # the restore alone: not the model's construction
            manager.restore_or_initialize()
            seconds = time.perf_counter() - started
            manager.close()
            return seconds

        restored = min(restore() for _ in range(args.reps))
    print(f"restore of {args.gib} GiB (local disk, best of {args.reps}): {restored:.3f} s")
    for samples in args.samples:
        dataset = torch.utils.data.TensorDataset(torch.zeros(samples, 0))
        new_world = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=3, rank=1, seed=5)
        state = {"seed": 5, "shuffle": True, "length": samples, "batch_size": 8, "epoch": 2}
        saved_by_4 = state | {"consumed": samples // 3 // 32 * 32, "world": 4, "batch": samples // 3 // 32}
        saved_by_3 = saved_by_4 | {"world": 3, "batch": saved_by_4["consumed"] // 24}  # the same count, on 3
        resharded, same = [], []
        for rep in range(args.reps):  # alternating, each first in turn: from a copy 4 ranks saved, and 3
            pair = [(resharded, saved_by_4), (same, saved_by_3)]
            for times, saved in pair if rep % 2 == 0 else pair[::-1]:
                times.append(best(lambda s=saved, d=dataset: first_iterator(d, s), 1))
        seconds, unchanged = statistics.median(resharded), statistics.median(same)
        new_world.set_epoch(2)
        own = best(lambda sampler=new_world: list(iter(sampler)), args.reps)
        print(
            f"{samples:,} samples on 3 ranks: the resumed epoch's first iterator from a copy saved by 4 ranks "
            f"{seconds * 1000:.1f} ms, from one saved by 3 {unchanged * 1000:.1f} ms (medians of {args.reps}, "
            f"alternating): resharding adds {(seconds - unchanged) * 1000:+.1f} ms "
            f"({(seconds - unchanged) / restored:+.1%} of the restore); the sampler's own start of an epoch, which "
            f"the resumed epoch replaces: {own * 1000:.1f} ms"
        )


def first_iterator(dataset: torch.utils.data.Dataset, state: dict) -> None:
    """Load a saved global count into rank 1 of 3 and draw the resumed epoch's first batch."""
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=3, rank=1, seed=5)
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler)
    DistributedLoaderPosition(loader).load_state_dict(state)
    sampler.set_epoch(2)
    next(iter(loader))


if __name__ == "__main__":
    main()
