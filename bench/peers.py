"""Peer replicas (issue 49): a restore from a peer against the durable tier and a raw HTTP transfer, and
what keeping peer replicas costs training — medians of interleaved runs, as ratios.

    python bench/peers.py [--gib 1] [--reps 3] [--saves 6] [--skip restore|training] [--out FILE]

- restore: a GIB checkpoint held for node n0 on another node's disk (`<local root>/.peers`), served by
  that node's blob server in a process of its own. Each read in a fresh process, as at a restart (its
  memory is new: what filling it costs counts for every variant but curl). Read whole and verified through the peer tier
  (`peer_store(...).read_copy`, what a start on a new machine does), against a raw HTTP transfer of
  the same blob files from the same server into new memory (http.client `readinto`, the same number
  of streams, nothing checked; curl to /dev/null beside it, which fills no memory), and against the
  durable tier on moto's S3 server (`Store("s3://…").read_copy`). Goal: peer ≥ 0.8× the raw transfer.
- training: two processes (nodes n0, n1 of one job, a ring: each keeps the other's copies) train a
  torch module of GIB/2 each — a step that changes every parameter and computes for a second — and
  save at every step's end (async, a local tier, the durable tier on local disk, the service on
  SQLite), with peer_replicas=1 against 0, runs interleaved. Reported per node: the time
  `save()` blocks, the step time (what a peer's pulls running beside training cost it), and the
  process's peak RSS above its level after the first save (what pulling costs in memory).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from bench.save_restore import PeakRss, model_like, report, start_moto  # noqa: E402
from bench.service import running_service  # noqa: E402
from ckptstore import Position, Store  # noqa: E402
from ckptstore.store import DEFAULT_CONCURRENCY  # noqa: E402
from ckptstore.threads import map_threads  # noqa: E402

S3 = {"key": "testing", "secret": "testing"}
SERVE = (
    "import sys, threading\n"
    "from ckptstore.client.peers.blob_server import BlobServer\n"
    "server = BlobServer(sys.argv[1], 'job', host='127.0.0.1')\n"
    "print(server.url, server.token, flush=True)\n"
    "threading.Event().wait()\n"
)


def serving(root: str) -> tuple[subprocess.Popen, str, str]:
    """A blob server over the local tier `root`, in a process of its own: (process, url, token)."""
    process = subprocess.Popen([sys.executable, "-c", SERVE, root], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert process.stdout is not None
    url, token = process.stdout.readline().split()
    return process, url, token


def raw_get(url: str, token: str, path: str) -> np.ndarray:
    """One file over HTTP into a new buffer, nothing checked: the fastest way Python moves it."""
    connection = http.client.HTTPConnection(url.removeprefix("http://"))
    connection.request("GET", path, headers={"Authorization": f"Bearer {token}"})
    response = connection.getresponse()
    body = np.empty(int(response.getheader("content-length")), dtype=np.uint8)
    view, done = body.data, 0
    while done < body.size:
        done += response.readinto(view[done:])
    connection.close()
    return body


def restore_run(args: argparse.Namespace) -> None:
    """One timed read of the restore measurement, in a process of its own (as at a restart): prints seconds."""
    from ckptstore import CopyKey
    from ckptstore.client.peers.blob_server import HELD
    from ckptstore.client.peers.filesystem import peer_store

    key = CopyKey("job", "n0", Position(3), "1", "peer")
    started = time.perf_counter()
    if args.restore_run == "raw":
        paths = json.loads(args.paths)
        kept = map_threads(lambda path: raw_get(args.url, args.token, path), paths, DEFAULT_CONCURRENCY)
    elif args.restore_run == "peer":
        kept = peer_store(args.url, args.token, HELD).read_copy(key).arrays
    else:
        durable = Store(args.url, storage_options={"endpoint_url": args.token, **S3})
        kept = durable.read_copy(key.on("durable")).arrays
    print(time.perf_counter() - started, len(kept), flush=True)


def restore(gib: float, reps: int) -> dict:
    from ckptstore.client.peers.blob_server import HELD, HELD_DIR

    work = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR"))
    owner = Store(os.path.join(work, "owner"), tier="local")
    arrays = model_like(int(gib * 2**30))
    ref = owner.write(owner.key("job", "n0", Position(3), 1).on("local"), arrays, step=30)
    del arrays
    held = Store(os.path.join(work, "holder", HELD_DIR), tier="peer")
    held.copy_from(owner, ref.key, verify="sizes")
    moto, endpoint = start_moto()
    durable = Store("s3://bench/peers", storage_options={"endpoint_url": endpoint, **S3})
    durable._storage.fs.mkdir("bench")
    durable.copy_from(owner, ref.key, verify="sizes")
    server, url, token = serving(os.path.join(work, "holder"))
    paths = json.dumps([f"/{HELD}/{shard.file}" for shard in ref.manifest.shards])
    me = [sys.executable, os.path.abspath(__file__), "--restore-run"]

    def timed(*command: str) -> float:
        return float(subprocess.run(command, check=True, capture_output=True, text=True).stdout.split()[0])

    def curl() -> float:
        command = ["curl", "-s", "-H", f"Authorization: Bearer {token}"]
        for path in json.loads(paths):
            command += [url + path, "-o", "/dev/null"]
        started = time.perf_counter()
        subprocess.run(command, check=True)
        return time.perf_counter() - started

    variants = {
        "raw HTTP transfer into new memory": lambda: timed(
            *me, "raw", "--url", url, "--token", token, "--paths", paths
        ),
        "curl to /dev/null (no memory filled)": curl,
        "peer restore (verified)": lambda: timed(*me, "peer", "--url", url, "--token", token),
        "durable restore, S3 on moto (verified)": lambda: timed(
            *me, "durable", "--url", durable.url, "--token", endpoint
        ),
    }
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    try:
        order = random.Random(0)
        for _ in range(reps):  # in a new random order each round: no variant always follows the same one
            for name in order.sample(list(variants), len(variants)):
                seconds[name].append(variants[name]())
    finally:
        server.kill()
        moto.kill()
        shutil.rmtree(work, ignore_errors=True)
    size = ref.bytes
    rows = {
        name: {"median_s": statistics.median(v), "GB_per_s": size / statistics.median(v) / 1e9, "all_s": v}
        for name, v in seconds.items()
    }
    raw_s = rows["raw HTTP transfer into new memory"]["median_s"]
    rows["peer_to_raw_throughput"] = raw_s / rows["peer restore (verified)"]["median_s"]
    rows["peer_speedup_over_durable"] = (
        rows["durable restore, S3 on moto (verified)"]["median_s"] / rows["peer restore (verified)"]["median_s"]
    )
    return {"bytes": size, "shards": len(ref.manifest.shards), "streams": DEFAULT_CONCURRENCY, **rows}


def node_run(args: argparse.Namespace) -> None:
    """One node of the training measurement (run as a subprocess): prints its numbers as JSON."""
    import torch

    from ckptstore.client.torch import CheckpointManager

    torch.manual_seed(0)
    torch.set_num_threads(1)
    module = torch.nn.ParameterList(torch.nn.Parameter(torch.rand(int(args.gib * 2**30 / 4 / 4))) for _ in range(4))
    manager = CheckpointManager(
        objects={"model": module},
        job=args.job,
        node=args.node,
        nodes=["n0", "n1"],
        storage=os.path.join(args.work, "durable"),
        local_storage=os.path.join(args.work, "local"),
        service=args.service,
        peer_replicas=args.peer_replicas,
        max_to_keep=2,
    )
    manager.restore_or_initialize()
    compute = torch.rand(512, 512)
    blocked, steps, extra = [], [], 0
    with PeakRss() as rss:
        for step in range(args.saves):
            started = time.perf_counter()
            with torch.no_grad():
                for parameter in module:
                    parameter.add_(1.0)
            deadline = time.perf_counter() + 1.0
            while time.perf_counter() < deadline:
                compute = torch.tanh(compute @ compute)
            steps.append(time.perf_counter() - started)
            started = time.perf_counter()
            manager.save(step)
            blocked.append(time.perf_counter() - started)
            if step == 0:
                manager.wait()
                rss.start = rss.peak = rss._rss()  # from here on: what later saves and pulls add
        manager.wait()
    extra = rss.extra
    manager.close()
    print(json.dumps({"blocked_s": blocked[1:], "step_s": steps[1:], "extra_rss_MiB": extra / 2**20}), flush=True)


def training(gib: float, saves: int, reps: int) -> dict:
    results: dict[str, dict[str, list[float]]] = {}
    for rep in range(reps):
        for peers in (0, 1)[:: 1 if rep % 2 == 0 else -1]:
            work = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR"))
            with running_service(f"sqlite:///{work}/service.db", 1, os.path.join(work, "durable")) as (port, _):
                job = f"peers{rep}-{peers}"
                command = [sys.executable, os.path.abspath(__file__), "--node-run", "--job", job, "--work", work]
                command += ["--service", f"http://127.0.0.1:{port}", "--gib", str(gib / 2), "--saves", str(saves)]
                command += ["--peer-replicas", str(peers)]
                nodes = [
                    subprocess.Popen([*command, "--node", node], stdout=subprocess.PIPE, text=True, cwd=ROOT)
                    for node in ("n0", "n1")
                ]
                outputs = [json.loads(node.communicate(timeout=1800)[0].strip().splitlines()[-1]) for node in nodes]
            shutil.rmtree(work, ignore_errors=True)
            row = results.setdefault(f"peer_replicas={peers}", {"blocked_s": [], "step_s": [], "extra_rss_MiB": []})
            for output in outputs:
                row["blocked_s"] += output["blocked_s"]
                row["step_s"] += output["step_s"]
                row["extra_rss_MiB"].append(output["extra_rss_MiB"])
    summary: dict = {"state_GiB_per_node": gib / 2, "saves_per_run": saves}
    for name, row in results.items():
        summary[name] = {
            "blocked_per_save_median_s": statistics.median(row["blocked_s"]),
            "step_median_s": statistics.median(row["step_s"]),
            "extra_rss_median_MiB": statistics.median(row["extra_rss_MiB"]),
            "extra_rss_max_MiB": max(row["extra_rss_MiB"]),
        }
    on, off = summary["peer_replicas=1"], summary["peer_replicas=0"]
    summary["step_ratio_peers_to_none"] = on["step_median_s"] / off["step_median_s"]
    summary["blocked_ratio_peers_to_none"] = on["blocked_per_save_median_s"] / off["blocked_per_save_median_s"]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--saves", type=int, default=6)
    parser.add_argument("--skip", action="append", default=[])
    parser.add_argument("--out", default=None)
    parser.add_argument("--node-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--restore-run", choices=["raw", "peer", "durable"], help=argparse.SUPPRESS)
    for name in ("--job", "--work", "--service", "--node", "--url", "--token", "--paths"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    parser.add_argument("--peer-replicas", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.node_run:
        node_run(args)
        return
    if args.restore_run:
        restore_run(args)
        return
    results: dict = {"command": " ".join(["python bench/peers.py", *sys.argv[1:]])}
    if "restore" not in args.skip:
        results["restore"] = restore(args.gib, args.reps)
    if "training" not in args.skip:
        results["training"] = training(args.gib, args.saves, args.reps)
    report(results, args.out)


if __name__ == "__main__":
    main()
