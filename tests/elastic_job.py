"""A DDP job that records which samples each rank trains (run as gloo ranks, to be SIGKILLed): the
PyTorch DDP tutorial's loop over a plain DataLoader and a DistributedSampler, saves every 2 batches
and at each epoch's end.

    python -m tests.elastic_job --storage ROOT --job J --out TRAINED.jsonl [--kill-epoch E --kill-batch B]
                                [--loader plain|stateful]

Appends one line per batch trained to --out: {"epoch", "batch", "indices"}. --kill-* SIGKILLs the
process before training that batch (after the save in flight is committed).
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist
from torch import nn

SAMPLES, BATCH, EPOCHS, SAVE_EVERY = 480, 8, 2, 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--storage", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-epoch", type=int, default=None)
    parser.add_argument("--kill-batch", type=int, default=None)
    parser.add_argument("--loader", choices=["plain", "stateful"], default="plain")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    dataset = torch.utils.data.TensorDataset(torch.arange(SAMPLES))
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, seed=5)
    if args.loader == "stateful":  # torchdata's, with worker processes fetching ahead
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=2)
    else:
        loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    model = nn.parallel.DistributedDataParallel(nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    from ckptstore.client.torch import CheckpointManager

    manager = CheckpointManager(
        objects={"model": model, "optimizer": optimizer, "data": loader}, storage=args.storage, job=args.job
    )
    start = manager.restore_or_initialize()
    resumed = manager.resume_position
    print("FRESH" if resumed is None else f"RESUMED {resumed.epoch} {resumed.batch}", flush=True)
    with open(args.out, "a") as trained:
        for epoch in range(start, EPOCHS):
            sampler.set_epoch(epoch)
            for batch, (indices,) in enumerate(loader, start=manager.first_batch(epoch)):
                if (epoch, batch) == (args.kill_epoch, args.kill_batch):
                    manager.wait()
                    os.kill(os.getpid(), signal.SIGKILL)
                trained.write(json.dumps({"epoch": epoch, "batch": batch, "indices": indices.tolist()}) + "\n")
                trained.flush()
                optimizer.zero_grad()
                model(indices.float().unsqueeze(1)).sum().backward()
                optimizer.step()
                if (batch + 1) % SAVE_EVERY == 0:
                    manager.save(epoch, batch=batch + 1)
            manager.save(epoch)
    manager.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
