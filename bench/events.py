"""What event subscribers cost the service, and how fast an event reaches them.

    python bench/events.py [--db sqlite postgres] [--subscribers 200] [--duration 10] [--reps 3]
                           [--subscriber-encoding gzip|plain] [--nice-subscribers] [--out FILE]

For each database: `python -m ckptstore.server` (1 worker) on a database filled with 1,000 jobs × 8 nodes ×
10 epochs; wrk measures commit throughput (64 connections, POST commits of new positions) and the
cached last-good throughput (32 connections, after asking every job once) with no subscriber, then
again with --subscribers SSE streams attached (held by a separate process, reading every byte and
counting every event; by default they accept gzip, as browsers, httpx and `ckptstore watch` do, and
the process inflates each distinct segment once for all its streams: real subscribers run on other
machines, these share the service's cores), --reps times interleaved;
the ratios compare the medians of the two sides in the same run. Then one subscriber of one job and a
writer committing one position at a time measure commit-to-event latency: from sending the commit
to the `checkpoint.committed` event arriving on the stream (p50, p99 over 300 commits). Needs wrk (Debian: apt-get install wrk).
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.service import populate, run_wrk, running_service, scratch_database, warm_up  # noqa: E402
from ckptstore.server.events.stream import GZIP_HEADER  # noqa: E402

SUBSCRIBERS = r"""
import asyncio, sys, zlib
port, count, gzip = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "gzip"
gzip_header_size = int(sys.argv[4])  # the service's GZIP_HEADER, first in a gzip stream's body
received = 0
counts = {}
def events_in(segment):
    # Every gzip chunk is a deflate segment of whole frames that refers to nothing before it
    # (server/events/stream.py), and the streams all carry the same ones: each distinct segment is inflated
    # once for all of them. Inflating each stream's copy took this process 0.17 s of CPU per second
    # on the 2 cores it shares with the service, wrk and the database, at the very moments the
    # service fans a wake-up out (bench/RESULTS.md, events, eighth round).
    found = counts.get(segment)
    if found is None:
        found = counts[segment] = zlib.decompressobj(-zlib.MAX_WBITS).decompress(segment).count(b"\ndata: ")
        if len(counts) > 10_000:
            counts.clear()
    return found
