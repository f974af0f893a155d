"""Retention killed at random instants: a forked process deletes a parent job's old copies and collects
its blobs, and is SIGKILLed part-way — at the k-th storage call for a random k, or after a random delay.

Run as `python -m tests.retention_kill_driver ROOT TRIALS SEED`; prints a JSON summary. Each trial
builds, under a root of its own, a parent job (4 saves of a frozen base and changing adapters) and a
fork of it (one save pointing into the parent's pool), then kills a retention of the parent's three
oldest positions. After the kill a fresh Store checks that every committed copy of both jobs still
loads bit-exactly (no referenced blob lost) and that the kept positions are all there; then the
retention runs again to the end and the parent's pool must hold exactly the blobs committed copies
reference (the garbage a kill left is collected).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time

import numpy as np

from ckptstore import Position, Store
from ckptstore.storage.filesystem import Storage
from tests.builders import failed_loads

PARENT, CHILD, NODE = "parent", "child", "n0"
MUTATIONS = ("remove_file", "remove_prefix", "publish_object", "rename", "write_object")


def state(step: int) -> dict[str, np.ndarray]:
    frozen = np.random.default_rng(0)
    arrays = {f"base.{i}": frozen.standard_normal(4096, dtype=np.float32) for i in range(4)}
    return arrays | {"adapter": np.random.default_rng(step).standard_normal(256, dtype=np.float32)}


def build(root: str) -> None:
    store = Store(root, shard_size=32 << 10)
    for step in range(4):
        store.save(PARENT, NODE, step, state(step), attempt=1)
    fork_point = store.manifest(store.key(PARENT, NODE, Position(1), "1"))
    Store(root).write(Store(root).key(CHILD, NODE, Position(0), "1"), state(100), bases=[fork_point])


def retention(root: str) -> None:
    store = Store(root)
    for step in range(3):
        if store.copies(PARENT, NODE, Position(step)):
            store.delete(PARENT, NODE, step)
    store.collect_blobs(PARENT, NODE, grace_seconds=0)


def arm_after_calls(count: int) -> None:
    calls = [0]
    for name in MUTATIONS:
        real = getattr(Storage, name)

        def counted(self, *args, _real=real, **kwargs):
            calls[0] += 1
            if calls[0] == count:
                os.kill(os.getpid(), signal.SIGKILL)
            return _real(self, *args, **kwargs)

        setattr(Storage, name, counted)


def count_calls(root: str) -> int:
    """How many storage mutations an uninterrupted retention makes (on a scratch copy of the set-up)."""
    calls = [0]
    originals = {name: getattr(Storage, name) for name in MUTATIONS}
    for name, real in originals.items():

        def counted(self, *args, _real=real, **kwargs):
            calls[0] += 1
            return _real(self, *args, **kwargs)

        setattr(Storage, name, counted)
    try:
        retention(root)
    finally:
        for name, real in originals.items():
            setattr(Storage, name, real)
    return calls[0]


def check(root: str, summary: dict) -> None:
    reader = Store(root)
    for job, expected in ((PARENT, {3}), (CHILD, {0})):
        positions = {p.epoch for p in reader.list_positions(job, NODE)}
        if not expected <= positions:
            summary["kept_positions_lost"] += 1
        unreadable, wrong = failed_loads(
            reader, job, NODE, positions, lambda e, job=job: state(100 if job == CHILD else e)
        )
        summary["referenced_blobs_lost"] += unreadable
        summary["bad_loads"] += wrong


def run(root: str, trials: int, seed: int) -> dict:
    chooser = random.Random(seed)
    summary = {"trials": trials, "killed": 0, "referenced_blobs_lost": 0, "kept_positions_lost": 0, "bad_loads": 0}
    summary |= {"garbage_left_after_rerun": 0}
    build(f"{root}/scratch")
    calls = count_calls(f"{root}/scratch")
    started = time.perf_counter()
    retention_seconds = 0.0
    for trial in range(trials):
        where = f"{root}/trial-{trial}"
        build(where)
        pid = os.fork()
        if pid == 0:
            try:
                if trial % 2 == 0:
                    arm_after_calls(chooser.randint(1, calls))
                else:
                    delay = chooser.uniform(0, max(retention_seconds, 0.002))
                    threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
                retention(where)
                time.sleep(5)  # a timed kill that missed the retention lands here: still a kill after it
            finally:
                os._exit(99)
        began = time.perf_counter()
        _, status = os.waitpid(pid, 0)
        if trial % 2 == 0:
            retention_seconds = max(retention_seconds, time.perf_counter() - began)
        summary["killed"] += os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        check(where, summary)
        retention(where)
        reader = Store(where)
        referenced = {
            s.file
            for job in (PARENT, CHILD)
            for info in reader.list_checkpoints(job, NODE)
            if info.manifest
            for s in info.manifest.shards
        }
        pool = os.path.join(where, PARENT, NODE, ".blobs")
        stored = {f"{PARENT}/{NODE}/.blobs/{f}" for f in os.listdir(pool) if not f.startswith(".")}
        summary["garbage_left_after_rerun"] += len(stored - referenced)
        summary["referenced_blobs_lost"] += len({f for f in referenced if f.startswith(f"{PARENT}/")} - stored)
    summary["calls_per_retention"] = calls
    summary["seconds"] = round(time.perf_counter() - started, 1)
    return summary


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
