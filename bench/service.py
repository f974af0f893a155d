"""Service load test on loopback: last-good queries, commits and a mixed load, vs a trivial endpoint.

    python bench/service.py [--jobs 10000] [--nodes 8] [--epochs 100] [--db sqlite postgres]
                            [--workers 1 2] [--duration 10] [--previous REF] [--phases ...]

For each database and worker count it starts `python -m ckptstore.server` on 127.0.0.1, fills the database
directly with jobs × nodes × epochs committed records (all positions good), then measures with wrk
(closed loop, 32 connections, bounded by --duration): GET /healthz (the trivial endpoint), GET
last-good-epoch over random jobs, commits of new epochs (`POST …/checkpoints/batch` with one commit
each: the route the Python client commits through), and a mix (80 % last-good, 15 %
commits, 5 % health). A fixed-rate open-loop generator then sends last-good queries at --rate rps
and reports p50/p99 from each request's scheduled start (no coordinated omission). EXPLAIN plans of
the last-good queries are recorded. With `--previous REF` every measurement is repeated, in the
same run and on a database of the same size, against `git archive REF` (the previous release: its
own migrations, its own service) and the ratios are reported. Needs `wrk` (Debian: apt-get install wrk).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sqlalchemy import create_engine, event, text  # noqa: E402

from ckptstore.server.db.migrate import migrate  # noqa: E402
from tests.servers import Nginx, free_port  # noqa: E402

WRK_SCRIPT = r"""
local jobs, nodes, root, mode = %d, %d, "%s", "%s"
local counter = 0
math.randomseed(os.time() + %d)
local function last_good()
  return wrk.format("GET", string.format("/v1/jobs/job-%%05d/last-good-epoch", math.random(0, jobs - 1)))
end
local function commit()
  counter = counter + 1
  local job = string.format("job-%%05d", math.random(0, jobs - 1))
  local epoch = 1000000 + counter * 16 + %d
  local node = string.format("n%%d", math.random(0, nodes - 1))
  -- The route the Python client commits through (ServiceClient.commit_many): a batch, here of one commit.
  local body = string.format(
    '{"commits":[{"node":"%%s","epoch":%%d,"attempt":1,"location":"%%s/%%s/%%s/%%010d/1","bytes":1,"checksums":{}}]}',
    node, epoch, root, job, node, epoch)
  return wrk.format("POST", "/v1/jobs/" .. job .. "/checkpoints/batch",
                    {["Content-Type"] = "application/json"}, body)
end
local function health()
  local job = string.format("job-%%05d", math.random(0, jobs - 1))
  return wrk.format("PUT", "/v1/jobs/" .. job .. "/nodes/n0/health", {["Content-Type"] = "application/json"},
                    '{"cp_accessible":true,"latency_ms":1.5}')
end
request = function()
  if mode == "last_good" then return last_good() end
  if mode == "commit" then return commit() end
  local r = math.random()
  if r < 0.80 then return last_good() elseif r < 0.95 then return commit() else return health() end
end
done = function(summary, latency, requests)
  io.write(string.format("JSON{\"requests\":%%d,\"errors\":%%d,\"status_errors\":%%d,\"p50_ms\":%%.3f,\"p99_ms\":%%.3f}\n",
    summary.requests, summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    summary.errors.status, latency:percentile(50) / 1000, latency:percentile(99) / 1000))
