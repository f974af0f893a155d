"""A training with no mid-epoch cadence of its own, for the checkpoint-request tests (a subprocess).

    python -m tests.request_job --framework keras|torch|lightning|hf --storage ROOT --service URL --job J [--node N]

Keras: `BackupAndRestore` with its default `save_freq="epoch"`; PyTorch: docs/pytorch.md's loop without
the every-500-batches save (only `checkpoint_if_preempted` between batches and `save(epoch)` at each
end); Lightning: the callback's default (each epoch); Hugging Face: `save_strategy="epoch"`. Each batch
takes about 40 ms (a stand-in for real work), 3 epochs of 40 batches. Prints `TRAINING` at its first
batch and `DONE` at the end.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

EPOCHS, BATCHES, BATCH = 3, 40, 4
STEP_S = 0.04


def run_keras(args: argparse.Namespace) -> None:
    import keras

    from ckptstore.client.keras import BackupAndRestore

    class Paced(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                print("TRAINING", flush=True)
            time.sleep(STEP_S)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((BATCHES * BATCH, 4), np.float32)
    backup = BackupAndRestore(storage=args.storage, service=args.service, job=args.job, node=args.node)
    model.fit(x, x[:, :2], batch_size=BATCH, epochs=EPOCHS, callbacks=[Paced(), backup], verbose=0)


def run_torch(args: argparse.Namespace) -> None:
    import torch
    from torch import nn

    from ckptstore.client.torch import CheckpointManager

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mgr = CheckpointManager(
        objects={"model": model, "optimizer": optimizer},
        storage=args.storage,
        service=args.service,
        job=args.job,
        node=args.node,
    )
    start = mgr.restore_or_initialize()
    for epoch in range(start, EPOCHS):
        for batch in range(mgr.first_batch(epoch), BATCHES):
            if epoch == start and batch == mgr.first_batch(epoch):
                print("TRAINING", flush=True)
            loss = model(torch.ones(BATCH, 4)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            time.sleep(STEP_S)
            mgr.checkpoint_if_preempted(epoch, batch + 1)
        mgr.save(epoch)
    mgr.close()


def run_lightning(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from torch import nn

    from ckptstore.client.lightning import BackupAndRestore

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 2)

        def training_step(self, batch, index):
            if index == 0 and self.current_epoch == 0:
                print("TRAINING", flush=True)
            time.sleep(STEP_S)
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.ones(BATCHES * BATCH, 4))
    backup = BackupAndRestore(storage=args.storage, service=args.service, job=args.job, node=args.node)
    trainer = pl.Trainer(
        max_epochs=EPOCHS, callbacks=[backup], accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=BATCH))


def run_hf(args: argparse.Namespace) -> None:
    import os

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from ckptstore.client.hf import BackupAndRestore

    class Paced(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 0:
                print("TRAINING", flush=True)
            time.sleep(STEP_S)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return BATCHES * BATCH

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            ids = torch.arange(8) % 16
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1))
    training = TrainingArguments(
        output_dir=os.path.join(os.path.dirname(args.storage), "hf-output", args.job),
        per_device_train_batch_size=BATCH, num_train_epochs=EPOCHS, save_strategy="epoch", report_to=[],
        use_cpu=True, disable_tqdm=True, logging_steps=1000,
    )  # fmt: skip
    backup = BackupAndRestore(storage=args.storage, service=args.service, job=args.job, node=args.node)
    Trainer(model=model, args=training, train_dataset=Tokens(), callbacks=[Paced(), backup]).train()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=["keras", "torch", "lightning", "hf"], required=True)
    parser.add_argument("--storage", required=True)
    parser.add_argument("--service", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--node", default="n0")
    args = parser.parse_args()
    runs = {"keras": run_keras, "torch": run_torch, "lightning": run_lightning, "hf": run_hf}
    runs[args.framework](args)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
