"""Save/load throughput of ckptstore against the raw baselines, interleaved in one run.

    python bench/save_restore.py [--local-gib 1] [--s3-mib 256] [--reps 5] [--kills 1000]

Local disk: ckptstore vs (a) raw fsspec — one file written sequentially + fsync, read back whole —
(b) safetensors.numpy.save_file/load_file + fsync, (c) tf.train.Checkpoint write/read + fsync (if
TensorFlow is installed). S3 (moto server in its own process): ckptstore vs (a) one object per
tensor, all in flight (fsspec `pipe`/`cat`). Runs are interleaved A B C A B C …, order rotated each
repetition; loads are cold (page cache dropped) where the OS allows it. Also: extra RSS during a
save, a shard-size sweep, and random-instant SIGKILL trials during saves on local disk and on S3.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ckptstore import Store  # noqa: E402
from ckptstore.storage.filesystem import open_storage  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def model_like(total_bytes: int) -> dict[str, np.ndarray]:
    """A few large float32 matrices (~99.7 %) plus many small biases, like a dense model."""
    rng = np.random.default_rng(0)
    n_mats = max(1, total_bytes // (128 << 20))
    rows = total_bytes // n_mats // 4 // 8192
    arrays = {f"layer{i}/kernel": rng.random((rows, 8192), dtype=np.float32) for i in range(n_mats)}
    arrays |= {f"layer{i}/bias": rng.random(4096, dtype=np.float32) for i in range(25 * n_mats)}
    return arrays


def nbytes(arrays: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in arrays.values())


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
        return True
    except OSError:
        return False


class PeakRss:
    """Samples this process's RSS every 2 ms; `.extra` is the peak above the starting RSS."""

    def __enter__(self) -> PeakRss:
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * PAGE

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        self.extra = self.peak - self.start


def report(results: dict, out: str | None) -> None:
    """Print the results as JSON, and write them to `out` too when given."""
    text = json.dumps(results, indent=1)
    print(text)
    if out:
        with open(out, "w") as handle:
            handle.write(text)


def fsync_tree(path: str) -> None:
    for directory, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


# -- methods: each returns (save, load) callables over a fresh directory -----------------------


def raw_write(path: str, arrays: dict[str, np.ndarray]) -> None:
    """The raw baseline: every array's bytes written sequentially into one local file with fsspec, then fsync."""
    import fsspec

    with fsspec.filesystem("file").open(path, "wb") as handle:
        for array in arrays.values():
            handle.write(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))
        handle.flush()
        os.fsync(handle.fileno())


def local_methods(arrays: dict[str, np.ndarray], shard_size: int) -> dict[str, tuple[Callable, Callable]]:
    import fsspec
    import safetensors.numpy

    fs = fsspec.filesystem("file")
    methods: dict[str, tuple[Callable, Callable]] = {}

    methods["raw fsspec"] = (lambda d: raw_write(f"{d}/all.bin", arrays), lambda d: fs.cat_file(f"{d}/all.bin"))

    def ckpt_save(d):
        Store(d, shard_size=shard_size).save("bench", "n0", 0, arrays, attempt=1)

    methods["ckptstore"] = (ckpt_save, lambda d: Store(d, shard_size=shard_size).load("bench", "n0", 0))

    def st_save(d):
        safetensors.numpy.save_file(arrays, f"{d}/model.safetensors")
        fsync_tree(d)

    methods["safetensors"] = (st_save, lambda d: safetensors.numpy.load_file(f"{d}/model.safetensors"))
    try:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import tensorflow as tf
    except ImportError:
        return methods
    variables = {name: tf.Variable(array) for name, array in arrays.items()}
    checkpoint = tf.train.Checkpoint(**{name.replace("/", "_"): v for name, v in variables.items()})

    def tf_save(d):
        checkpoint.write(f"{d}/ckpt")
        fsync_tree(d)

    methods["tf.train.Checkpoint"] = (tf_save, lambda d: checkpoint.read(f"{d}/ckpt").assert_consumed())
    return methods