end
"""


def populate(url: str, jobs: int, nodes: int, epochs: int, root: str) -> float:
    """Insert jobs × nodes × epochs committed records and their good positions directly (fast SQL)."""
    started = time.perf_counter()
    engine = create_engine(url)
    node_list = json.dumps([f"n{i}" for i in range(nodes)])
    end = 10**10
    with engine.begin() as c:
        sqlite = c.dialect.name == "sqlite"
        series = (
            "WITH RECURSIVE s(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM s WHERE i + 1 < {n}) SELECT i FROM s"
            if sqlite
            else "SELECT generate_series(0, {n} - 1) AS i"
        )
        pad = "printf('%05d', j.i)" if sqlite else "lpad(j.i::text, 5, '0')"
        pad_epoch = "printf('%010d', e.i)" if sqlite else "lpad(e.i::text, 10, '0')"
        c.execute(
            text(f"""INSERT INTO jobs (id, name, storage_root, retention, nodes_version, version, last_good_epoch,
            resume_epoch, resume_batch_key, created_at, updated_at)
            SELECT j.i + 1, 'job-' || {pad}, :root, '{{}}', 1, 1, :last, :last, :end, 0, 0
            FROM ({series.format(n=jobs)}) j"""),
            {"root": root, "last": epochs - 1, "end": end},
        )
        c.execute(
            text("INSERT INTO node_sets (job_id, version, nodes) SELECT id, 1, :nodes FROM jobs"), {"nodes": node_list}
        )
        c.execute(
            text(f"""INSERT INTO positions (job_id, epoch, batch_key, nodes_version, good)
            SELECT j.id, e.i, :end, 1, :good FROM jobs j CROSS JOIN ({series.format(n=epochs)}) e"""),
            {"end": end, "good": True},
        )
        c.execute(
            text(f"""INSERT INTO checkpoints (job_id, node, epoch, batch_key, attempt, attempt_number, attempt_suffix,
            step, location, bytes, checksums, metrics, state, created_at)
            SELECT j.id, 'n' || n.i, e.i, :end, '1', 1, '', e.i, :root || '/' || j.name || '/n' || n.i || '/' || {pad_epoch} || '/1',
                   1, '{{}}', '{{}}', 'committed', 0
            FROM jobs j CROSS JOIN ({series.format(n=nodes)}) n CROSS JOIN ({series.format(n=epochs)}) e"""),
            {"end": end, "root": root},
        )
        if not sqlite:
            c.execute(text("SELECT setval(pg_get_serial_sequence('jobs', 'id'), (SELECT max(id) FROM jobs))"))
    with engine.connect() as c:
        c.execute(text("ANALYZE"))
        c.commit()
    engine.dispose()
    return time.perf_counter() - started


def explain_last_good(url: str, job: str) -> list[str]:
    """The plan of every statement the last-good answer runs (captured from the real code path)."""
    from ckptstore.server.db.engine import Database, make_engine
    from ckptstore.server.records import rules
    from ckptstore.server.records.last_good import last_good

    database = Database(make_engine(url))
    statements: list[tuple[str, object]] = []

    @event.listens_for(database.engine, "before_cursor_execute")
    def capture(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("SELECT"):
            statements.append((statement, parameters))

    statements.append((database.version_sql, (job,)))  # the cache check, on its own DBAPI connection
    with database.read() as session:
        last_good(session, rules.find_job(session, job))
    event.remove(database.engine, "before_cursor_execute", capture)
    plans = []
    with database.engine.connect() as c:
        sqlite = c.dialect.name == "sqlite"
        for statement, parameters in statements:
            prefix = "EXPLAIN QUERY PLAN " if sqlite else "EXPLAIN "
            rows = c.exec_driver_sql(prefix + statement, parameters).fetchall()
            plan = " | ".join(str(r[-1]) if sqlite else str(r[0]) for r in rows)
            plans.append(f"{' '.join(statement.split())[:160]}  =>  {plan}")
    database.dispose()
    return plans


@contextmanager
def running_service(
    url: str, workers: int, root: str, code: str | None = None
) -> Iterator[tuple[int, subprocess.Popen]]:
    """`python -m ckptstore.server` (from the tree `code`, default this one) on a free loopback port for the
    duration of the block: (port, process)."""
    from tests.servers import free_port

    port = free_port()
    process = start_service(url, port, workers, root, code)
    try:
        yield port, process
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def start_service(url: str, port: int, workers: int, root: str, code: str | None = None) -> subprocess.Popen:
    env = (
        os.environ
        | ({"PYTHONPATH": code} if code else {})
        | {
            "CKPTSTORE_DB_URL": url,
            "CKPTSTORE_PORT": str(port),
            "CKPTSTORE_WORKERS": str(workers),
            "CKPTSTORE_STORAGE": root,
            "CKPTSTORE_LOG_LEVEL": "warning",
        }
    )
    # `-m` puts the working directory first on sys.path: run from the tree whose server is meant.
    process = subprocess.Popen([sys.executable, "-m", "ckptstore.server"], env=env, stdout=subprocess.DEVNULL, cwd=code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1).status == 200:
                return process
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("service did not become ready")


def run_wrk(
    port: int, mode: str, duration: int, jobs: int, nodes: int, root: str, salt: int, connections: int = 32
) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(WRK_SCRIPT % (jobs, nodes, root, mode, salt, salt % 16))
    result = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{duration}s",
            "--timeout",
            "5s",
            "-s",
            script.name,
            f"http://127.0.0.1:{port}/",
        ],
        capture_output=True,
        text=True,
        timeout=duration + 60,
    )
    os.unlink(script.name)
    match = re.search(r"JSON(\{.*\})", result.stdout)
    if not match:
        raise RuntimeError(f"wrk failed: {result.stdout}\n{result.stderr}")
    stats = json.loads(match.group(1))
    stats["rps"] = stats["requests"] / duration
    return stats


async def warm_up(port: int, jobs: int, connections: int = 16) -> float:
    """Ask every job's last-good answer over each of `connections` connections, so that every worker
    process (each with its own cache, each holding some of the connections) has seen every job."""
    started = time.perf_counter()

    async def connection(offset: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for i in range(jobs):
            job = f"job-{(i + offset) % jobs:05d}"
            writer.write(f"GET /v1/jobs/{job}/last-good-epoch HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            header = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(int(re.search(rb"content-length: (\d+)", header, re.I).group(1)))
        writer.close()

    await asyncio.gather(*(connection(k * jobs // connections) for k in range(connections)))
    return time.perf_counter() - started


async def fixed_rate(port: int, rate: int, duration: float, jobs: int, connections: int = 16) -> dict:
    """Open-loop GET last-good at `rate` rps; latency counted from each request's scheduled start."""
    interval = 1.0 / rate
    total = int(rate * duration)
    queue: asyncio.Queue[float] = asyncio.Queue()
    latencies: list[float] = []
    errors = 0

    async def connection() -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while True:
            scheduled = await queue.get()
            if scheduled < 0:
                break
            job = f"job-{random.randrange(jobs):05d}"
            writer.write(f"GET /v1/jobs/{job}/last-good-epoch HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            header = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"content-length: (\d+)", header, re.I).group(1))
            await reader.readexactly(length)
            if not header.startswith(b"HTTP/1.1 200"):
                errors += 1
            latencies.append(time.perf_counter() - scheduled)
        writer.close()

    workers = [asyncio.create_task(connection()) for _ in range(connections)]
    start = time.perf_counter()
    for i in range(total):
        scheduled = start + i * interval
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        queue.put_nowait(scheduled)
    for _ in workers:
        queue.put_nowait(-1.0)
    await asyncio.gather(*workers)
    latencies.sort()
    return {
        "rate": rate,
        "requests": len(latencies),
        "errors": errors,
        "p50_ms": latencies[len(latencies) // 2] * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1000,
    }


@contextmanager
def scratch_database(kind: str, prefix: str, code: str | None = None) -> Iterator[tuple[str, str]]:
    """A fresh database of `kind` with the schema of this tree, or of the tree `code` (the previous
    release: its own migrations), and a scratch folder: (url, folder); both are gone afterwards.
    SQLite lives in the folder; PostgreSQL is a database of this process on the machine's server."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    name = f"ckptstore_bench_{os.getpid()}"
    admin = create_engine("postgresql+psycopg://postgres@127.0.0.1:5432/postgres", isolation_level="AUTOCOMMIT")

    def drop() -> None:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))

    try:
        if kind == "sqlite":
            url = f"sqlite:///{tmp}/bench.db"
        else:
            drop()
            with admin.connect() as connection:
                connection.execute(text(f'CREATE DATABASE "{name}"'))
            url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
        if code is None:
            migrate(url)
        else:
            script = f"import sys; sys.path.insert(0, {code!r}); from ckptstore.server.db.migrate import migrate; migrate({url!r})"
            subprocess.run([sys.executable, "-c", script], check=True, env=os.environ | {"PYTHONPATH": code})
        yield url, tmp
    finally:
        if kind != "sqlite":
            drop()
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def replicas(url: str, count: int, root: str, tmp: str, **nginx: int) -> Iterator[int]:
    """`count` service processes (1 worker each) on `url`; the port to talk to: the process's for
    one, Debian's nginx in front of them for several (`nginx`: its options, tests.servers.Nginx)."""
    with ExitStack() as stack:
        ports = [free_port() for _ in range(count)]
        for port in ports:
            process = start_service(url, port, 1, root)
            stack.callback(process.wait)
            stack.callback(process.terminate)
        if count == 1:
            yield ports[0]
            return
        proxy = Nginx(f"{tmp}/nginx", [f"127.0.0.1:{p}" for p in ports], **nginx)
        stack.callback(proxy.stop)
        yield proxy.port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--db", nargs="+", default=["sqlite", "postgres"], choices=["sqlite", "postgres"])
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--previous", default=None, help="also measure this commit (the previous release)")
    parser.add_argument(
        "--phases",
        nargs="+",
        default=["fixed_rate", "last_good", "commit", "mixed"],
        choices=["fixed_rate", "last_good", "commit", "mixed"],
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is needed: apt-get install wrk")
    trees = {"this tree": None}
    if args.previous:
        trees = {f"previous ({args.previous})": extract(args.previous), "this tree": None}
    results = {
        "command": " ".join(["python"] + sys.argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "records": args.jobs * args.nodes * args.epochs,
        "runs": [],
        "explain": {},
    }
    for kind in args.db:
        for workers in args.workers:
            for tree, code in trees.items():
                run = measure(kind, workers, code, args)
                run["tree"] = tree
                results["explain"].setdefault(kind, run.pop("explain"))
                results["runs"].append(run)
                print(json.dumps(run), flush=True)
            if args.previous:
                previous, current = results["runs"][-2:]
                results.setdefault("this_tree_vs_previous", []).append(
                    {
                        "db": kind,
                        "workers": workers,
                        **{
                            f"{mode}_rps": current[mode]["rps"] / previous[mode]["rps"]
                            for mode in ("last_good", "commit", "mixed")
                            if mode in current
                        },
                    }
                )
    text_out = json.dumps(results, indent=1)
    print(text_out)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text_out)


def extract(ref: str) -> str:
    """`git archive REF` unpacked in a temporary directory (the previous release, for PYTHONPATH)."""
    tree = tempfile.mkdtemp(prefix=f"ckptstore-{ref}-")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    archive = subprocess.run(["git", "-C", root, "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    return tree


def measure(kind: str, workers: int, code: str | None, args: argparse.Namespace) -> dict:
    """Every phase against one service (from `code`, default this tree) on a freshly populated database."""
    with scratch_database(kind, "ckptstore-svc-bench-", code) as (url, tmp):
        root = f"{tmp}/storage"
        run: dict = {
            "db": kind,
            "workers": workers,
            "populate_s": populate(url, args.jobs, args.nodes, args.epochs, root),
        }
        run["explain"] = explain_last_good(url, "job-00042") if code is None else []
        with running_service(url, workers, root, code) as (port, _):
            run["trivial"] = run_wrk_plain(port, args.duration)
            # Steady state first: every job's answer cached once, as in a running deployment.
            run["warmup_s"] = asyncio.run(warm_up(port, args.jobs))
            # Reads on the populated DB; the write phases after them change every job's answer.
            if "fixed_rate" in args.phases:
                run["fixed_rate"] = asyncio.run(fixed_rate(port, args.rate, args.duration, args.jobs))
            salt = 10 * workers + (100 if kind == "postgres" else 0)
            for offset, mode in enumerate(("last_good", "commit", "mixed")):
                if mode in args.phases:
                    run[mode] = run_wrk(port, mode, args.duration, args.jobs, args.nodes, root, salt + offset)
            if "last_good" in run:
                run["last_good_vs_trivial"] = run["last_good"]["rps"] / run["trivial"]["rps"]
            if "fixed_rate" in args.phases:
                run["fixed_rate_after_writes"] = asyncio.run(fixed_rate(port, args.rate, args.duration, args.jobs))
        return run


def run_wrk_plain(port: int, duration: int) -> dict:
    """The trivial endpoint: the same stack answering a constant."""
    script = (
        'done = function(s, l, r) io.write(string.format("JSON{\\"requests\\":%d,\\"errors\\":%d,'
        '\\"status_errors\\":%d,\\"p50_ms\\":%.3f,\\"p99_ms\\":%.3f}\\n", s.requests, s.errors.connect + '
        "s.errors.read + s.errors.write + s.errors.timeout, s.errors.status, l:percentile(50) / 1000, "
        "l:percentile(99) / 1000)) end\n"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as handle:
        handle.write(script)
    result = subprocess.run(
        ["wrk", "-t1", "-c32", f"-d{duration}s", "-s", handle.name, f"http://127.0.0.1:{port}/healthz"],
        capture_output=True,
        text=True,
        timeout=duration + 60,
    )
    os.unlink(handle.name)
    stats = json.loads(re.search(r"JSON(\{.*\})", result.stdout).group(1))
    stats["rps"] = stats["requests"] / duration
    return stats


if __name__ == "__main__":
    main()
