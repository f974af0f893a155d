"""A tiny PyTorch training process that ckptstore may refuse, for the exit-code tests (a subprocess).

    python -m tests.refusal_job --storage ROOT --job J [--service URL] [--endpoint S3]
                                [--optimizer sgd|adam] [--resume-check raise] [--pause-after-first-save FILE]

It restores (or starts), then saves two epochs, synchronously. With --pause-after-first-save it prints
`SAVED 0` after the first save and waits (at most 60 s) for FILE to exist before the second: the test
starts a newer attempt of the node meanwhile, so this process is a zombie. Unhandled refusals end it
with ckptstore's exit codes; nothing here catches them.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

from ckptstore.client.torch import CheckpointManager


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--storage", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--service", default=None)
    parser.add_argument("--endpoint", default=None)
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--resume-check", default=None)
    parser.add_argument("--pause-after-first-save", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    kinds = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}
    optimizer = kinds[args.optimizer](model.parameters(), lr=0.1)
    mgr = CheckpointManager(
        objects={"model": model, "optimizer": optimizer},
        storage=args.storage,
        service=args.service,
        job=args.job,
        node="n0",
        async_save=False,
        resume_check=args.resume_check,
        storage_options={"endpoint_url": args.endpoint} if args.endpoint else {},
    )
    start = mgr.restore_or_initialize()
    print("STARTED", start, flush=True)
    for epoch in range(start, start + 2):
        loss = model(torch.ones(3, 4)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mgr.save(epoch)
        mgr.wait()
        print("SAVED", epoch, flush=True)
        if args.pause_after_first_save and epoch == start:
            deadline = time.monotonic() + 60
            while not os.path.exists(args.pause_after_first_save) and time.monotonic() < deadline:
                time.sleep(0.05)
    mgr.close()


if __name__ == "__main__":
    main()
