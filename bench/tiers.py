"""Tiers, replication and restore against their baselines, in one run (medians, ratios).

    python bench/tiers.py [--gib 1] [--reps 3] [--saves 5] [--previous a81f15f] [--skip ...]

- blocked: time a training loop is blocked per `CheckpointManager.save` of GIB of tf.Variables,
  with a local tier replicated to S3 (moto's server in its own process) against local disk only,
  runs interleaved; the loop "trains" (sleeps) long enough for each local write to finish.
- replication: `Store.copy_from(local, verify="sizes")` of a GIB checkpoint to S3 against a raw
  s3fs upload (`fs.put`) of the same shard files, interleaved.
- restore-local: reading a GIB checkpoint from the local tier, verified (`read_nearest_intact`),
  against a raw read of the same shard files into new buffers it keeps (4 threads), both cold (page
  cache dropped) and each in a fresh process, as at a restart.
- keras-restore: end-to-end `restore_or_initialize()` of a Keras model with GIB of weights (3 × GIB
  of state with Adam), cold, each run in a fresh process: this tree against the previous release
  (`git archive PREVIOUS` on PYTHONPATH) and a raw read of the same blob files into new buffers (4
  threads), interleaved.
- s3-rss: extra RSS during a GIB `Store.save` to S3 (after a warm-up save), against the stated
  bound: uploads in flight × part size + 64 MiB.
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
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.save_restore import PAGE, PeakRss, drop_caches, model_like, report, start_moto  # noqa: E402
from ckptstore import CheckpointRef, Position, Store  # noqa: E402
from ckptstore.storage.filesystem import UPLOAD_PART_SIZE  # noqa: E402
from ckptstore.store import DEFAULT_CONCURRENCY, DEFAULT_SHARD_SIZE  # noqa: E402

S3 = {"key": "testing", "secret": "testing"}


def median(values: list[float]) -> float:
    return statistics.median(values)


def blocked_per_save(gib: float, saves: int, reps: int, endpoint: str) -> dict:
    import tensorflow as tf

    from ckptstore.client.tensorflow.manager import CheckpointManager

    n = max(1, round(gib * 4))
    module = tf.Module()
    module.vs = [tf.Variable(tf.random.uniform((int(gib * 2**30 / n / 4),))) for _ in range(n)]
    state = sum(v.numpy().nbytes for v in module.vs) / 2**30
    blocked: dict[str, list[float]] = {"local only": [], "local + S3": []}
    for rep in range(reps):
        for variant in list(blocked)[:: 1 if rep % 2 == 0 else -1]:
            work = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR"))
            options: dict = {"storage": os.path.join(work, "durable"), "local_storage": None}
            if variant == "local + S3":
                job = f"blocked{rep}"
                options = {"storage": f"s3://bench/{job}", "local_storage": os.path.join(work, "local")}
                options["storage_options"] = {"endpoint_url": endpoint, **S3}
            manager = CheckpointManager(job=f"blocked{rep}", node="n0", objects={"m": module}, **options)
            manager.restore_or_initialize()
            for epoch in range(saves):
                for v in module.vs:
                    v.assign_add(tf.ones_like(v))
                started = time.perf_counter()
                manager.save(epoch)
                blocked[variant].append(time.perf_counter() - started)
                time.sleep(2.5 * gib + 0.5)  # an epoch of training: the local write finishes within it
            manager.close()
            shutil.rmtree(work, ignore_errors=True)
    rows = {k: {"median_s": median(v), "median_s_per_GiB": median(v) / state, "all_s": v} for k, v in blocked.items()}
    rows["ratio_local_s3_to_local"] = rows["local + S3"]["median_s"] / rows["local only"]["median_s"]
    return {"state_GiB": state, "saves_per_run": saves, **rows}


def blob_paths(store: Store, ref: CheckpointRef) -> list[str]:
    """The files of a local copy's shards: blobs of the node's pool, named relative to the root."""
    return [os.path.join(store.url, shard.file) for shard in ref.manifest.shards]


def replication(gib: float, reps: int, endpoint: str) -> dict:
    work = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR"))
    local = Store(os.path.join(work, "local"))
    arrays = model_like(int(gib * 2**30))
    ref = local.save("job", "n0", 0, arrays, attempt="1")
    del arrays
    paths = blob_paths(local, ref)
    durable = Store("s3://bench/replication", storage_options={"endpoint_url": endpoint, **S3})
    fs = durable._storage.fs
    seconds: dict[str, list[float]] = {"raw s3fs put": [], "ckptstore replication": []}
    for rep in range(reps):
        for variant in list(seconds)[:: 1 if rep % 2 == 0 else -1]:
            started = time.perf_counter()
            if variant == "raw s3fs put":
                fs.put(paths, [f"bench/raw{rep}/{os.path.basename(p)}" for p in paths], batch_size=DEFAULT_CONCURRENCY)
            else:
                target = Store(f"s3://bench/rep{rep}", storage_options={"endpoint_url": endpoint, **S3})
                target.copy_from(local, ref.key, verify="sizes")
            seconds[variant].append(time.perf_counter() - started)
    shutil.rmtree(work, ignore_errors=True)
    size = ref.bytes
    rows = {k: {"median_s": median(v), "MB_per_s": size / median(v) / 1e6, "all_s": v} for k, v in seconds.items()}
    rows["ratio_to_raw"] = rows["raw s3fs put"]["median_s"] / rows["ckptstore replication"]["median_s"]
    return {"bytes": size, **rows}


READ_CHILD = """
import os, sys, time
from concurrent.futures import ThreadPoolExecutor
import numpy as np
sys.path.insert(0, sys.argv[1])
from ckptstore import Position, Store
from ckptstore.copies import read_nearest_intact
root, paths = sys.argv[3], sys.argv[4:]


