"""What resharding adds to a restore (issue 46): the rest of an epoch's global order recomputed for
a new world size, against a 1 GiB restore, in one run.

    python bench/reshard.py [--gib 1] [--samples 1000000 10000000] [--reps 3]

Saves --gib GiB of model state with `ckptstore.client.torch.CheckpointManager` to a local folder
and times `restore_or_initialize()` into a fresh model (best of --reps); then times what a resharded
resume computes when its first iterator starts (`rest_of_epoch`: the epoch's permutation of
--samples indices, padded, cut at the saved count and shared over the new ranks; best of --reps),
beside the DistributedSampler's own start of an epoch (the same permutation), which it replaces.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from ckptstore.client.torch import CheckpointManager  # noqa: E402
from ckptstore.client.torch.distributed import rest_of_epoch  # noqa: E402


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
        sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=3, rank=1, seed=5)
        seconds = best(lambda sampler=sampler, samples=samples: rest_of_epoch(sampler, 2, samples // 3), args.reps)
        sampler.set_epoch(2)
        own = best(lambda sampler=sampler: list(iter(sampler)), args.reps)
        print(
            f"resharding {samples:,} samples to 3 ranks: {seconds * 1000:.1f} ms ({seconds / restored:.1%} of the "
            f"restore); the sampler's own start of that epoch, which the resumed epoch does not run: {own * 1000:.1f} ms"
        )


if __name__ == "__main__":
    main()
