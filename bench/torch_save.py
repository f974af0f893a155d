"""PyTorch: save and cold restore of ≈ 1 GiB of state through ckptstore against the PyTorch ways.

    python bench/torch_save.py [--gib 1] [--reps 5]

Methods, interleaved A B C … with the order rotated each repetition, each into a fresh directory on
local disk, loads cold (page cache dropped where the OS allows it):
- torch.save + fsync / torch.load(weights_only=True) then load_state_dict;
- DCP's FileSystemWriter / FileSystemReader (torch.distributed.checkpoint, fsync on; loads in place);
- ckptstore: ckptstore.client.torch.CheckpointManager (synchronous save, then restore_or_initialize);
- ckptstore DCP: ckptstore.client.torch.dcp's CkptstoreWriter / CkptstoreReader;
- raw fsspec: the bytes written sequentially into one file + fsync (the ceiling).
"Restore" means the values end up in the live tensors (load_state_dict copies them in), as a
training script does. Also: how long an async `save` blocks the loop (state copied to host
buffers, written in the background), per GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from bench.save_restore import drop_caches, fsync_tree, interleave, model_like, nbytes, raw_write  # noqa: E402
from ckptstore.client.torch import CheckpointManager  # noqa: E402
from ckptstore.client.torch.dcp import CkptstoreReader, CkptstoreWriter  # noqa: E402


class Holder:
    """The state of a model: named tensors; `load_state_dict` copies into them as nn.Module does."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, tensor in self.tensors.items():
            tensor.copy_(state[name])


def methods(holder: Holder) -> dict[str, tuple[Any, Any]]:
    state = holder.tensors
    arrays = {name: tensor.numpy() for name, tensor in state.items()}

    def torch_save(d: str) -> None:
        torch.save(state, f"{d}/model.pt")
        fsync_tree(d)

    def torch_load(d: str) -> None:
        holder.load_state_dict(torch.load(f"{d}/model.pt", weights_only=True))

    def manager(d: str, **options: Any) -> CheckpointManager:
        return CheckpointManager(
            objects={"model": holder}, storage=d, job="bench", node="n0", max_to_keep=None, **options
        )

    def ckpt_save(d: str) -> None:
        with manager(d, async_save=False) as mgr:
            mgr.restore_or_initialize()  # a new directory: nothing to restore, this start registered
            mgr.save(0)

    def ckpt_load(d: str) -> None:
        with manager(d) as mgr:
            assert mgr.restore_or_initialize() == 1

    return {
        "raw fsspec": (lambda d: raw_write(f"{d}/all.bin", arrays), lambda d: open(f"{d}/all.bin", "rb").read()),
        "torch.save": (torch_save, torch_load),
        "DCP FileSystemWriter": (
            lambda d: dcp.save(state, storage_writer=dcp.FileSystemWriter(d)),
            lambda d: dcp.load(state, storage_reader=dcp.FileSystemReader(d)),
        ),
        "ckptstore": (ckpt_save, ckpt_load),
        "ckptstore DCP": (
            lambda d: dcp.save(state, storage_writer=CkptstoreWriter(d, "bench", 0)),
            lambda d: dcp.load(state, storage_reader=CkptstoreReader(d, "bench")),
        ),
    }


def async_blocking(holder: Holder, root: str, reps: int) -> dict[str, float]:
    """Seconds `save` holds the loop with async saves (after a warm-up save), and the whole save."""
    blocked, total = [], []
    with CheckpointManager(objects={"model": holder}, storage=root, job="async", node="n0", max_to_keep=2) as mgr:
        mgr.restore_or_initialize()
        mgr.save(0)
        mgr.wait()
        for epoch in range(1, reps + 1):
            started = time.perf_counter()
            mgr.save(epoch)
            blocked.append(time.perf_counter() - started)
            mgr.wait()
            total.append(time.perf_counter() - started)
    return {"blocked_s": statistics.median(blocked), "save_s": statistics.median(total)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    torch.manual_seed(0)
    # Tensors allocated by torch, as a module's parameters are (64-byte aligned), not numpy's buffers
    # that `from_numpy` would keep (16 bytes into a page: the O_DIRECT save then copies every block).
    holder = Holder({name: torch.from_numpy(a).clone() for name, a in model_like(int(args.gib * 2**30)).items()})
    size = nbytes({name: t.numpy() for name, t in holder.tensors.items()})
    root = tempfile.mkdtemp(prefix="ckpt-torch-bench-", dir=args.dir)
    counter = iter(range(10**6))

    def new_dir() -> str:
        path = os.path.join(root, f"run-{next(counter)}")
        os.makedirs(path)
        return path

    try:
        cold = drop_caches()
        rows = interleave(methods(holder), size, args.reps, new_dir, shutil.rmtree, cold)
        by_name = {row["method"]: row for row in rows}
        for row in rows:
            for op in ("save", "load"):
                for base in ("torch.save", "DCP FileSystemWriter"):
                    row[op][f"ratio_to_{base}"] = row[op]["MBps"] / by_name[base][op]["MBps"]
        blocking = async_blocking(holder, new_dir(), args.reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gib = size / 2**30
    report = {
        "command": " ".join(["python", "bench/torch_save.py", *sys.argv[1:]]),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}",
        "state_GiB": round(gib, 3),
        "cold_loads": cold,
        "rows": rows,
        "async": {**blocking, "blocked_s_per_GiB": blocking["blocked_s"] / gib},
    }
    print(json.dumps(report, indent=2))
    print("\nmethod                  save MB/s  ×torch.save  ×DCP   load MB/s  ×torch.load  ×DCP", file=sys.stderr)
    for row in rows:
        s, lo = row["save"], row["load"]
        print(
            f"{row['method']:<22} {s['MBps']:9.0f} {s['ratio_to_torch.save']:11.2f} {s['ratio_to_DCP FileSystemWriter']:6.2f}"
            f" {lo['MBps']:10.0f} {lo['ratio_to_torch.save']:11.2f} {lo['ratio_to_DCP FileSystemWriter']:6.2f}",
            file=sys.stderr,
        )
    print(f"async save blocks {report['async']['blocked_s_per_GiB']:.3f} s per GiB", file=sys.stderr)


if __name__ == "__main__":
    main()