async def subscriber(i):
    # Reads what arrives in chunks and counts its data lines: reading line by line took 0.25-0.3 s of
    # CPU per second from the 2 cores the service and wrk share (chunks: 0.05 s). A gzip stream's
    # body is taken out of its chunked framing, its gzip header skipped, its segments counted.
    global received
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    accept = b"Accept-Encoding: gzip\r\n" if gzip else b""
    writer.write(b"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\n" + accept + b"\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    gzipped = b"content-encoding: gzip" in head.lower()
    body, tail, header = b"", b"", gzip_header_size if gzipped else 0
    while True:
        chunk = await reader.read(1 << 16)
        if not chunk:
            return
        if not gzipped:
            received += (tail + chunk).count(b"\ndata: ")
            tail = chunk[-6:]
            continue
        body += chunk
        while (end := body.find(b"\r\n")) >= 0 and len(body) >= end + 2 + int(body[:end], 16) + 2:
            size = int(body[:end], 16)
            segment = body[end + 2 + header : end + 2 + size]
            body, header = body[end + 4 + size :], 0
            received += events_in(segment)
async def main():
    tasks = [asyncio.create_task(subscriber(i)) for i in range(count)]
    await asyncio.sleep(0.5)
    print("READY", flush=True)
    while True:
        await asyncio.sleep(1)
        print("RECEIVED", received, flush=True)
asyncio.run(main())
"""


def throughput(port: int, root: str, duration: int, salt: int) -> dict:
    commits = run_wrk(port, "commit", duration, 1000, 8, root, salt=salt, connections=64)
    asyncio.run(warm_up(port, 1000, connections=2))  # the commits changed every job: cache the answers again
    last_good = run_wrk(port, "last_good", duration, 1000, 8, root, salt=salt + 1)
    return {
        "commit_rps": commits["rps"],
        "commit_p99_ms": commits["p99_ms"],
        "last_good_rps": last_good["rps"],
        "errors": commits["errors"] + last_good["errors"] + commits["status_errors"] + last_good["status_errors"],
    }


async def commit_to_event(port: int, root: str, commits: int = 300) -> dict:
    """One stream of one job; commit positions one at a time; time until each commit's event arrives."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /v1/events?job=job-00007&types=checkpoint.committed HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    await reader.readuntil(b"\r\n\r\n")
    post_reader, post_writer = await asyncio.open_connection("127.0.0.1", port)
    latencies = []
    for i in range(commits):
        epoch = 5_000_000 + i
        commit = {
            "node": "n0",
            "epoch": epoch,
            "attempt": 1,
            "location": f"{root}/job-00007/n0/{epoch:010d}/1",
            "bytes": 1,
            "checksums": {},
        }
        body = json.dumps({"commits": [commit]}).encode()  # the route the Python client commits through
        started = time.perf_counter()
        post_writer.write(
            b"POST /v1/jobs/job-00007/checkpoints/batch HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        header = await post_reader.readuntil(b"\r\n\r\n")
        await post_reader.readexactly(int(re.search(rb"content-length: (\d+)", header, re.I).group(1)))
        while True:
            line = await reader.readline()
            if line.startswith(b"data:") and f'"epoch":{epoch}'.encode() in line:
                break
        latencies.append(time.perf_counter() - started)
    writer.close()
    post_writer.close()
    latencies.sort()
    return {
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000,
        "commits": commits,
    }


def measure(kind: str, subscribers: int, duration: int, nice: int, reps: int, encoding: str) -> dict:
    with scratch_database(kind, "ckptstore-events-") as (url, tmp):
        root = f"{tmp}/storage"
        populate(url, 1000, 8, 10, root)
        with running_service(url, 1, root) as (port, _):
            asyncio.run(warm_up(port, 1000))
            alone, watched, received = [], [], 0
            # Interleaved and in alternating order (the database grows with every run), so that drift
            # hits both sides alike.
            for rep in range(reps):
                for side in ("alone", "watched") if rep % 2 == 0 else ("watched", "alone"):
                    salt = 4 * rep + (2 if side == "watched" else 0)
                    if side == "alone":
                        alone.append(throughput(port, root, duration, salt))
                        continue
                    crowd = subprocess.Popen(
                        [
                            sys.executable,
                            "-c",
                            SUBSCRIBERS,
                            str(port),
                            str(subscribers),
                            encoding,
                            str(len(GZIP_HEADER)),
                        ],
                        stdout=subprocess.PIPE,
                        text=True,
                        preexec_fn=(lambda: os.nice(nice)) if nice else None,
                    )
                    try:
                        assert crowd.stdout is not None and crowd.stdout.readline().startswith("READY")
                        watched.append(throughput(port, root, duration, salt))
                    finally:
                        crowd.terminate()
                        remaining, _ = crowd.communicate()
                    counts = [int(line.split()[1]) for line in remaining.splitlines() if line.startswith("RECEIVED")]
                    received += counts[-1] if counts else 0  # the subscribers' running total, as last printed
            latency = asyncio.run(commit_to_event(port, root))
        medians = {
            side: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            for side, runs in (("alone", alone), ("watched", watched))
        }
        return {
            "without_subscribers": alone,
            f"with_{subscribers}_subscribers": watched,
            "events_received_by_subscribers": received,
            "commit_ratio": medians["watched"]["commit_rps"] / medians["alone"]["commit_rps"],
            "last_good_ratio": medians["watched"]["last_good_rps"] / medians["alone"]["last_good_rps"],
            "commit_to_event": latency,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", nargs="+", default=["sqlite", "postgres"], choices=["sqlite", "postgres"])
    parser.add_argument("--subscribers", type=int, default=200)
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3, help="interleaved runs without and with subscribers (medians)")
    parser.add_argument(
        "--nice-subscribers",
        action="store_true",
        help="run the subscribers' process at the lowest CPU priority: on this 2-core machine it otherwise "
        "competes with the service for CPU, which subscribers on other machines do not",
    )
    parser.add_argument(
        "--subscriber-encoding",
        choices=["gzip", "plain"],
        default="gzip",
        help="gzip: the subscribers accept gzip, as browsers, httpx and `ckptstore watch` do; plain: they do not",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results: dict = {
        "command": " ".join(["python", "bench/events.py", *sys.argv[1:]]),
        "machine": f"{platform.platform()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "subscriber_encoding": args.subscriber_encoding,
    }
    for kind in args.db:
        nice = 19 if args.nice_subscribers else 0
        results[kind] = measure(kind, args.subscribers, args.duration, nice, args.reps, args.subscriber_encoding)
        print(kind, json.dumps(results[kind]), flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
