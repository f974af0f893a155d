"""PyTorch Distributed Checkpoint through ckptstore, as gloo ranks (run as a subprocess).

    python -m tests.dcp_job save|load --storage ROOT --job J [--service URL] [--out VALUES.npz]
                                     [--replicas R] [--flip RANK]

Under RANK/WORLD_SIZE the state's large tensors are DTensors sharded by rows over the ranks (10 rows:
uneven over 4 ranks); alone they are plain tensors, so a save with 2 ranks and a load with 1 or 4
goes through DCP's resharding. `load` writes the full values it loaded (rank 0) to --out.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch


def expected() -> dict[str, torch.Tensor]:
    """The values every save writes (the test rebuilds them to compare)."""
    return {
        "w": torch.arange(50, dtype=torch.float32).reshape(10, 5) / 7,
        "emb": (torch.arange(30, dtype=torch.float32).reshape(10, 3) - 11).to(torch.bfloat16),
        "bias": torch.linspace(-1, 1, 4, dtype=torch.float64),
    }


def state(values: dict[str, torch.Tensor], world: int, replicas: int = 1) -> dict:
    """The state dict: w and emb sharded by rows across the ranks (plain tensors alone), bias replicated;
    with `replicas` > 1, HSDP's layout: a (replicas × world / replicas) mesh, the rows sharded over its
    second dimension and replicated over its first."""
    model: dict[str, torch.Tensor] = dict(values)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (replicas, world // replicas))
        placements = [Replicate(), Shard(0)]
        model["w"] = distribute_tensor(values["w"], mesh, placements)
        model["emb"] = distribute_tensor(values["emb"], mesh, placements)
    return {"model": model, "extra": {"step": 7, "note": "dcp"}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("--storage", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--service", default=None)
    parser.add_argument("--epoch", type=int, default=0)
    parser.add_argument("--shift", type=float, default=0.0, help="save the values plus this (other bytes)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--replicas", type=int, default=1, help="HSDP: replica groups of the sharded tensors")
    parser.add_argument("--flip", type=int, default=None, help="this rank flips one bit of its shard of w")
    args = parser.parse_args()

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ckptstore.client.torch.dcp import CkptstoreReader, CkptstoreWriter

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    if args.mode == "save":
        writer = CkptstoreWriter(args.storage, args.job, args.epoch, service=args.service)
        values = {k: v + args.shift if args.shift else v for k, v in expected().items()}
        saved = state(values, world, args.replicas)
        if args.flip is not None and args.flip == (dist.get_rank() if world > 1 else 0):
            shard = saved["model"]["w"]._local_tensor if world > 1 else saved["model"]["w"]
            shard.view(torch.int32).view(-1)[0] ^= 1 << 20
        dcp.save(saved, storage_writer=writer)
    else:
        target = state({k: torch.zeros_like(v) for k, v in expected().items()}, world, args.replicas)
        target["extra"] = {"step": 0, "note": ""}
        dcp.load(target, storage_reader=CkptstoreReader(args.storage, args.job, service=args.service))
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in target["model"].items()}
        if (dist.get_rank() if world > 1 else 0) == 0 and args.out:
            values = {k: (v.view(torch.int16) if v.dtype == torch.bfloat16 else v).numpy() for k, v in full.items()}
            extra = target["extra"]
            np.savez(args.out, **values, step=np.array(extra["step"]), note=np.array(extra["note"]))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
