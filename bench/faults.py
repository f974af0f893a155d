"""Saves and restores through a flaky object store: moto's S3 server behind tests/faults.py's proxy.

    python bench/faults.py [--rates 0 0.1 0.3 0.9] [--saves 20] [--mib 4]

For each fault rate (500, 503 SlowDown, connection resets, lost answers, 0.2 s latency, truncated
bodies, drawn evenly) it saves --saves checkpoints of --mib MiB (1 MiB shards) and restores each
one, and reports: saves committed, saves failed cleanly (nothing committed, or a complete commit),
restores bit-exact, restores that returned wrong bytes (must be 0), faults injected, and time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from ckptstore import Store
from ckptstore.errors import CkptStoreError
from tests.faults import FaultProxy
from tests.servers import MotoS3


def run_rate(moto: MotoS3, rate: float, saves: int, mib: int) -> dict:
    proxy = FaultProxy(moto.endpoint_url, rate=rate, seed=int(rate * 1000))
    root = f"s3://{moto.bucket}/bench-faults-{uuid.uuid4().hex[:8]}"
    faulty = Store(root, storage_options=moto.options | {"endpoint_url": proxy.endpoint_url}, shard_size=1 << 20)
    direct = Store(root, storage_options=moto.options)
    row = {"rate": rate, "saves": saves, "committed": 0, "failed_clean": 0, "partial": 0}
    row |= {"restored_exact": 0, "restore_failed": 0, "wrong_bytes": 0}
    started = time.perf_counter()
    for epoch in range(saves):
        arrays = {"w": np.random.default_rng(epoch).standard_normal(mib << 18).astype(np.float32)}
        try:
            faulty.save("job", "n0", epoch, arrays, attempt="1")
            row["committed"] += 1
        except (OSError, CkptStoreError):
            committed = epoch in {p.epoch for p in direct.list_positions("job", "n0")}
            row["failed_clean" if not committed or direct.verify("job", "n0", epoch).ok else "partial"] += 1
            continue
        try:
            got = faulty.load("job", "n0", epoch)
            row["restored_exact" if got["w"].tobytes() == arrays["w"].tobytes() else "wrong_bytes"] += 1
        except (OSError, CkptStoreError):
            row["restore_failed"] += 1
    row["seconds"] = time.perf_counter() - started
    row["requests"] = proxy.requests
    row["injected"] = dict(proxy.injected)
    proxy.stop()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", type=float, default=[0.0, 0.1, 0.3, 0.9])
    parser.add_argument("--saves", type=int, default=20)
    parser.add_argument("--mib", type=int, default=4)
    args = parser.parse_args()
    moto = MotoS3()
    rows = []
    for rate in args.rates:
        rows.append(run_rate(moto, rate, args.saves, args.mib))
        print(json.dumps(rows[-1]), flush=True)
    moto.stop()
    print(
        json.dumps(
            {
                "command": " ".join(["python"] + sys.argv),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