def read(path):
    with open(path, "rb", buffering=0) as handle:
        buffer = np.empty(os.fstat(handle.fileno()).st_size, np.uint8)
        handle.readinto(buffer)
        return buffer


started = time.perf_counter()
if sys.argv[2] == "raw":  # the bytes kept, as a restore keeps them (memory never touched costs its faults)
    with ThreadPoolExecutor(4) as pool:
        kept = list(pool.map(read, paths))
else:
    read_nearest_intact({"local": Store(root)}, "job", "n0", Position(0))
print(time.perf_counter() - started)
"""


def restore_local(gib: float, reps: int) -> dict:
    """Each read in a fresh process with the page cache dropped, as at a restart."""
    work = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR"))
    local = Store(os.path.join(work, "local"))
    arrays = model_like(int(gib * 2**30))
    ref = local.save("job", "n0", 0, arrays, attempt="1")
    del arrays
    paths = blob_paths(local, ref)
    seconds: dict[str, list[float]] = {"raw cold read": [], "ckptstore local restore": []}
    cold = True
    for rep in range(reps):
        for variant, mode in list(zip(seconds, ("raw", "ours")))[:: 1 if rep % 2 == 0 else -1]:
            cold = drop_caches() and cold
            out = subprocess.run(
                [sys.executable, "-c", READ_CHILD, ROOT, mode, local.url, *paths], capture_output=True, text=True
            )
            if out.returncode:
                raise RuntimeError(out.stderr[-2000:])
            seconds[variant].append(float(out.stdout.strip().splitlines()[-1]))
    shutil.rmtree(work, ignore_errors=True)
    rows = {k: {"median_s": median(v), "MB_per_s": ref.bytes / median(v) / 1e6, "all_s": v} for k, v in seconds.items()}
    rows["ratio_to_raw"] = rows["raw cold read"]["median_s"] / rows["ckptstore local restore"]["median_s"]
    return {"bytes": ref.bytes, "cold": cold, **rows}


KERAS_CHILD = """
import os, sys, time, json
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
sys.path.insert(0, sys.argv[1])
from ckptstore.client.tensorflow.manager import CheckpointManager
sys.path.insert(0, sys.argv[2])
from bench.keras_callback import make_model
from bench.save_restore import drop_caches
model = make_model(int(sys.argv[4]))
model.optimizer.build(model.trainable_variables)
manager = CheckpointManager(job="restore", node="n0", storage=sys.argv[3], objects={"model": model, "optimizer": model.optimizer})
if sys.argv[5] == "save":
    manager.restore_or_initialize(); manager.save(0); manager.close(); sys.exit()
