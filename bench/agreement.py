"""What replica agreement costs a save (issue 47): 2 DDP ranks on gloo, 1 GiB of replicated state,
the writer's blocked time per save with agreement against the same saves in a tree without it.

    python bench/agreement.py [--gib 1] [--saves 5] [--rounds 3] [--previous REF]

Each round runs this tree and `git archive REF` (default abd3b5c, the head before agreement) in
turn, interleaved: two processes (RANK 0 and 1) with a model of --gib GiB (float32 Linear layers,
SGD without momentum: the state is the model), `CheckpointManager(replicated=True, async_save=True)`
on a local folder, one training step, one mid-epoch save and one more step, --saves times; each
rank times its `save()` call (what training waits for: on rank 0 the capture into the staging
buffers, on rank 1 the hashes it takes at once) and the training step right after it (which waits,
on rank 1, for the hashing left running in the background), and waits for the write outside the
timings. Each rank is pinned to a
core of its own (ranks on a cluster do not share cores; unpinned on 2 cores, rank 1's hashing and
rank 0's capture threads slow each other). Reports the medians.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(tree: str, storage: str, gib: float, saves: int, out: str) -> None:
    sys.path.insert(0, tree)
    import torch
    import torch.distributed as dist
    from torch import nn

    from ckptstore.client.torch import CheckpointManager

    dist.init_process_group("gloo")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:  # one core per rank, as ranks on machines of their own: no rank's work slows another's
        os.sched_setaffinity(0, {cores[dist.get_rank() % len(cores)]})
    torch.manual_seed(0)
    width = 8192
    layers = max(1, round(gib * 2**30 / (width * width * 4)))
    model = nn.parallel.DistributedDataParallel(nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    manager = CheckpointManager(
        objects={"model": model, "optimizer": optimizer}, storage=storage, job="agree", async_save=True, max_to_keep=2
    )
    manager.restore_or_initialize()

    def train_step() -> float:
        started = time.perf_counter()
        optimizer.zero_grad()
        model(torch.randn(4, width)).sum().backward()
        optimizer.step()
        return time.perf_counter() - started

    blocked, after = [], []
    for batch in range(saves):
        train_step()
        started = time.perf_counter()
        manager.save(0, batch=batch + 1)
        blocked.append(time.perf_counter() - started)
        after.append(train_step())  # the step right after the save: it may wait for what the save left running
        manager.wait()
        dist.barrier()
    manager.close()
    import ckptstore

    with open(out, "w") as file:
        json.dump({"blocked": blocked, "after": after, "module": ckptstore.__file__}, file)
    dist.destroy_process_group()


def run(tree: str, gib: float, saves: int, folder: str, port: int) -> list[dict]:
    storage = tempfile.mkdtemp(dir=folder)
    outs = [os.path.join(folder, f"rank{rank}-{port}.json") for rank in range(2)]
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", tree, storage, str(gib), str(saves), outs[rank]],
            env=os.environ
            | {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
        )
        for rank in range(2)
    ]
    for process in processes:
        if process.wait() != 0:
            raise SystemExit(f"a rank failed in {tree}")
    results = []
    for out in outs:
        with open(out) as file:
            results.append(json.load(file))
    return results


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        tree, storage, gib, saves, out = sys.argv[2:7]
        worker(tree, storage, float(gib), int(saves), out)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--previous", default="abd3b5c")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        previous = os.path.join(folder, "previous")
        os.makedirs(previous)
        archive = subprocess.run(["git", "archive", args.previous], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", previous], input=archive, check=True)
        timed: dict[tuple[str, str], list[list[float]]] = {
            (name, what): [[], []] for name in ("agreement", "previous") for what in ("blocked", "after")
        }
        port = 29600
        for _ in range(args.rounds):
            for name, tree in (("agreement", ROOT), ("previous", previous)):
                port += 1
                for rank, result in enumerate(run(tree, args.gib, args.saves, folder, port)):
                    assert result["module"].startswith(tree), result["module"]
                    for what in ("blocked", "after"):  # the first save prepares the staging buffers
                        timed[(name, what)][rank] += result.get(what, [])[1:]
    print(f"{args.gib} GiB replicated on 2 gloo ranks, medians over {args.rounds} rounds:")
    for what, said in (("blocked", "blocked per save"), ("after", "the training step right after a save")):
        for rank in range(2):
            now, before = (
                statistics.median(timed[(name, what)][rank] or [math.nan]) for name in ("agreement", "previous")
            )
            print(
                f"{said}, rank {rank}: with agreement {now:.3f} s, {args.previous} {before:.3f} s, ratio {now / before:.3f}"
            )


if __name__ == "__main__":
    main()
