"""What the resume proof costs a Keras `fit` (TensorFlow backend): its compiled step keeps a digest
of each batch (client/tensorflow/batch_digest.py). Times epochs of `fit` with `BackupAndRestore`
(saving at each epoch's end only, so the saves are the same on both sides) with the digest and with
it switched off, interleaved, and reports the medians' ratio per layout.

    python bench/keras_digest.py [--reps 5] [--steps 200]

Runs on a shared machine are bimodal (a whole fit at one speed or about twice it): the medians of
many interleaved runs and the fastest runs' ratio are both reported.

Layouts: tabular (batches of 256 × 784 floats into a 2-layer MLP) and images (batches of 64 ×
32×32×3 into a small CNN: a digest reads at most 4,096 values of each tensor, whatever its size).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from ckptstore.client.keras import BackupAndRestore  # noqa: E402
from ckptstore.client.tensorflow.batch_digest import BatchDigests  # noqa: E402


def layout(name: str, steps: int) -> tuple[keras.Model, np.ndarray, np.ndarray, int]:
    rng = np.random.default_rng(0)
    if name == "tabular":
        batch = 256
        x = rng.standard_normal((steps * batch, 784), dtype=np.float32)
        model = keras.Sequential(
            [keras.Input((784,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)]
        )
    else:
        batch = 64
        x = rng.standard_normal((steps * batch, 32, 32, 3), dtype=np.float32)
        model = keras.Sequential(
            [
                keras.Input((32, 32, 3)),
                keras.layers.Conv2D(16, 3, activation="relu"),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(10),
            ]
        )
    y = rng.integers(0, 10, len(x))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, x, y, batch


def one_fit(name: str, steps: int, digest: bool) -> float:
    """Seconds per step of the second epoch (the first one traces and compiles)."""
    available = BatchDigests.available
    if not digest:
        BatchDigests.available = staticmethod(lambda model: False)  # type: ignore[method-assign]
    try:
        model, x, y, batch = layout(name, steps)
        times: list[float] = []

        class Clock(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.began = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                times.append(time.perf_counter() - self.began)

        with tempfile.TemporaryDirectory(prefix="keras-digest-") as root:
            backup = BackupAndRestore(storage=root, job="digest", save_freq="epoch", async_save=False)
            model.fit(x, y, batch_size=batch, epochs=2, callbacks=[backup, Clock()], verbose=0)
        return times[1] / steps
    finally:
        BatchDigests.available = available  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--verbose", action="store_true", help="print every run's ms a step")
    args = parser.parse_args()
    print(
        f"keras {keras.__version__}, {keras.backend.backend()} backend; {args.steps} steps an epoch; {args.reps} reps"
    )
    for name in ("tabular", "images"):
        runs: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(args.reps):
            for digest in (rep % 2 == 0, rep % 2 != 0):  # interleaved, the order alternating
                runs[digest].append(one_fit(name, args.steps, digest))
        with_, without = statistics.median(runs[True]), statistics.median(runs[False])
        if args.verbose:
            print(name, {k: [round(t * 1e3, 2) for t in v] for k, v in runs.items()})
        fastest = min(runs[True]) / min(runs[False]) - 1
        print(
            f"{name:8s} step {without * 1e3:6.2f} ms without the digest, {with_ * 1e3:6.2f} ms with it: "
            f"{100 * (with_ / without - 1):+.1f} % (medians; fastest runs: {100 * fastest:+.1f} %)"
        )


if __name__ == "__main__":
    main()
