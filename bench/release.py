"""Core save and cold load: this tree against the previous release, interleaved in one run.

    python bench/release.py [--gib 1] [--reps 5] [--previous a81f15f]

Each save and each load runs in a fresh process that imports one tree (`git archive PREVIOUS` on
PYTHONPATH, or this one) and times `Store.save` / `Store.load` of the same arrays itself; loads are
cold (page cache dropped). Orders alternate per repetition. Reports medians and ratios.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.save_restore import PAGE, drop_caches, report  # noqa: E402
from bench.service import extract  # noqa: E402

CHILD = """
import sys, time
sys.path.insert(0, sys.argv[1])
sys.path.insert(1, sys.argv[2])
from ckptstore import Store
from bench.save_restore import model_like
store = Store(sys.argv[3])
if sys.argv[4] == "save":
    arrays = model_like(int(float(sys.argv[5]) * 2**30))
    started = time.perf_counter()
    store.save("job", "n0", int(sys.argv[6]), arrays, attempt="1")
else:
    started = time.perf_counter()
    store.load("job", "n0", int(sys.argv[6]))
print(time.perf_counter() - started)
"""


def run(code: str, root: str, op: str, gib: float, epoch: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, code, ROOT, root, op, str(gib), str(epoch)],
        capture_output=True,
        text=True,
        env=os.environ | {"PYTHONPATH": code},
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--previous", default="a81f15f")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    trees = {f"previous ({args.previous})": extract(args.previous), "this tree": ROOT}
    work = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR"))
    seconds: dict[str, dict[str, list[float]]] = {name: {"save": [], "load": []} for name in trees}
    cold = True
    for rep in range(args.reps):
        for name in list(trees)[:: 1 if rep % 2 == 0 else -1]:
            root = os.path.join(work, f"{rep}-{len(seconds[name]['save'])}-{name[:4]}")
            seconds[name]["save"].append(run(trees[name], root, "save", args.gib, 0))
            cold = drop_caches() and cold
            seconds[name]["load"].append(run(trees[name], root, "load", args.gib, 0))
            shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    size = args.gib * 2**30
    rows = {
        name: {
            op: {"median_s": statistics.median(v), "MB_per_s": size / statistics.median(v) / 1e6, "all_s": v}
            for op, v in ops.items()
        }
        for name, ops in seconds.items()
    }
    previous, current = (rows[name] for name in trees)
    results = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {os.sysconf('SC_PHYS_PAGES') * PAGE / 2**30:.0f} GiB, "
        f"Python {platform.python_version()}",
        "cold_loads": cold,
        "rows": rows,
        "this_tree_vs_previous": {op: previous[op]["median_s"] / current[op]["median_s"] for op in ("save", "load")},
    }
    report(results, args.out)


if __name__ == "__main__":
    main()
