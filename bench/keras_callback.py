"""What checkpointing costs a Keras training: ckptstore's callback vs keras.callbacks.BackupAndRestore.

    python bench/keras_callback.py [--sizes 1024 100] [--reps 3] [--epochs 3]

For a dense model of about SIZE MiB of weights (+ Adam slots: ≈ 3 × SIZE MiB of state), trained on
CPU with epochs long enough that a background write finishes within one, it runs interleaved
(A B C D, order rotated per repetition) fits with: no callback, Keras' BackupAndRestore,
ckptstore BackupAndRestore with async_save=False, and with async saves (the default), all on
local disk. Reports the median per-epoch time added over no callback, the time training is
blocked per save, the background write throughput against the raw baseline (the same bytes as
one fsspec file + fsync, written in the same process after the fit), the restore time at the start of a resumed
fit, and whether the final weights equal the run without a callback.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import crc32c  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from bench.save_restore import raw_write  # noqa: E402
from ckptstore.client.keras import BackupAndRestore  # noqa: E402

WIDTH = 4096


def make_model(size_mib: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    layers = max(1, round(size_mib * 2**20 / (WIDTH * WIDTH * 4)))
    width = WIDTH if layers > 1 else int((size_mib * 2**20 / 4) ** 0.5)
    model = keras.Sequential([keras.Input((width,))] + [keras.layers.Dense(width) for _ in range(layers)])
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    return model


def state_bytes(model: keras.Model) -> int:
    return sum(np.asarray(v).nbytes for v in model.variables + model.optimizer.variables)


class EpochTimer(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.times, self.started = [], time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        now = time.perf_counter()
        self.times.append(now - self.started)
        self.started = now


class TimedCallback(BackupAndRestore):
    """ckptstore's callback, timing how long each save blocks training."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.blocked: list[float] = []
        self.written: list[float] = []
        self.restore_s: float | None = None
        write = self.checkpointer._write

        def timed_write(*a, **k):
            started = time.perf_counter()
            write(*a, **k)
            self.written.append(time.perf_counter() - started)

        self.checkpointer._write = timed_write

    def _save(self, position, logs):
        started = time.perf_counter()
        super()._save(position, logs)
        self.blocked.append(time.perf_counter() - started)

    def on_train_begin(self, logs=None):
        started = time.perf_counter()
        super().on_train_begin(logs)
        if self.resume_position is not None:
            self.restore_s = time.perf_counter() - started


def raw_write_seconds(model: keras.Model, workdir: str, reps: int = 3) -> list[float]:
    """The raw baseline in the same process and directory: the same bytes as one fsspec file + fsync."""
    arrays = {str(i): np.asarray(v) for i, v in enumerate(model.variables + model.optimizer.variables)}
    seconds = []
    for rep in range(reps):
        path = os.path.join(workdir, f"raw-{rep}.bin")
        started = time.perf_counter()
        raw_write(path, arrays)
        seconds.append(time.perf_counter() - started)
        os.unlink(path)
    return seconds


def run(variant: str, size_mib: int, epochs: int, workdir: str, x: np.ndarray, y: np.ndarray) -> dict:
    model = make_model(size_mib)
    model.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)  # build + compile the step outside the timing
    timer = EpochTimer()
    callbacks: list = [timer]
    ours = None
    if variant == "keras BackupAndRestore":
        callbacks.insert(0, keras.callbacks.BackupAndRestore(os.path.join(workdir, "keras"), delete_checkpoint=False))
    elif variant.startswith("ckptstore"):
        ours = TimedCallback(
            storage=os.path.join(workdir, "ckptstore"),
            job="bench",
            node="n0",
            async_save=variant.endswith("async"),
            delete_checkpoint=False,
        )
        callbacks.insert(0, ours)
    model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, callbacks=callbacks)
    if ours is not None:
        ours.checkpointer.wait()
    # Digests, not copies: keeping every run's final weights would hold GiBs per run.
    result = {"epoch_s": timer.times, "final": [crc32c.crc32c(np.ascontiguousarray(v)) for v in model.variables]}
    result["final"] = [int(c) for c in result["final"]]
    if ours is not None:
        result["raw_write_s"] = raw_write_seconds(model, workdir)
        result["blocked_s"] = ours.blocked
        result["write_s"] = ours.written
        result["state_bytes"] = state_bytes(model)
        resumed = TimedCallback(
            storage=os.path.join(workdir, "ckptstore"), job="bench", node="n0", delete_checkpoint=False
        )
        again = make_model(size_mib)
        again.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)
        again.fit(x[:32], y[:32], batch_size=32, epochs=epochs + 1, initial_epoch=0, verbose=0, callbacks=[resumed])
        result["restore_s"] = resumed.restore_s
    return result


