"""Scale-out measurements: group commit, a 4,096-node job, the cached last-good answer over
PostgreSQL (2 workers, and 3 replicas behind nginx), the dashboard of a large job, and a Keras fit
while the service is down.

    python bench/scale.py [--db sqlite postgres] [--duration 10] [--previous REF] [--workers 1]
                          [--phases commits big_job last_good dashboard outage] [--out FILE]

- commits: wrk, 64 connections, commits of new positions (`POST …/checkpoints/batch`, one commit
  each: the Python client's route) over 1,000 jobs × 8 nodes (closed
  loop, --duration): requests/s and p99, this tree vs `git archive REF` (the previous release) on
  databases of the same size, in the same run, each with --workers service processes.
- big_job: a 4,096-node job; every node registers an attempt, then every node commits epoch 0 at
  once (one request each on the batch route the Python client uses, 64 connections, a raw HTTP/1.1
  client so the client costs little CPU);
  seconds for each, and how long after the last commit's answer the last good epoch is 0.
- last_good: wrk GET last-good-epoch over 1,000 cached jobs vs GET /healthz (the trivial endpoint)
  through the same stack: 2 workers on PostgreSQL, and 3 replicas (1 worker each) behind nginx.
- dashboard: GET /ui/jobs/<job> for 4,096 nodes × 100 positions (filled with SQL), median of 5.
- outage: the tiny Keras job of tests/train_job.py saving every 5 batches for 8 epochs (in
  subprocesses): median epoch time with the service up vs its URL refusing connections.
Needs wrk and nginx (Debian packages) and, for postgres, the machine's PostgreSQL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.service import (  # noqa: E402
    extract,
    populate,
    replicas,
    run_wrk,
    run_wrk_plain,
    running_service,
    scratch_database,
    warm_up,
)
from tests.servers import free_port  # noqa: E402

BIG_NODES = 4096


class Results:
    """A bench run's results with its command and machine, each kept as it comes — printed, and written
    to `out` — so that a long run that fails late keeps what it measured."""

    def __init__(self, script: str, out: str | None):
        self.out = out
        self.values: dict = {
            "command": " ".join(["python", script, *sys.argv[1:]]),
            "machine": f"{platform.platform()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        }

    def record(self, key: str, value: object) -> None:
        self.values[key] = value
        print(key, json.dumps(value), flush=True)
        if self.out:
            with open(self.out, "w") as handle:
                json.dump(self.values, handle, indent=1)


def commits(kind: str, code: str | None, duration: int, workers: int) -> dict:
    with scratch_database(kind, "ckptstore-scale-", code) as (url, tmp):
        populate(url, 1000, 8, 10, f"{tmp}/storage")
        with running_service(url, workers, f"{tmp}/storage", code) as (port, _):
            return run_wrk(port, "commit", duration, 1000, 8, f"{tmp}/storage", salt=3, connections=64)


async def send_all(port: int, requests: list[bytes], connections: int = 64) -> tuple[float, list[int]]:
    """Send every request (raw HTTP/1.1, keep-alive) over `connections` connections: seconds, statuses
    (of a batch of commits, its commits' statuses)."""
    pending = list(reversed(requests))
    statuses: list[int] = []

    async def connection() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while pending:
            writer.write(pending.pop())
            header = await reader.readuntil(b"\r\n\r\n")
            body = await reader.readexactly(int(re.search(rb"content-length: (\d+)", header, re.I).group(1)))
            if body.startswith(b"["):  # a batch: each commit's own status
                statuses.extend(outcome["status"] for outcome in json.loads(body))
            else:
                statuses.append(int(header[9:12]))
        writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(connection() for _ in range(connections)))
    return time.perf_counter() - started, statuses


