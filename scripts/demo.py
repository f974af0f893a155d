"""The main job on the embedded defaults: train, get killed mid-save, resume from the last good epoch.

A small numpy "model" trains for 6 epochs, saving every epoch to local storage; the first run is
SIGKILLed while writing epoch 3. The rerun finds the last committed epoch, restores it, verifies
that the restored state is bit-equal to what was saved, and finishes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

import numpy as np

from ckptstore import Store

JOB, NODE, EPOCHS, KILL_AT = "demo", "worker-0", 6, 3


def train_epoch(state: dict[str, np.ndarray], epoch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(epoch)
    return {name: value + rng.standard_normal(value.shape).astype(value.dtype) * 0.01 for name, value in state.items()}


def initial_state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"dense/kernel": rng.standard_normal((512, 512)).astype(np.float32), "dense/bias": np.zeros(512, np.float32)}


def run(storage: str, kill_at: int | None) -> None:
    store = Store(storage)
    latest = store.latest(JOB, NODE)
    if latest is None:
        state, start = initial_state(), 0
        print(f"[train] fresh start at epoch 0 (storage {storage})")
    else:
        state, start = dict(store.load(JOB, NODE, latest.epoch)), latest.epoch + 1
        print(f"[train] resumed from {latest}: continuing at epoch {start}")
    for epoch in range(start, EPOCHS):
        state = train_epoch(state, epoch)
        if epoch == kill_at:
            print(f"[train] preempted (SIGKILL) while saving epoch {epoch}", flush=True)
            _kill_during_save(store, state, epoch)
        ref = store.save(JOB, NODE, epoch, state, step=epoch * 100)
        print(f"[train] epoch {epoch} saved: {ref.bytes} bytes at {ref.location}")


def _kill_during_save(store: Store, state: dict[str, np.ndarray], epoch: int) -> None:
    """Die after the shards are written, before the manifest commits them."""
    original = store._storage.publish_object
    store._storage.publish_object = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL) or original(*a, **k)


def main() -> None:
    storage = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="ckptstore-demo-")
    if len(sys.argv) > 2:
        run(storage, kill_at=int(sys.argv[2]) if sys.argv[2] != "-" else None)
        return
    first = subprocess.run([sys.executable, __file__, storage, str(KILL_AT)])
    print(f"[demo] first run ended by signal {-first.returncode}")
    store = Store(storage)
    print(f"[demo] committed positions after the crash: {[str(p) for p in store.list_positions(JOB, NODE)]}")
    leftovers = [i.location for i in store.list_checkpoints(JOB, NODE) if not i.committed]
    print(f"[demo] uncommitted leftovers (never restored): {leftovers}")
    subprocess.run([sys.executable, __file__, storage, "-"], check=True)
    print(f"[demo] committed epochs now: {store.list_epochs(JOB, NODE)}")
    print(f"[demo] verify epoch {EPOCHS - 1}: ok={store.verify(JOB, NODE, EPOCHS - 1).ok}")


if __name__ == "__main__":
    main()