def run_in_subprocess(variant: str, size: int, args: argparse.Namespace) -> dict:
    """One fit per process: TensorFlow keeps freed memory cached, so runs must not share a process."""
    command = [
        sys.executable,
        __file__,
        "--one",
        variant,
        "--sizes",
        str(size),
        "--epochs",
        str(args.epochs),
        "--steps",
        str(args.steps),
    ]
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def run_one(variant: str, size: int, args: argparse.Namespace) -> None:
    width = make_model(size).input_shape[-1]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32 * args.steps, width)).astype("float32")
    y = rng.standard_normal((32 * args.steps, width)).astype("float32") * 0.01
    workdir = tempfile.mkdtemp(prefix="ckptstore-kbench-", dir=os.environ.get("BENCH_DIR"))
    try:
        print(json.dumps(run(variant, size, args.epochs, workdir, x, y)))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1024, 100], help="MiB of weights")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="batches per epoch")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.one:
        run_one(args.one, args.sizes[0], args)
        return
    variants = ["none", "keras BackupAndRestore", "ckptstore sync", "ckptstore async"]
    results: dict = {
        "command": " ".join(["python"] + sys.argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "sizes": {},
    }
    for size in args.sizes:
        samples: dict[str, list[dict]] = {v: [] for v in variants}
        for rep in range(args.reps):
            for variant in variants[rep % 4 :] + variants[: rep % 4]:
                samples[variant].append(run_in_subprocess(variant, size, args))
        baseline_epoch = statistics.median(t for s in samples["none"] for t in s["epoch_s"][1:])
        rows = {}
        for variant in variants:
            epoch = statistics.median(t for s in samples[variant] for t in s["epoch_s"][1:])
            row = {
                "epoch_s": epoch,
                "added_per_epoch_s": epoch - baseline_epoch,
                "same_result_as_none": all(s["final"] == samples["none"][0]["final"] for s in samples[variant]),
            }
            if variant.startswith("ckptstore"):
                state = samples[variant][0]["state_bytes"]
                blocked = statistics.median(b for s in samples[variant] for b in s["blocked_s"])
                write = statistics.median(w for s in samples[variant] for w in s["write_s"])
                raw = statistics.median(w for s in samples[variant] for w in s["raw_write_s"])
                row |= {
                    "state_GiB": state / 2**30,
                    "blocked_per_save_s": blocked,
                    "write_s": write,
                    "write_MBps": state / write / 1e6,
                    "raw_write_MBps": state / raw / 1e6,
                    "write_vs_raw": raw / write,
                    "blocked_s_per_GiB": blocked / (state / 2**30),
                    "restore_s": statistics.median(s["restore_s"] for s in samples[variant]),
                }
            rows[variant] = row
        keras_added = rows["keras BackupAndRestore"]["added_per_epoch_s"]
        for variant in ("ckptstore sync", "ckptstore async"):
            rows[variant]["added_vs_keras"] = (
                rows[variant]["added_per_epoch_s"] / keras_added if keras_added > 0 else None
            )
        results["sizes"][size] = {"baseline_epoch_s": baseline_epoch, "rows": rows}
        print(json.dumps({size: results["sizes"][size]}, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
