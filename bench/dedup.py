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
- The lossless codec (`ckptstore.format.codec`: zstd of byte-grouped values) on bf16 weights and fp32 Adam
  moments: ratio and single-stream GB/s on one shard, then whole saves and loads to local disk with
  and without it. `--codec-only` runs just this part.
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


def codec_states() -> dict[str, dict]:
    """Real-shaped tensors for the codec: bf16 weights, fp32 Adam moments."""
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(0)
    gradients = rng.standard_normal(64 << 20, dtype=np.float32) * 1e-3
    weights = (rng.standard_normal(256 << 20, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    return {
        "bf16 weights (N(0, 0.02))": {f"w.{i}": part for i, part in enumerate(np.split(weights, 16))},
        "fp32 Adam exp_avg": {f"m.{i}": part for i, part in enumerate(np.split(gradients * 0.1, 4))},
        "fp32 Adam exp_avg_sq": {f"v.{i}": part for i, part in enumerate(np.split(gradients * gradients * 1e-3, 4))},
    }


def codec() -> dict[str, dict]:
    """The built codec (`ckptstore.format.codec`): per kind of tensor, its ratio and single-stream encode and
    decode GB/s on one 64 MiB shard; then whole saves and loads of each state to local disk with a
    plain store and with `Store(codec="bytegroup-zstd")` (this tree only: the codec is new)."""
    from ckptstore import Store
    from ckptstore.format.codec import CODEC_NAME, blob_items, decode, encode

    results: dict[str, dict] = {"shard": {}, "store": {}}
    workdir = tempfile.mkdtemp(prefix="ckpt-codec-")
    try:
        for name, state in codec_states().items():
            size = sum(array.nbytes for array in state.values())
            ref = Store(os.path.join(workdir, "probe")).save("c", "n0", 0, state, attempt=1)
            with open(ref.shard_locations[0], "rb") as handle:
                blob = handle.read()
            started = time.perf_counter()
            encoded = encode(blob_items(blob), len(blob))
            encode_s = time.perf_counter() - started
            assert encoded is not None
            started = time.perf_counter()
            assert decode(encoded, len(blob)).tobytes() == blob
            decode_s = time.perf_counter() - started
            results["shard"][name] = {
                "ratio": round(len(blob) / len(encoded), 3),
                "encode_gb_s": round(len(blob) / encode_s / 1e9, 2),
                "decode_gb_s": round(len(blob) / decode_s / 1e9, 2),
            }
            shutil.rmtree(os.path.join(workdir, "probe"))
            for label, store_codec in (("plain", None), ("codec", CODEC_NAME)):
                root = os.path.join(workdir, label)
                store = Store(root, codec=store_codec)
                started = time.perf_counter()
                ref = store.save("c", "n0", 0, state, attempt=1)
                saved = time.perf_counter() - started
                started = time.perf_counter()
                Store(root).load("c", "n0", 0)
                loaded = time.perf_counter() - started
                stored = sum(shard.stored_size for shard in ref.manifest.shards)
                results["store"][f"{name}, {label}"] = {
                    "ratio": round(size / stored, 3),
                    "save_gb_s": round(size / saved / 1e9, 2),
                    "load_gb_s": round(size / loaded / 1e9, 2),
                }
                shutil.rmtree(root)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
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
