"""A training job without a framework, for restart tests that need many quick real processes.

    python -m tests.counter_job --storage ROOT --job J --log LOG [--service URL] [--node n0]
        [--epochs 3] [--batches 10] [--save-every 3] [--kill-at E.B] [--batch-seconds S]
        [--fresh] [--storage-options JSON] [--local-storage DIR]

The state is one float32 array counting the batches trained; each batch adds one and appends
`<epoch> <batch> <time>` to LOG (so a test sees exactly which batches each run trained and when).
It checkpoints through the loop manager every `--save-every` batches and at each epoch's end.
With `--kill-at E.B` it SIGKILLs itself before training batch B of epoch E, after the save in
flight landed. The first line on stdout is `RESUMED <epoch> <batch>` or `FRESH`; the last is
`DONE <counter>` (the counter equals the batches of the whole run, when resumed exactly).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import numpy as np

from ckptstore.client.tensorflow.manager import CheckpointManager


class Counter:
    """A variable as the loop manager sees one (shape, dtype, value, assign): a float32 counter."""

    path = "counter"

    def __init__(self) -> None:
        self.array = np.zeros(4, np.float32)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    def value(self) -> np.ndarray:
        return self.array

    def assign(self, value: np.ndarray) -> None:
        self.array[...] = value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--storage", required=True)
    parser.add_argument("--local-storage", default=None)
    parser.add_argument("--storage-options", default=None, help="JSON")
    parser.add_argument("--service", default=None)
    parser.add_argument("--job", required=True)
    parser.add_argument("--node", default="n0")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--batch-seconds", type=float, default=0.0)
    parser.add_argument("--kill-at", default=None)
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--log", required=True)
    args = parser.parse_args()
    kill = None if args.kill_at is None else tuple(int(p) for p in args.kill_at.split("."))
    counter = Counter()
    manager = CheckpointManager(
        storage=args.storage,
        local_storage=args.local_storage,
        storage_options=json.loads(args.storage_options) if args.storage_options else None,
        service=args.service,
        job=args.job,
        node=args.node,
        fresh_start=args.fresh or None,
        objects={"model": counter},
    )
    start = manager.restore_or_initialize()
    position = manager.resume_position
    print("FRESH" if position is None else f"RESUMED {position.epoch} {position.batch}", flush=True)
    log = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for epoch in range(start, args.epochs):
        for batch in range(manager.first_batch(epoch), args.batches):
            if kill == (epoch, batch):
                manager.checkpointer.wait_for_write()  # the save in flight lands: a known resume position
                os.kill(os.getpid(), signal.SIGKILL)
            if args.batch_seconds:
                time.sleep(args.batch_seconds)  # the step's compute
            counter.array += 1
            os.write(log, f"{epoch} {batch} {time.time():.4f}\n".encode())
            if (batch + 1) % args.save_every == 0 and batch + 1 < args.batches:
                manager.save(epoch, batch=batch + 1)
        manager.save(epoch)
    manager.close()
    os.close(log)
    print(f"DONE {int(counter.array[0])}", flush=True)


if __name__ == "__main__":
    main()
