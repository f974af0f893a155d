"""Mixed load held for a while: errors, latency and the service's memory over time.

    python bench/soak.py [--rate 600] [--duration 60] [--jobs 1000] [--db sqlite|postgres]

Starts `python -m ckptstore.server` on loopback over a database filled by SQL (bench/service.py's
`populate`), then sends an open-loop mix at --rate requests/s for --duration seconds — 80 %
last-good queries, 15 % commits of new epochs, 5 % health reports — over 16 keep-alive
connections, latency counted from each request's scheduled start. Samples the service's RSS every
second and reports its growth from the end of the warm-up (the first 10 s) to the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.service import populate, running_service, scratch_database

NODES, EPOCHS, WARM_UP_S = 8, 20, 10


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as handle:
        return int(re.search(r"VmRSS:\s+(\d+)", handle.read()).group(1)) / 1024


def request_for(kind: str, jobs: int, root: str, counters: dict) -> bytes:
    job = f"job-{random.randrange(jobs):05d}"
    node = f"n{random.randrange(NODES)}"
    if kind == "last_good":
        return f"GET /v1/jobs/{job}/last-good-epoch HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
    if kind == "commit":
        epoch = counters[(job, node)] = counters.get((job, node), EPOCHS - 1) + 1
        location = f"{root}/{job}/{node}/{epoch:010d}/1"
        # The route the Python client commits through: a batch (of one commit).
        body = json.dumps({"commits": [{"node": node, "epoch": epoch, "attempt": 1, "location": location, "bytes": 1}]})
        path = f"/v1/jobs/{job}/checkpoints/batch"
        method = "POST"
    else:
        body = json.dumps({"cp_accessible": True, "latency_ms": 1.0})
        path = f"/v1/jobs/{job}/nodes/{node}/health"
        method = "PUT"
    return (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    ).encode()


async def soak(port: int, pid: int, rate: int, duration: float, jobs: int, root: str) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    latencies: dict[str, list[float]] = {"last_good": [], "commit": [], "health": []}
    errors: dict[str, int] = {}
    counters: dict = {}
    rss: list[tuple[float, float]] = []

    async def connection() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while (item := await queue.get()) is not None:
            scheduled, kind = item
            writer.write(request_for(kind, jobs, root, counters))
            header = await reader.readuntil(b"\r\n\r\n")
            body = await reader.readexactly(int(re.search(rb"content-length: (\d+)", header, re.IGNORECASE).group(1)))
            status = header[9:12].decode()
            if status == "200" and body.startswith(b"["):  # a batch: its commit's own status
                status = str(json.loads(body)[0]["status"])
            if not status.startswith("2"):
                errors[f"{kind} {status}"] = errors.get(f"{kind} {status}", 0) + 1
            latencies[kind].append(time.perf_counter() - scheduled)
        writer.close()

    async def sample() -> None:
        while True:
            rss.append((time.perf_counter() - start, rss_mib(pid)))
            await asyncio.sleep(1)

    workers = [asyncio.create_task(connection()) for _ in range(16)]
    start = time.perf_counter()
    sampler = asyncio.create_task(sample())
    for i in range(int(rate * duration)):
        scheduled = start + i / rate
        if (delay := scheduled - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        draw = random.random()
        queue.put_nowait((scheduled, "last_good" if draw < 0.80 else "commit" if draw < 0.95 else "health"))
    for _ in workers:
        queue.put_nowait(None)
    await asyncio.gather(*workers)
    sampler.cancel()
    elapsed = time.perf_counter() - start
    after_warm_up = next(r for t, r in rss if t >= WARM_UP_S)
    result = {"requests": sum(len(v) for v in latencies.values()), "achieved_rps": 0.0, "errors": errors}
    result["achieved_rps"] = result["requests"] / elapsed
    for kind, values in latencies.items():
        values.sort()
        result[kind] = {
            "requests": len(values),
            "p50_ms": statistics.median(values) * 1000,
            "p99_ms": values[int(len(values) * 0.99)] * 1000,
        }
    result["rss_mib"] = {"start": rss[0][1], "after_warm_up": after_warm_up, "end": rss[-1][1]}
    result["rss_growth_after_warm_up"] = rss[-1][1] / after_warm_up - 1
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=600)
    parser.add_argument("--duration", type=float, default=60)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--db", default="sqlite", choices=["sqlite", "postgres"])
    args = parser.parse_args()
    with scratch_database(args.db, "ckptstore-soak-") as (url, tmp):
        root = f"{tmp}/storage"
        populate(url, args.jobs, NODES, EPOCHS, root)
        with running_service(url, 1, root) as (port, process):
            result = asyncio.run(soak(port, process.pid, args.rate, args.duration, args.jobs, root))
    result |= {
        "command": " ".join(["python"] + sys.argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "db": args.db,
        "rate": args.rate,
        "duration_s": args.duration,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
