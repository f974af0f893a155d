"""A small deterministic training job for the interruption tests (run as a subprocess).

    python -m tests.train_job --storage ROOT [--local-storage DIR] --job J --mode keras|loop [--service URL]
                              [--save-freq epoch|N]
                              [--spe N] [--kill-epoch E --kill-batch B] --out FINAL.npz

Dense + Dropout model, in-memory data, no shuffling, op determinism and fixed seeds: two runs give
bit-equal variables (--as-users-write: fit shuffles and the Dropout has no seed, as keras.io writes it). With --kill-* the process SIGKILLs itself before training that batch.
Prints `RESUMED <epoch> <batch>` or `FRESH` first, then trains to the end and saves every model
and optimizer variable to --out.
"""

from __future__ import annotations

import argparse
import os
import signal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

BACKEND = keras.backend.backend()  # KERAS_BACKEND: tensorflow (the default), jax or torch

EPOCHS, SAMPLES, BATCH = 6, 96, 8  # 12 batches per epoch


def make_model(spe: int = 1, *, seeded_dropout: bool = True) -> keras.Model:
    keras.utils.set_random_seed(0)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_op_determinism()
    elif BACKEND == "torch":
        import torch

        torch.use_deterministic_algorithms(True)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dropout(0.3, seed=1) if seeded_dropout else keras.layers.Dropout(0.3),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", steps_per_execution=spe)
    return model


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, 16)).astype(np.float32)
    return x, (x.sum(axis=1, keepdims=True) * 0.1).astype(np.float32)


class KillAt(keras.callbacks.Callback):
    """Signal this process before training (epoch, batch). For SIGKILL it first waits for the save in
    flight, so the expected resume position does not depend on the background writer's timing."""

    def __init__(self, epoch: int, batch: int, signum: int, wait=lambda: None):
        super().__init__()
        self.epoch, self.batch, self.current, self.signum, self.sent = epoch, batch, -1, signum, False
        self.wait = wait

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.current, batch) >= (self.epoch, self.batch) and not self.sent:
            self.sent = True
            if self.signum == signal.SIGKILL:
                self.wait()
            os.kill(os.getpid(), self.signum)


def final_state(model: keras.Model) -> dict[str, np.ndarray]:
    state = {f"model/{i}": keras.ops.convert_to_numpy(v) for i, v in enumerate(model.variables)}
    state |= {f"optimizer/{i}": keras.ops.convert_to_numpy(v) for i, v in enumerate(model.optimizer.variables)}
    return state


def run_keras(args: argparse.Namespace) -> keras.Model:
    from ckptstore.client.keras import BackupAndRestore

    model = make_model(args.spe, seeded_dropout=not args.as_users_write)
    save_freq = "epoch" if args.save_freq == "epoch" else int(args.save_freq)
    callback = BackupAndRestore(
        storage=args.storage,
        local_storage=args.local_storage,
        service=args.service,
        job=args.job,
        node="n0",
        save_freq=save_freq,
        delete_checkpoint=False,
        storage_options=args.options,
    )

    class Announce(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            position = callback.resume_position
            print("FRESH" if position is None else f"RESUMED {position.epoch} {position.batch}", flush=True)

    callbacks = [callback, Announce()]
    if args.kill_epoch is not None:
        signum = signal.SIGTERM if args.sigterm else signal.SIGKILL
        callbacks.append(KillAt(args.kill_epoch, args.kill_batch, signum, wait=callback.checkpointer.wait))
    shuffle = args.as_users_write  # keras.io's examples: fit's default shuffle=True, Dropout without a seed
    model.fit(*data(), batch_size=BATCH, epochs=EPOCHS, shuffle=shuffle, verbose=0, callbacks=callbacks)
    return model


def run_loop(args: argparse.Namespace) -> keras.Model:
    import tensorflow as tf

    from ckptstore.client.tensorflow.manager import CheckpointManager

    model = make_model()
    x, y = data()
    optimizer = model.optimizer
    manager = CheckpointManager(
        storage=args.storage,
        service=args.service,
        job=args.job,
        node="n0",
        objects={"model": model, "optimizer": optimizer},
        storage_options=args.options,
    )
    start = manager.restore_or_initialize()
    position = manager.resume_position
    print("FRESH" if position is None else f"RESUMED {position.epoch} {position.batch}", flush=True)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(xb, training=True) - yb) ** 2)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    first_batch = position.batch if position is not None and position.batch is not None else 0
    for epoch in range(start, EPOCHS):
        for batch in range(first_batch if epoch == start else 0, SAMPLES // BATCH):
            if args.kill_epoch is not None and (epoch, batch) == (args.kill_epoch, args.kill_batch):
                if args.sigterm:
                    os.kill(os.getpid(), signal.SIGTERM)  # noted; acted on after this batch
                else:
                    manager.wait()  # the save in flight lands first: a deterministic expected resume position
                    os.kill(os.getpid(), signal.SIGKILL)
            xb, yb = x[batch * BATCH : (batch + 1) * BATCH], y[batch * BATCH : (batch + 1) * BATCH]
            manager.observe_batch((xb, yb))  # shown to the resume proof
            step(xb, yb)
            manager.checkpoint_if_preempted(epoch, batch + 1)
        manager.save(epoch)
    manager.close()
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--storage", required=True)
    parser.add_argument("--local-storage", default=None, help="a local tier replicated to --storage")
    parser.add_argument("--service", default=None)
    parser.add_argument("--job", required=True)
    parser.add_argument("--mode", choices=["keras", "loop"], default="keras")
    parser.add_argument("--save-freq", default="epoch")
    parser.add_argument("--spe", type=int, default=1)
    parser.add_argument("--kill-epoch", type=int, default=None)
    parser.add_argument("--kill-batch", type=int, default=0)
    parser.add_argument("--endpoint", default=None, help="S3 endpoint (moto)")
    parser.add_argument("--shift-names", action="store_true")
    parser.add_argument("--sigterm", action="store_true", help="send SIGTERM (a preemption notice) instead of SIGKILL")
    parser.add_argument("--as-users-write", action="store_true", help="fit with shuffle=True, Dropout unseeded")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    args.options = {"endpoint_url": args.endpoint, "key": "testing", "secret": "testing"} if args.endpoint else None
    if args.shift_names:
        keras.layers.Dense(3)  # an earlier layer shifts auto-generated names (dense -> dense_1 ...)
    model = run_keras(args) if args.mode == "keras" else run_loop(args)
    np.savez(args.out, **final_state(model))


if __name__ == "__main__":
    main()