drop_caches()
started = time.perf_counter()
epoch = manager.restore_or_initialize()
print(json.dumps({"seconds": time.perf_counter() - started, "epoch": epoch}))
"""


def keras_restore(gib: float, reps: int, previous: str) -> dict:
    work = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR"))
    release = os.path.join(work, "previous")
    os.makedirs(release)
    archive = subprocess.run(["git", "-C", ROOT, "archive", previous], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", release], input=archive, check=True)
    storage, mib = os.path.join(work, "ckpt"), str(int(gib * 1024))
    child = [sys.executable, "-c", KERAS_CHILD]
    subprocess.run([*child, ROOT, ROOT, storage, mib, "save"], check=True, capture_output=True)
    saved = Store(storage)
    copy = saved.copies("restore", "n0", Position(0))[-1]
    paths = [os.path.join(saved.url, shard.file) for shard in saved.manifest(copy).shards]
    raw = "raw cold read into new buffers"
    seconds: dict[str, list[float]] = {f"previous release ({previous})": [], "this tree": [], raw: []}
    for rep in range(reps):
        for variant in list(seconds)[rep % 3 :] + list(seconds)[: rep % 3]:
            if variant == raw:
                drop_caches()
                read = [sys.executable, "-c", READ_CHILD, ROOT, "raw", storage, *paths]
                out = subprocess.run(read, capture_output=True, text=True, check=True)
                seconds[variant].append(float(out.stdout.strip().splitlines()[-1]))
                continue
            code = release if variant.startswith("previous") else ROOT
            env = os.environ | {"PYTHONPATH": code}
            out = subprocess.run([*child, code, ROOT, storage, mib, "load"], capture_output=True, text=True, env=env)
            if out.returncode:
                raise RuntimeError(out.stderr[-2000:])
            result = json.loads(out.stdout.strip().splitlines()[-1])
            assert result["epoch"] == 1
            seconds[variant].append(result["seconds"])
    shutil.rmtree(work, ignore_errors=True)
    rows = {k: {"median_s": median(v), "all_s": v} for k, v in seconds.items()}
    old, new, floor = (rows[k]["median_s"] for k in seconds)
    return {"weights_GiB": gib, "state_GiB": 3 * gib, "speedup": old / new, "ratio_to_raw": floor / new, **rows}


def s3_rss(gib: float, endpoint: str) -> dict:
    store = Store("s3://bench/rss", storage_options={"endpoint_url": endpoint, **S3})
    # One-time setup first: botocore's models, and a connection and thread per upload in flight.
    store.save("warm", "n0", 0, model_like(DEFAULT_CONCURRENCY * DEFAULT_SHARD_SIZE), attempt="1")
    arrays = model_like(int(gib * 2**30))
    extra = []
    for epoch in range(2):
        with PeakRss() as rss:
            store.save("job", "n0", epoch, arrays, attempt="1")
        extra.append(rss.extra / 2**20)
    bound = DEFAULT_CONCURRENCY * UPLOAD_PART_SIZE / 2**20 + 64
    return {"bytes": sum(a.nbytes for a in arrays.values()), "extra_MiB": extra, "bound_MiB": bound}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--previous", default="a81f15f", help="the previous release's commit")
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["blocked", "replication", "restore-local", "keras-restore", "s3-rss"]
    )
    parser.add_argument(
        "--nice-store",
        action="store_true",
        help="run moto at the lowest CPU priority: on this 2-core machine it otherwise competes with the "
        "training process, which a real object store (another machine) does not",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results: dict = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {os.sysconf('SC_PHYS_PAGES') * PAGE / 2**30:.0f} GiB, "
        f"Python {platform.python_version()}",
    }
    process, endpoint = start_moto(nice=19 if args.nice_store else 0)
    try:
        Store("s3://bench", storage_options={"endpoint_url": endpoint, **S3})._storage.fs.mkdir("bench")
        if "s3-rss" not in args.skip:
            results["s3_rss"] = s3_rss(args.gib, endpoint)
        if "replication" not in args.skip:
            results["replication"] = replication(args.gib, args.reps, endpoint)
        if "blocked" not in args.skip:
            results["blocked"] = blocked_per_save(args.gib, args.saves, args.reps, endpoint)
    finally:
        process.terminate()
        process.wait()
    if "restore-local" not in args.skip:
        results["restore_local"] = restore_local(args.gib, max(args.reps, 5))
    if "keras-restore" not in args.skip:
        results["keras_restore"] = keras_restore(args.gib, args.reps, args.previous)
    report(results, args.out)


if __name__ == "__main__":
    main()
