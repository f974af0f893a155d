"""docs/lightning.md's block run as written (as a subprocess, to be SIGKILLed), with what it assumes
defined: a small model with Dropout, AdamW, torchdata's `StatefulDataLoader` shuffling (or a plain
`DataLoader` with `--plain-loader`); a checkpoint every 5 steps (or each epoch: `--epochs-only`).

    python -m tests.lightning_job --storage ROOT --job JOB --out OUT.npz [--kill-at STEP] [--plain-loader]
                                  [--epochs-only] [--every N]

Writes the final weights and optimizer state to OUT.npz. `--kill-at` SIGKILLs the process once that
optimizer step is done (and ckptstore committed the save in flight).
"""

from __future__ import annotations

import os
import signal

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from ckptstore.client.lightning import BackupAndRestore
from tests.job_runs import documented_block, job_parser


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))

    def training_step(self, batch, index):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Backup(BackupAndRestore):
    """The documented callback, and a SIGKILL once step KILL_AT is done and the save in flight committed."""

    kill_at: int | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, index):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, index)
        if trainer.global_step == self.kill_at and self.checkpointer is not None:
            self.checkpointer.wait()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = job_parser()
    parser.add_argument("--plain-loader", action="store_true")
    parser.add_argument("--epochs-only", action="store_true", help="save at each epoch's end only (the default)")
    parser.add_argument(
        "--every", type=int, default=5, help="every_n_train_steps (6: saves due at epochs' last batches)"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(384, 16, generator=torch.Generator().manual_seed(1))  # 12 batches of 32
    dataset = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True) * 0.1)
    loader_type = torch.utils.data.DataLoader if args.plain_loader else StatefulDataLoader
    loader = loader_type(dataset, batch_size=32, shuffle=True)
    Backup.kill_at = args.kill_at
    placeholders = {'"s3://ckpt/jobs"': repr(args.storage), 'job="lm"': f'job={args.job!r}, node="n0"'}
    placeholders["from ckptstore.client.lightning import BackupAndRestore\n"] = ""
    if args.epochs_only:
        placeholders["every_n_train_steps=5"] = "every_n_train_steps=None"
    elif args.every != 5:
        placeholders["every_n_train_steps=5"] = f"every_n_train_steps={args.every}"
    code = documented_block("docs/lightning.md", "## The callback", placeholders)
    model = Regression()
    namespace = {"pl": pl, "model": model, "loader": loader, "BackupAndRestore": Backup}
    workdir = os.path.join(os.path.dirname(args.storage), f"lightning-cwd-{args.job}")
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)  # Lightning's default logs and checkpoints go to the working directory
    exec(compile(code, "docs/lightning.md", "exec"), namespace)
    trainer = namespace["trainer"]
    state = {f"model/{k}": v.detach().numpy().copy() for k, v in model.state_dict().items()}
    for index, slots in trainer.optimizers[0].state_dict()["state"].items():
        state |= {f"opt/{index}/{k}": torch.as_tensor(v).numpy().copy() for k, v in slots.items()}
    np.savez(args.out, **state)


if __name__ == "__main__":
    main()
