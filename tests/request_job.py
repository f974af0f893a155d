"""A training with no mid-epoch cadence of its own, for the checkpoint-request tests (a subprocess).

    python -m tests.request_job --framework keras|torch --storage ROOT --service URL --job J [--node N]

Keras: `BackupAndRestore` with its default `save_freq="epoch"`; PyTorch: docs/pytorch.md's loop without
the every-500-batches save (only `checkpoint_if_preempted` between batches and `save(epoch)` at each
end). Each batch takes about 40 ms (a stand-in for real work), 3 epochs of 40 batches. Prints
`TRAINING` at its first batch and `DONE` at the end.
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=["keras", "torch"], required=True)
    parser.add_argument("--storage", required=True)
    parser.add_argument("--service", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--node", default="n0")
    args = parser.parse_args()
    (run_keras if args.framework == "keras" else run_torch)(args)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
