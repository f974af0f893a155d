"""Save and restore through presigned URLs against the same through s3fs with credentials (issue 31).

    python bench/presigned.py [--mib 1024] [--reps 3] [--out FILE]

moto's S3 server and the signing service (`python -m ckptstore.server`, holding moto's credentials) each run in
their own process. Per repetition, interleaved and the order rotated: `ckptstore.Store` saves the same
state (`model_like`, 1 GiB by default) to a fresh root and loads it back, (a) through s3fs with the
credentials, (b) through URLs the service signs for a registered node (`ckptstore.client.service.presigned`: the
filesystem a `presigned=True` node uses). Medians; ratio = presigned speed / s3fs speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.save_restore import model_like, nbytes, report, start_moto  # noqa: E402
from ckptstore import Store  # noqa: E402
from ckptstore.client.service.presigned import presigned_storage  # noqa: E402
from ckptstore.client.service.rest import ServiceClient  # noqa: E402
from ckptstore.client.service.signed_urls import SignedUrlSource  # noqa: E402
from ckptstore.storage.filesystem import open_storage  # noqa: E402
from tests.live import start_service_process  # noqa: E402
from tests.servers import free_port  # noqa: E402

Method = tuple[Callable[[str], None], Callable[[str], object]]


def methods(arrays, endpoint: str, service: str) -> dict[str, Method]:
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    client = ServiceClient(service)

    def s3fs_save(d: str) -> None:
        Store(f"s3://bench/{d}", storage_options=options).save("bench", "n0", 0, arrays, attempt=1)

    def s3fs_load(d: str) -> object:
        return Store(f"s3://bench/{d}", storage_options=options).load("bench", "n0", 0)

    def presigned_store(d: str) -> Store:
        urls = SignedUrlSource(lambda wanted: client.presigned_urls(d, "n0", wanted), lambda: "1")
        return Store(f"s3://bench/{d}", storage=presigned_storage(f"s3://bench/{d}", urls, job=d, node="n0"))

    def presigned_save(d: str) -> None:
        client.put_job(d, ["n0"], storage_root=f"s3://bench/{d}")
        assert client.start_attempt(d, "n0") == "1"
        presigned_store(d).save(d, "n0", 0, arrays, attempt=1)

    def presigned_load(d: str) -> object:
        return presigned_store(d).load(d, "n0", 0)

    return {"s3fs with credentials": (s3fs_save, s3fs_load), "presigned URLs": (presigned_save, presigned_load)}


def interleave(chosen: dict[str, Method], size: int, reps: int, endpoint: str) -> list[dict]:
    times: dict[str, dict[str, list[float]]] = {name: {"save": [], "load": []} for name in chosen}
    names = list(chosen)
    cleanup = open_storage("s3://bench", {"endpoint_url": endpoint, "key": "testing", "secret": "testing"})
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            save, load = chosen[name]
            directory = f"d{uuid.uuid4().hex[:8]}"
            started = time.perf_counter()
            save(directory)
            times[name]["save"].append(time.perf_counter() - started)
            started = time.perf_counter()
            loaded = load(directory)
            times[name]["load"].append(time.perf_counter() - started)
            del loaded
            cleanup.remove_prefix(directory)
    rows = []
    for name in names:
        row: dict = {"method": name}
        for op in ("save", "load"):
            median = statistics.median(times[name][op])
            row[op] = {"median_s": median, "runs_s": times[name][op], "MBps": size / median / 1e6}
        rows.append(row)
    base = rows[0]
    for row in rows:
        for op in ("save", "load"):
            row[op]["ratio_to_s3fs"] = row[op]["MBps"] / base[op]["MBps"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    arrays = model_like(args.mib << 20)
    moto, endpoint = start_moto()
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    httpx.put(f"{endpoint}/bench")  # the bucket
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        service = start_service_process(
            tmp,
            port,
            storage_roots="s3://bench",
            storage_options=json.dumps({"s3://bench": options}),
        )
        try:
            rows = interleave(
                methods(arrays, endpoint, f"http://127.0.0.1:{port}"), nbytes(arrays), args.reps, endpoint
            )
        finally:
            service.kill()
            moto.kill()
    report({"bytes": nbytes(arrays), "reps": args.reps, "cpus": os.cpu_count(), "results": rows}, args.out)


if __name__ == "__main__":
    main()
