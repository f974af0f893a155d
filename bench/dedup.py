"""Bytes paid once: content-addressed saves against the previous release, in one run.

    python bench/dedup.py [--frozen-mib 1024] [--trained-mib 16] [--saves 10] [--reps 5] [--previous REF]

- LoRA-shaped state (a frozen bf16 base and small fp32 adapters that change at every save), saved
  `--saves` times in one process with this tree and with `git archive REF` (the release before
  content-addressed blobs): bytes written in all, and each save's blocking time against the first
  (a full save).
- A fork: a second job whose first save points at the parent's copy (`Store.write(..., bases=)`),
  at the fork point and after its adapters changed: bytes written against the checkpoint's size.
- A state that changes completely at every save (1 GiB of fp32), this tree against REF: the second
  save of a process (a base on storage, nothing reusable), medians of `--reps` interleaved runs,
  each in a fresh process.
- Hashing: XXH3-128 and the 4 KiB probe on this machine, GiB/s.
- A lossless codec candidate (not built into ckptstore: see RESULTS): zstd of byte-grouped bf16
  weights and fp32 Adam moments (each value's bytes split into planes), ratio and GB/s
  (needs `pip install zstandard`; skipped without it). `--codec-only` runs just this part.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.service import extract  # noqa: E402

STATES = """
import numpy as np, ml_dtypes

_BASES = {}

def lora(frozen_mib, trained_mib, step):
    if frozen_mib not in _BASES:  # 4 MiB bf16 matrices of 2048 x 1024, drawn once
        base = np.random.default_rng(0)
        _BASES[frozen_mib] = {
            f"base.{i}.weight": base.standard_normal((2048, 1024), dtype=np.float32).astype(ml_dtypes.bfloat16)
            for i in range(frozen_mib // 4)
        }
    state = dict(_BASES[frozen_mib])
    trained = np.random.default_rng(1000 + step)
    for i in range(trained_mib * 4):  # 256 KiB fp32 adapters
        state[f"lora.{i}.A"] = trained.standard_normal(65536, dtype=np.float32)
    return state

def changing(mib, step):
    rng = np.random.default_rng(step)
    return {f"layer{i}.kernel": rng.random((2048, 8192), dtype=np.float32) for i in range(mib // 64)}
"""

LORA_CHILD = (
    STATES
    + """
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from ckptstore import Store
root, frozen, trained, saves = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])

def disk():
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)

store, seconds, written = Store(root), [], []
for step in range(saves):
    state = lora(frozen, trained, step)
    before = disk()
    started = time.perf_counter()
    ref = store.save("parent", "n0", step, state, attempt="1")
    seconds.append(time.perf_counter() - started)
    written.append(disk() - before)
fork = {}
if hasattr(Store, "collect_blobs"):
    point = store.manifest(ref.key)
    for name, step in (("at_fork_point", saves - 1), ("after_adapters_changed", 10_000)):
        child = Store(root)
        before = disk()
        started = time.perf_counter()
        child.write(child.key(name.replace("_", "-"), "n0", ref.key.position, "1"), lora(frozen, trained, step),
                    bases=[point])
        fork[name] = {"seconds": time.perf_counter() - started, "written": disk() - before}
print(json.dumps({"seconds": seconds, "written": written, "checkpoint": ref.bytes, "fork": fork}))
"""
)

CHANGING_CHILD = (
    STATES
    + """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from ckptstore import Store