def s3_methods(arrays, endpoint: str, shard_size: int, concurrency: int) -> dict[str, tuple[Callable, Callable]]:
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    storage = open_storage("s3://bench", options)
    fs = storage.fs

    def raw_save(d):
        fs.pipe({f"bench/{d}/{name}": memoryview(a.reshape(-1).view(np.uint8)).tobytes() for name, a in arrays.items()})

    def raw_load(d):
        return fs.cat([f"bench/{d}/{name}" for name in arrays])

    def ckpt_save(d):
        Store(f"s3://bench/{d}", storage_options=options, shard_size=shard_size, concurrency=concurrency).save(
            "bench", "n0", 0, arrays, attempt=1
        )

    def ckpt_load(d):
        return Store(f"s3://bench/{d}", storage_options=options, concurrency=concurrency).load("bench", "n0", 0)

    return {"raw fsspec": (raw_save, raw_load), "ckptstore": (ckpt_save, ckpt_load)}


def interleave(methods, size: int, reps: int, new_dir: Callable[[], str], remove: Callable[[str], None], cold: bool):
    times = {name: {"save": [], "load": [], "rss": []} for name in methods}
    names = list(methods)
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            save, load = methods[name]
            directory = new_dir()
            with PeakRss() as rss:
                started = time.perf_counter()
                save(directory)
                times[name]["save"].append(time.perf_counter() - started)
            times[name]["rss"].append(rss.extra)
            if cold:
                drop_caches()
            started = time.perf_counter()
            result = load(directory)
            times[name]["load"].append(time.perf_counter() - started)
            del result
            remove(directory)
    rows = []
    for name in names:
        row = {"method": name}
        for op in ("save", "load"):
            samples = times[name][op]
            median = statistics.median(samples)
            row[op] = {"median_s": median, "min_s": min(samples), "max_s": max(samples), "MBps": size / median / 1e6}
        row["save_extra_rss_MiB"] = max(times[name]["rss"]) / 2**20
        rows.append(row)
    base = next(r for r in rows if r["method"] == "raw fsspec")
    for row in rows:
        for op in ("save", "load"):
            row[op]["ratio_to_raw"] = row[op]["MBps"] / base[op]["MBps"]
    return rows


def _saving_child(root: str, options: dict | None, arrays: dict[str, np.ndarray], epoch: int) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            Store(root, storage_options=options, shard_size=1 << 20).save("kills", "n", epoch, arrays, attempt=1)
        finally:
            os._exit(0)
    return pid


def random_kills(trials: int, root: str, options: dict | None = None) -> dict:
    """SIGKILL a saving child at a random instant; the listing must never show a partial checkpoint.

    The kill instant is uniform over 1.3 × the measured lifetime of an unkilled child (fork, save,
    commit, exit), so kills land in every phase, the commit included. `root` is local or s3://.
    """
    arrays = model_like(8 << 20)
    lifetimes = []
    for epoch in range(10**6, 10**6 + 7):
        started = time.perf_counter()
        os.waitpid(_saving_child(root, options, arrays, epoch), 0)
        lifetimes.append(time.perf_counter() - started)
    lifetime = statistics.median(lifetimes)
    reader = Store(root, storage_options=options)
    outcome = {
        "root": root.split("://")[0] if "://" in root else "local",
        "trials": trials,
        "committed_intact": 0,
        "not_committed": 0,
        "partial_or_corrupt": 0,
        "child_lifetime_s": lifetime,
    }
    for trial in range(trials):
        pid = _saving_child(root, options, arrays, trial)
        time.sleep(random.uniform(0, lifetime * 1.3))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        if trial in [p.epoch for p in reader.list_positions("kills", "n")]:
            try:
                got = reader.load("kills", "n", trial)
                intact = all(got[k].tobytes() == arrays[k].tobytes() for k in arrays)
            except Exception:
                intact = False
            outcome["committed_intact" if intact else "partial_or_corrupt"] += 1
        else:
            outcome["not_committed"] += 1
        if trial % 50 == 49:
            open_storage(root, options).remove_prefix("kills")
    return outcome


