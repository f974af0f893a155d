"""A small deterministic PyTorch training job for the interruption tests (run as a subprocess).

    python -m tests.torch_job --storage ROOT --job J --out FINAL.npz [--service URL]
                              [--loader plain|stateful] [--kill-epoch E --kill-batch B]
                              [--per-rank [--die-before-save-epoch E --die-before-save-batch B]]
                              [--save-every-seconds S] [--flip-rank R --flip-epoch E --flip-batch B]
                              [--local-storage DIR_WITH_{rank} [--peer-replicas N|N0,N1]]

Dropout, AdamW, a per-batch LR scheduler and a loader shuffled by ckptstore's ResumableSampler (the
plain DataLoader, or torchdata's StatefulDataLoader with worker processes); saves every 3 batches and at each epoch's
end. Under RANK/WORLD_SIZE it joins a gloo process group: by default a DDP job (replicated state),
with --per-rank every rank trains its own model on its own data. --kill-* SIGKILLs the process before
training that batch (after the save in flight is committed). --flip-*: that rank flips one bit of its
optimizer's momentum before training that batch (a replica gone silently wrong). --save-every-seconds: the loop calls
`save()` after every batch and the manager's timed cadence decides. Prints `RESUMED <epoch> <batch>` or
`FRESH` first; writes every parameter, optimizer and scheduler value to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import numpy as np
import torch
from torch import nn

EPOCHS, SAMPLES, BATCH, SAVE_EVERY = 3, 96, 8, 3  # 12 batches per epoch


def data(rank: int) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(SAMPLES, 16, generator=generator)
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True) * 0.1)


def loader(kind: str, dataset: torch.utils.data.Dataset, seed: int):
    """The data pipeline, as users write it:
    plain     the plain DataLoader over ckptstore's ResumableSampler, with a generator of its own; the sampler in objects;
    stateful  torchdata's StatefulDataLoader over the same sampler, two worker processes;
    docs      docs/pytorch.md's loop: DataLoader(dataset, batch_size, sampler=ResumableSampler(...)), the loader in objects;
    ddp       the PyTorch DDP tutorial's: DataLoader(dataset, batch_size, sampler=DistributedSampler(dataset));
    shuffle   StatefulDataLoader(dataset, batch_size, shuffle=True) — torchdata's defaults;
    shuffle-gen  the same with generator=torch.Generator();
    unsaved   DataLoader(dataset, batch_size, shuffle=True), not in objects (not resumable: audited)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ckptstore.client.torch import ResumableSampler

    if kind == "ddp":
        sampler = torch.utils.data.distributed.DistributedSampler(dataset, seed=seed)
        return torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    if kind == "docs":
        return torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=ResumableSampler(dataset, seed=seed))
    if kind == "shuffle":
        return StatefulDataLoader(dataset, batch_size=BATCH, shuffle=True)
    if kind == "shuffle-gen":
        return StatefulDataLoader(dataset, batch_size=BATCH, shuffle=True, generator=torch.Generator())
    if kind == "unsaved":
        return torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True)
    sampler = ResumableSampler(dataset, seed=seed)
    if kind == "stateful":
        return StatefulDataLoader(
            dataset, batch_size=BATCH, sampler=sampler, generator=torch.Generator(), num_workers=2
        )
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler, generator=torch.Generator())


