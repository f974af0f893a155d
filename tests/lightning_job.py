"""A PyTorch Lightning run as a user writes it with `client.lightning.BackupAndRestore` (run as a
subprocess, to be SIGKILLed): a small model with Dropout, AdamW, torchdata's `StatefulDataLoader`
shuffling (or a plain `DataLoader` with `--plain-loader`), a checkpoint every 5 steps.

    python -m tests.lightning_job --storage ROOT --job JOB --out OUT.npz [--kill-at STEP] [--plain-loader]
                                  [--epochs-only]

Writes the final weights and optimizer state to OUT.npz. `--kill-at` SIGKILLs the process once that
optimizer step is done (and ckptstore committed the save in flight).
"""

from __future__ import annotations

import argparse
import os
import signal

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from client.lightning import BackupAndRestore


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))

    def training_step(self, batch, index):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class KillAt(pl.Callback):
    def __init__(self, step: int, backup: BackupAndRestore):
        self.step, self.backup = step, backup

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            if self.backup.checkpointer is not None:
                self.backup.checkpointer.wait()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--storage", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--plain-loader", action="store_true")
    parser.add_argument("--epochs-only", action="store_true", help="save at each epoch's end only (the default)")
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(384, 16, generator=torch.Generator().manual_seed(1))  # 12 batches of 32
    dataset = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True) * 0.1)
    loader_type = torch.utils.data.DataLoader if args.plain_loader else StatefulDataLoader
    loader = loader_type(dataset, batch_size=32, shuffle=True)
    backup = BackupAndRestore(
        storage=args.storage, job=args.job, node="n0", every_n_train_steps=None if args.epochs_only else 5
    )
    callbacks: list[pl.Callback] = [backup] + ([] if args.kill_at is None else [KillAt(args.kill_at, backup)])
    trainer = pl.Trainer(
        max_epochs=3,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    model = Regression()
    trainer.fit(model, loader)
    state = {f"model/{k}": v.detach().numpy().copy() for k, v in model.state_dict().items()}
    for index, slots in trainer.optimizers[0].state_dict()["state"].items():
        state |= {f"opt/{index}/{k}": torch.as_tensor(v).numpy().copy() for k, v in slots.items()}
    np.savez(args.out, **state)


if __name__ == "__main__":
    main()