def start_moto(nice: int = 0) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        ["nice", "-n", str(nice), sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    import urllib.request

    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    return process, endpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local-gib", type=float, default=1.0)
    parser.add_argument("--s3-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--kills", type=int, default=1000)
    parser.add_argument("--shard-mib", type=int, default=None, help="ckptstore shard size (default: the library's)")
    parser.add_argument("--sweep", action="store_true", help="also sweep shard sizes")
    parser.add_argument("--skip", nargs="*", default=[], choices=["local", "s3", "kills", "s3-kills"])
    parser.add_argument("--out", default=None, help="write the JSON results here")
    args = parser.parse_args()
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    from ckptstore.store import DEFAULT_SHARD_SIZE

    shard_size = (args.shard_mib << 20) if args.shard_mib else DEFAULT_SHARD_SIZE
    results: dict = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {os.sysconf('SC_PHYS_PAGES') * PAGE / 2**30:.0f} GiB, "
        f"Python {platform.python_version()}",
        "shard_MiB": shard_size >> 20,
        "cold_loads": drop_caches(),
    }
    if "local" not in args.skip:
        arrays = model_like(int(args.local_gib * 2**30))
        size = nbytes(arrays)
        base = tempfile.mkdtemp(prefix="ckptstore-bench-", dir=os.environ.get("BENCH_DIR"))
        counter = iter(range(10**6))
        new_dir = lambda: tempfile.mkdtemp(dir=base, prefix=f"{next(counter)}-")  # noqa: E731
        results["local"] = {
            "bytes": size,
            "tensors": len(arrays),
            "rows": interleave(
                local_methods(arrays, shard_size), size, args.reps, new_dir, shutil.rmtree, results["cold_loads"]
            ),
        }
        if args.sweep:
            sweep = {}
            for mib in (64, 256, 1024):
                rows = interleave(
                    {
                        "raw fsspec": local_methods(arrays, mib << 20)["raw fsspec"],
                        "ckptstore": local_methods(arrays, mib << 20)["ckptstore"],
                    },
                    size,
                    3,
                    new_dir,
                    shutil.rmtree,
                    results["cold_loads"],
                )
                sweep[mib] = {op: rows[1][op]["ratio_to_raw"] for op in ("save", "load")}
            results["local"]["shard_sweep_ratio_to_raw"] = sweep
        shutil.rmtree(base, ignore_errors=True)
        del arrays
    if "s3" not in args.skip:
        process, endpoint = start_moto()
        try:
            storage = open_storage("s3://bench", {"endpoint_url": endpoint, "key": "testing", "secret": "testing"})
            storage.fs.mkdir("bench")
            arrays = model_like(args.s3_mib << 20)
            size = nbytes(arrays)
            counter = iter(range(10**6))
            new_key = lambda: f"run{next(counter)}"  # noqa: E731
            remove = lambda d: storage.fs.rm(f"bench/{d}", recursive=True)  # noqa: E731
            s3_shard = min(shard_size, 64 << 20)
            results["s3"] = {
                "bytes": size,
                "tensors": len(arrays),
                "shard_MiB": s3_shard >> 20,
                "rows": interleave(s3_methods(arrays, endpoint, s3_shard, 8), size, args.reps, new_key, remove, False),
            }
        finally:
            process.terminate()
            process.wait()
    if "kills" not in args.skip and args.kills:
        root = tempfile.mkdtemp(prefix="ckptstore-kills-")
        results["random_kills"] = random_kills(args.kills, root)
        shutil.rmtree(root, ignore_errors=True)
    if "s3-kills" not in args.skip and args.kills:
        process, endpoint = start_moto()
        try:
            options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
            open_storage("s3://kills", options).fs.mkdir("kills")
            results["random_kills_s3"] = random_kills(args.kills, "s3://kills/bench", options)
        finally:
            process.terminate()
            process.wait()
    report(results, args.out)


if __name__ == "__main__":
    main()