store, mib = Store(sys.argv[2]), int(sys.argv[3])
store.save("job", "n0", 0, changing(mib, 0), attempt="1")
state = changing(mib, 1)
started = time.perf_counter()
store.save("job", "n0", 1, state, attempt="1")
print(json.dumps({"seconds": time.perf_counter() - started}))
"""
)


def child(code: str, tree: str, *args: object) -> dict:
    out = subprocess.run([sys.executable, "-c", code, tree, *map(str, args)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def hashing() -> dict[str, float]:
    import numpy as np

    from ckptstore.blobs import tensor_hash, tensor_probe

    array = np.random.default_rng(0).random(64 << 20, dtype=np.float32)  # 256 MiB
    timings = {}
    for name, function in (("xxh3_128", tensor_hash), ("probe", tensor_probe)):
        function(array)
        started = time.perf_counter()
        for _ in range(3):
            function(array)
        timings[name] = round(3 * array.nbytes / (time.perf_counter() - started) / 2**30, 1)
    return timings


def codec() -> dict[str, dict[str, float]]:
    """Ratio and single-stream GB/s of zstd level 1 on raw and byte-grouped real-shaped tensors."""
    try:
        import zstandard
    except ImportError:
        return {}
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(0)
    gradients = rng.standard_normal(32 << 20, dtype=np.float32) * 1e-3
    tensors = {
        "bf16 weights (N(0, 0.02))": (rng.standard_normal(64 << 20, dtype=np.float32) * 0.02).astype(
            ml_dtypes.bfloat16
        ),
        "fp32 Adam exp_avg": gradients * 0.1,
        "fp32 Adam exp_avg_sq": gradients * gradients * 1e-3,
    }
    results = {}
    for name, array in tensors.items():
        for grouping in ("raw", "byte-grouped"):
            planes = array.view(np.uint8).reshape(-1, array.dtype.itemsize)
            data = (planes if grouping == "raw" else np.ascontiguousarray(planes.T)).tobytes()
            started = time.perf_counter()
            packed = zstandard.ZstdCompressor(level=1).compress(data)
            encoded = time.perf_counter() - started
            started = time.perf_counter()
            zstandard.ZstdDecompressor().decompress(packed)
            decoded = time.perf_counter() - started
            results[f"{name}, {grouping}"] = {
                "ratio": round(len(data) / len(packed), 3),
                "encode_gb_s": round(len(data) / encoded / 1e9, 2),
                "decode_gb_s": round(len(data) / decoded / 1e9, 2),
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frozen-mib", type=int, default=1024)
    parser.add_argument("--trained-mib", type=int, default=16)
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--changing-mib", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--previous", default="6818d81", help="the release before content-addressed blobs")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--codec-only", action="store_true")
    args = parser.parse_args()
    if args.codec_only:
        print(json.dumps({"codec": codec()}, indent=1))
        return
    workdir = tempfile.mkdtemp(prefix="ckpt-dedup-", dir=args.workdir)
    previous = extract(args.previous)
    trees = {"this": ROOT, "previous": previous}
    results: dict = {"machine": platform.platform(), "cpus": os.cpu_count(), "args": vars(args)}
    try:
        lora = {}
        for name, tree in trees.items():
            root = os.path.join(workdir, f"lora-{name}")
            lora[name] = child(LORA_CHILD, tree, root, args.frozen_mib, args.trained_mib, args.saves)
            shutil.rmtree(root)
        this, before = lora["this"], lora["previous"]
        results["lora"] = {
            "written_gib": {n: round(sum(r["written"]) / 2**30, 3) for n, r in lora.items()},
            "first_save_s": {n: round(r["seconds"][0], 3) for n, r in lora.items()},
            "later_saves_s_median": {n: round(statistics.median(r["seconds"][1:]), 3) for n, r in lora.items()},
            "later_over_first_max": round(max(this["seconds"][1:]) / this["seconds"][0], 3),
            "later_over_previous_full_median": round(
                statistics.median(this["seconds"][1:]) / statistics.median(before["seconds"]), 3
            ),
            "fork": {
                k: {"written_fraction": round(v["written"] / this["checkpoint"], 4), "seconds": round(v["seconds"], 3)}
                for k, v in this["fork"].items()
            },
        }
        changing: dict[str, list[float]] = {name: [] for name in trees}
        for rep in range(args.reps):
            for name in list(trees)[:: 1 if rep % 2 == 0 else -1]:
                root = os.path.join(workdir, f"changing-{name}")
                changing[name].append(child(CHANGING_CHILD, trees[name], root, args.changing_mib)["seconds"])
                shutil.rmtree(root)
        medians = {name: statistics.median(values) for name, values in changing.items()}
        results["changing"] = {
            "seconds": {n: [round(v, 3) for v in values] for n, values in changing.items()},
            "gb_s_median": {n: round(args.changing_mib * 2**20 / m / 1e9, 2) for n, m in medians.items()},
            "speed_this_over_previous": round(medians["previous"] / medians["this"], 3),
        }
        results["hashing_gib_s"] = hashing()
        results["codec"] = codec()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(previous, ignore_errors=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
