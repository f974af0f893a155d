"""Deterministic crash trials: a forked writer SIGKILLs itself at a named phase of save or delete.

Run as `python -m tests.crash_driver ROOT PHASE TRIALS`; prints a JSON summary. Runs in its own
process so that forking happens without other threads around (moto, pytest plugins).
After every kill a fresh Store checks: nothing partial is listed, everything listed loads
bit-exactly, and the killed checkpoint is committed exactly when the phase is past the commit.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np

from ckptstore import Store
from ckptstore.storage import Storage

JOB, NODE = "crash", "node-0"
SHARD_SIZE = 64 << 10
PHASES = ("after_shards", "mid_shard", "before_rename", "after_rename", "mid_delete")
COMMITTED_AFTER = {
    "after_shards": False,
    "mid_shard": False,
    "before_rename": False,
    "after_rename": True,
    "mid_delete": False,
}


def arrays_for(epoch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(epoch)
    return {f"layer{i}/kernel": rng.standard_normal(12_000 + 97 * i).astype(np.float32) for i in range(6)} | {
        "bias": rng.standard_normal(33).astype(np.float32)
    }


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(phase: str, trial: int) -> None:
    """Patch the real code path so this process SIGKILLs itself at `phase`."""
    write_object, remove_prefix, rename = Storage.write_object, Storage.remove_prefix, os.rename
    if phase == "after_shards":
        written = []
        kill_after = 1 + trial % 4

        def counted(self, relpath, chunks):
            write_object(self, relpath, chunks)
            written.append(relpath)
            if len(written) == kill_after:
                die()

        Storage.write_object = counted
    elif phase == "mid_shard":

        def partial(self, relpath, chunks):
            def cut():
                for index, chunk in enumerate(chunks):
                    if index == 1 + trial % 2:
                        die()
                    yield chunk

            write_object(self, relpath, cut())

        Storage.write_object = partial
    elif phase == "before_rename":
        os.rename = lambda *a, **k: die()
    elif phase == "after_rename":
        os.rename = lambda *a, **k: (rename(*a, **k), die())
    elif phase == "mid_delete":
        Storage.remove_prefix = lambda self, relpath: die() or remove_prefix(self, relpath)


def run(root: str, phase: str, trials: int) -> dict:
    summary = {
        "phase": phase,
        "trials": trials,
        "killed": 0,
        "partial_listed": 0,
        "bad_loads": 0,
        "wrong_commit_state": 0,
    }
    for trial in range(trials):
        if phase == "mid_delete":
            Store(root, shard_size=SHARD_SIZE).save(JOB, NODE, trial, arrays_for(trial), attempt=1)
        pid = os.fork()
        if pid == 0:
            try:
                arm(phase, trial)
                store = Store(root, shard_size=SHARD_SIZE, concurrency=1)
                if phase == "mid_delete":
                    store.delete(JOB, NODE, trial)
                else:
                    store.save(JOB, NODE, trial, arrays_for(trial), attempt=1)
            finally:
                os._exit(99)  # only reached if the kill did not happen
        _, status = os.waitpid(pid, 0)
        summary["killed"] += os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        reader = Store(root)
        infos = reader.list_checkpoints(JOB, NODE)
        listed = {i.position.epoch for i in infos if i.committed}
        if (trial in listed) != COMMITTED_AFTER[phase]:
            summary["wrong_commit_state"] += 1
        for epoch in listed:
            try:
                got = reader.load(JOB, NODE, epoch)
            except Exception:
                summary["partial_listed"] += 1
                continue
            want = arrays_for(epoch)
            if set(got) != set(want) or any(got[k].tobytes() != want[k].tobytes() for k in want):
                summary["bad_loads"] += 1
    return summary


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