def final_state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> dict[str, np.ndarray]:
    state = {f"model/{k}": v.detach().numpy().copy() for k, v in model.state_dict().items()}
    for index, slots in optimizer.state_dict()["state"].items():
        for name, value in slots.items():
            state[f"optimizer/{index}/{name}"] = torch.as_tensor(value).numpy().copy()
    state["scheduler"] = np.frombuffer(json.dumps(scheduler.state_dict(), sort_keys=True).encode(), np.uint8)
    state["rng/torch"] = torch.get_rng_state().numpy().copy()
    return state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--storage", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--service", default=None)
    parser.add_argument("--endpoint", default=None, help="S3 endpoint (moto)")
    parser.add_argument("--local-storage", default=None, help="a local tier; {rank} becomes the rank")
    parser.add_argument("--peer-replicas", default=None, help="N, or one N per rank: 1,0")
    parser.add_argument(
        "--loader", choices=["plain", "stateful", "docs", "ddp", "shuffle", "shuffle-gen", "unsaved"], default="plain"
    )
    parser.add_argument("--seed-per-rank", action="store_true", help="torch.manual_seed(base + rank), as DDP jobs do")
    parser.add_argument("--resume-check", default=None)
    parser.add_argument("--kill-epoch", type=int, default=None)
    parser.add_argument("--kill-batch", type=int, default=None)
    parser.add_argument("--per-rank", action="store_true")
    parser.add_argument("--die-before-save-epoch", type=int, default=None)
    parser.add_argument("--die-before-save-batch", type=int, default=None)
    parser.add_argument("--save-every-seconds", type=float, default=None)
    parser.add_argument("--flip-rank", type=int, default=None, help="this rank flips a bit of its momentum…")
    parser.add_argument("--flip-epoch", type=int, default=None)
    parser.add_argument("--flip-batch", type=int, default=None, help="…before training this batch")
    args = parser.parse_args()

    import torch.distributed as dist

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(rank if args.per_rank or args.seed_per_rank else 0)
    torch.use_deterministic_algorithms(True)
    model: nn.Module = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    if distributed and not args.per_rank:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
    batches = loader(args.loader, data(rank if args.per_rank else 0), seed=7)
    storage_options = {"endpoint_url": args.endpoint} if args.endpoint else {}

    from ckptstore.client.torch import CheckpointManager

    objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "data": batches}
    if args.loader == "plain":  # the sampler alone in objects, as users may write it
        objects["data"] = batches.sampler
    elif args.loader == "unsaved":
        del objects["data"]
    manager = CheckpointManager(
        objects=objects,
        storage=args.storage,
        service=args.service,
        job=args.job,
        storage_options=storage_options,
        replicated=not args.per_rank,
        max_to_keep=None,
        resume_check=args.resume_check,
        save_every_seconds=args.save_every_seconds,
        local_storage=None if args.local_storage is None else args.local_storage.format(rank=rank),
        peer_replicas=None
        if args.peer_replicas is None
        else int(args.peer_replicas.split(",")[rank % len(args.peer_replicas.split(","))]),
    )
    start = manager.restore_or_initialize()
    resumed = manager.resume_position
    print("FRESH" if resumed is None else f"RESUMED {resumed.epoch} {resumed.batch}", flush=True)
    for epoch in range(start, EPOCHS):
        model.train()
        if args.loader == "ddp":
            batches.sampler.set_epoch(epoch)
        for batch, (x, y) in enumerate(batches, start=manager.first_batch(epoch)):
            if (epoch, batch) == (args.kill_epoch, args.kill_batch):
                manager.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            if (rank, epoch, batch) == (args.flip_rank, args.flip_epoch, args.flip_batch):
                momentum = optimizer.state[next(iter(model.parameters()))]["exp_avg"]
                momentum.view(torch.int32).view(-1)[0] ^= 1 << 22  # one bit of one float: a silent fault
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if distributed and args.per_rank:
                dist.barrier()  # the ranks of a job step together (as their collectives would make them)
            if args.save_every_seconds is not None and batch + 1 < SAMPLES // BATCH:
                manager.save(epoch, batch=batch + 1)  # the cadence decides
            elif (batch + 1) % SAVE_EVERY == 0 and batch + 1 < SAMPLES // BATCH:
                if (epoch, batch + 1) == (args.die_before_save_epoch, args.die_before_save_batch):
                    if rank == 1:
                        manager.wait()  # what it saved before is in; this position it never commits
                        os.kill(os.getpid(), signal.SIGKILL)
                    manager.save(epoch, batch=batch + 1)
                    manager.wait()
                    os.kill(os.getpid(), signal.SIGKILL)  # rank 0 committed its part, then the job is lost
                manager.save(epoch, batch=batch + 1)
        manager.save(epoch)
    manager.wait()
    manager.close()
    plain = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    np.savez(args.out, **final_state(plain, optimizer, scheduler))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