def post(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    return head.encode() + data


def commit(root: str, node: str, job: str = "big") -> dict:
    """A commit of epoch 0 by attempt 1 of `node` of `job`."""
    return {"epoch": 0, "attempt": 1, "location": f"{root}/{job}/{node}/0000000000/1", "bytes": 1, "checksums": {}}


def get_json(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
        return json.loads(response.read())


def big_job(kind: str, code: str | None, workers: int) -> dict:
    nodes = [f"w{i:04d}" for i in range(BIG_NODES)]
    with scratch_database(kind, "ckptstore-scale-", code) as (url, tmp):
        root = f"{tmp}/storage"
        with running_service(url, workers, root, code) as (port, _):
            declare = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/jobs/big",
                data=json.dumps({"nodes": nodes, "storage_root": root}).encode(),
                method="PUT",
                headers={"content-type": "application/json"},
            )
            urllib.request.urlopen(declare, timeout=60).read()
            attempts = [post(f"/v1/jobs/big/nodes/{n}/attempts", {}) for n in nodes]
            register_s, registered = asyncio.run(send_all(port, attempts))
            bodies = [  # one request each, on the route the Python client commits through
                post(
                    "/v1/jobs/big/checkpoints/batch",
                    {"commits": [{"node": n, **commit(root, n)}]},
                )
                for n in nodes
            ]
            commit_s, committed = asyncio.run(send_all(port, bodies))
            last_commit = time.perf_counter()
            result = {
                "register_4096_s": register_s,
                "register_statuses": dict(Counter(registered)),
                "commit_4096_s": commit_s,
                "commit_statuses": dict(Counter(committed)),
                "commits_per_s": BIG_NODES / commit_s,
            }
            if set(committed) == {201}:  # else the position cannot become good
                while get_json(port, "/v1/jobs/big/last-good-epoch").get("epoch") != 0:
                    time.sleep(0.01)
                result["last_good_after_last_commit_s"] = time.perf_counter() - last_commit
            return result


def cached_vs_trivial(port: int, duration: int) -> dict:
    trivial = run_wrk_plain(port, duration)
    last_good = run_wrk(port, "last_good", duration, 1000, 8, "unused", salt=0)
    return {
        "trivial_rps": trivial["rps"],
        "last_good_rps": last_good["rps"],
        "ratio": last_good["rps"] / trivial["rps"],
    }


def last_good(duration: int) -> dict:
    with scratch_database("postgres", "ckptstore-scale-") as (url, tmp):
        root = f"{tmp}/storage"
        populate(url, 1000, 8, 20, root)
        results = {}
        with running_service(url, 2, root) as (port, _):
            asyncio.run(warm_up(port, 1000))
            results["postgres_2_workers"] = cached_vs_trivial(port, duration)
        with replicas(url, 3, root, tmp) as port:
            asyncio.run(warm_up(port, 1000))
            results["postgres_3_replicas_nginx"] = cached_vs_trivial(port, duration)
        return results


def dashboard(kind: str) -> dict:
    with scratch_database(kind, "ckptstore-scale-") as (url, tmp):
        populate(url, 1, BIG_NODES, 100, f"{tmp}/storage")
        with running_service(url, 1, f"{tmp}/storage") as (port, _):
            times = []
            for _ in range(5):
                started = time.perf_counter()
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ui/jobs/job-00000", timeout=120) as page:
                    html = page.read()
                times.append(time.perf_counter() - started)
            assert b'class="aggregate"' in html
            return {"median_s": statistics.median(times), "max_s": max(times), "page_kib": len(html) / 1024}


FIT = """
import json, sys, time, keras
from ckptstore.client.keras import BackupAndRestore
from tests.train_job import BATCH, data, make_model
epochs = []
class Clock(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None): self.t = time.perf_counter()
    def on_epoch_end(self, epoch, logs=None): epochs.append(time.perf_counter() - self.t)
callback = BackupAndRestore(storage=sys.argv[1], service=sys.argv[2], job="fit", node="n0", save_freq=5)
x, y = data()
x, y = x.repeat(20, axis=0), y.repeat(20, axis=0)
make_model().fit(x, y, batch_size=BATCH, epochs=8, shuffle=False, verbose=0, callbacks=[callback, Clock()])
print("EPOCHS" + json.dumps(epochs))
"""


def fit_epochs(storage: str, service: str) -> list[float]:
    result = subprocess.run(
        [sys.executable, "-c", FIT, storage, service],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        env=os.environ | {"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""},
    )
    match = re.search(r"EPOCHS(\[.*\])", result.stdout)
    if not match:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(match.group(1))[1:]  # the first epoch includes tracing


def outage() -> dict:
    with scratch_database("sqlite", "ckptstore-scale-") as (url, tmp):
        runs: dict[str, list[float]] = {"up": [], "down": []}
        for rep in range(2):
            with running_service(url, 1, f"{tmp}/storage") as (port, _):
                runs["up"] += fit_epochs(f"{tmp}/storage/up{rep}", f"http://127.0.0.1:{port}")
            runs["down"] += fit_epochs(f"{tmp}/storage/down{rep}", f"http://127.0.0.1:{free_port()}")
        up, down = statistics.median(runs["up"]), statistics.median(runs["down"])
        return {"epoch_s_service_up": up, "epoch_s_service_down": down, "down_vs_up": down / up}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", nargs="+", default=["sqlite", "postgres"], choices=["sqlite", "postgres"])
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--workers", type=int, default=1, help="service worker processes for commits and big_job")
    parser.add_argument("--previous", default=None, help="also measure this commit (the previous release)")
    parser.add_argument("--phases", nargs="+", default=["commits", "big_job", "last_good", "dashboard", "outage"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    previous = extract(args.previous) if args.previous else None
    results = Results("bench/scale.py", args.out)
    record = results.record
    trees = {"new": None} | ({"previous": previous} if previous else {})

    for kind in args.db:
        for name, code in trees.items():
            if "commits" in args.phases:
                record(f"commits/{kind}/{name}", commits(kind, code, args.duration, args.workers))
            if "big_job" in args.phases:
                record(f"big_job/{kind}/{name}", big_job(kind, code, args.workers))
        if previous and "commits" in args.phases:
            new, old = results.values[f"commits/{kind}/new"], results.values[f"commits/{kind}/previous"]
            record(f"commits/{kind}/ratio", new["rps"] / old["rps"])
        if "dashboard" in args.phases:
            record(f"dashboard/{kind}", dashboard(kind))
    if "last_good" in args.phases:
        record("last_good", last_good(args.duration))
    if "outage" in args.phases:
        record("outage", outage())


if __name__ == "__main__":
    main()
