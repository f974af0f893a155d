"""A Lightning `fit` under DDP that records which samples each rank trains (run as gloo ranks by
tests.test_torch.ranks, to be SIGKILLed): a tiny regression module, a plain shuffling DataLoader in
which Lightning puts its DistributedSampler (`strategy="ddp"`, on one process too), a checkpoint every
--every steps (2) through BackupAndRestore, every copy kept.

    python -m tests.lightning_elastic_job --storage ROOT --job J --out TRAINED.jsonl [--kill-at STEP] [--every N]
                                          [--single-device]

Appends one line per batch trained to --out: {"epoch", "batch", "indices"}. --kill-at SIGKILLs every
rank once that optimizer step is done and its save committed. Prints FRESH or RESUMED EPOCH BATCH last.
"""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import torch
from torch import nn

from tests.job_runs import job_parser
from tests.lightning_job import Backup  # the callback, and a SIGKILL once step kill_at is done

SAMPLES, BATCH, EPOCHS = 96, 8, 2


class Regression(pl.LightningModule):
    def __init__(self, trained) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.linear = nn.Linear(1, 1)
        self.trained = trained

    def training_step(self, batch, index):  # type: ignore[no-untyped-def]
        (indices,) = batch
        record = {"epoch": self.current_epoch, "batch": index, "indices": indices.tolist()}
        self.trained.write(json.dumps(record) + "\n")
        self.trained.flush()
        return (self.linear(indices.float().unsqueeze(1) / SAMPLES) ** 2).mean()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def main() -> None:
    parser = job_parser()
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--single-device", action="store_true", help='strategy="auto" (no DistributedSampler)')
    args = parser.parse_args()
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
    pl.seed_everything(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    workdir = os.path.join(os.path.dirname(args.storage), f"lightning-cwd-{args.job}")
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.arange(SAMPLES)), batch_size=BATCH, shuffle=True
    )
    Backup.kill_at = args.kill_at
    backup = Backup(storage=args.storage, job=args.job, every_n_train_steps=args.every, max_to_keep=None)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="auto" if args.single_device else "ddp",
        max_epochs=EPOCHS,
        callbacks=[backup],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with open(args.out, "a") as trained:
        trainer.fit(Regression(trained), loader)
    resumed = backup.resume_position
    print("FRESH" if resumed is None else f"RESUMED {resumed.epoch} {resumed.batch}", flush=True)


if __name__ == "__main__":
    main()
