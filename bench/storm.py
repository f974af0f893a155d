"""A restart storm: every node of a 4,096-node job restarts at once (a cluster-wide preemption) and
asks the service what a starting client asks, in the client's order — and the commit tail on
PostgreSQL at 64 connections on the batch route.

    python bench/storm.py [--nodes 4096] [--setups sqlite-1 postgres-1 postgres-3] [--commit-duration 10]
                          [--out FILE]

- storm: the job is declared with `--nodes` nodes, each of which committed epoch 0 (epoch 0 is
  good). Then every node at once, one keep-alive connection each (raw HTTP/1.1, asyncio: the client
  costs little CPU), makes a restarting `NodeCheckpointer`'s requests: `GET /v1/jobs/{job}` (the
  declared-job check at construction), `POST …/nodes/{node}/start` (registers the attempt and answers
  the node's part of the last-good answer in one request: ckptstore.client.engine.startup.start_in_one_request) —
  **its answer is the node's resume position: the "first answer"** —, `PUT …/attempts/{n}` (where it
  resumed), then `GET …/resume-agreement?wait_s=20` until every node agreed (the service holds each
  request until then: `ckptstore.server.records.agreement`). A connection the service closed is opened again (as
  httpx's pool does), and counted. Per node, seconds from the storm's start to its first answer and
  to the agreement:
  p50 / p99 / max, the statuses, and the CPU seconds each part of the machine (this client, the
  service, PostgreSQL, nginx) spent until the last node had its first answer. Setups: SQLite with 1 service process; PostgreSQL with 1, and
  3 replicas (1 process each) behind Debian's nginx (SQLite is one file on one machine: replicas
  need PostgreSQL, docs/operations.md).
- commit_tail: `bench/scale.py`'s commits phase — wrk, 64 connections, one new position per
  request on `POST …/checkpoints/batch`, 1,000 jobs × 8 nodes — on PostgreSQL, 1 process and 3
  replicas behind nginx: requests/s, p50 / p99.
Needs nginx and wrk (Debian packages) and the machine's PostgreSQL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.scale import Results, commit, get_json, post, send_all  # noqa: E402
from bench.service import populate, replicas, run_wrk, scratch_database  # noqa: E402
from ckptstore.client.engine.restore import AGREEMENT_WAIT_S  # noqa: E402

JOB = "storm"


def raise_open_files() -> None:
    """One connection per node: the soft limit on open files up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def prepare(port: int, nodes: list[str], root: str) -> None:
    """Declare the job and commit epoch 0 on every node (attempt 1), until epoch 0 is good."""
    declare = post(f"/v1/jobs/{JOB}", {"nodes": nodes, "storage_root": root}).replace(b"POST", b"PUT", 1)
    _, declared = asyncio.run(send_all(port, [declare], connections=1))
    _, registered = asyncio.run(send_all(port, [post(f"/v1/jobs/{JOB}/nodes/{n}/attempts", {}) for n in nodes]))
    assert declared in ([200], [201]) and set(registered) == {201}, (declared, Counter(registered))
    bodies = [
        post(f"/v1/jobs/{JOB}/checkpoints/batch", {"commits": [{"node": n, **commit(root, n, JOB)}]}) for n in nodes
    ]
    _, statuses = asyncio.run(send_all(port, bodies))
    assert set(statuses) == {201}, Counter(statuses)
    while get_json(port, f"/v1/jobs/{JOB}/last-good-epoch").get("epoch") != 0:
        time.sleep(0.05)


def request(method: str, path: str, body: dict | None = None, headers: str = "") -> bytes:
    data = b"" if body is None else json.dumps(body).encode()
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}Content-Type: application/json\r\n"
    return (head + f"Content-Length: {len(data)}\r\n\r\n").encode() + data


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, message: bytes) -> tuple[int, dict]:
    writer.write(message)
    header = await reader.readuntil(b"\r\n\r\n")
    length = re.search(rb"content-length: (\d+)", header, re.I)
    body = await reader.readexactly(int(length.group(1))) if length else b""
    return int(header[9:12]), json.loads(body) if body else {}


class Connection:
    """A node's keep-alive connection; a request the server closed the connection on (keep-alive timed
    out under load) is sent again on a new one, as httpx's pool does."""

    def __init__(self, port: int, statuses: Counter):
        self.port, self.statuses = port, statuses
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def ask(self, message: bytes) -> dict:
        for _ in range(3):
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
            assert self.reader is not None
            try:
                status, answer = await exchange(self.reader, self.writer, message)
            except (asyncio.IncompleteReadError, ConnectionError):
                self.statuses["reconnected"] += 1
                self.close()
                continue
            self.statuses[status] += 1
            if status >= 400:
                raise RuntimeError(f"{status} {answer}")
            return answer
        raise RuntimeError("the connection was closed three times")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """Per process on the machine, its kind and the CPU seconds it has used so far. Kinds: this
    process (the storm's client), PostgreSQL, nginx, the service's processes (the other Python
    processes), the rest."""
    tick = os.sysconf("SC_CLK_TCK")
    used: dict[int, tuple[str, float]] = {}
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            with open(f"/proc/{pid}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue  # exited meanwhile
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        kind = next((k for k in ("postgres", "nginx", "python") if name.startswith(k)), "other")
        kind = "client" if pid == os.getpid() else "service" if kind == "python" else kind
        used[pid] = kind, (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return used


def cpu_spent(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds by kind between two `cpu_seconds()` (a process that exited in between is not counted)."""
    spent: dict[str, float] = {}
    for pid, (kind, seconds) in after.items():
        spent[kind] = spent.get(kind, 0.0) + seconds - before.get(pid, (kind, 0.0))[1]
    return {kind: round(seconds, 2) for kind, seconds in sorted(spent.items())}


async def restart(
    port: int, node: str, began: float, statuses: Counter, answered: Callable[[], None]
) -> tuple[float, float]:
    """One node's restart, as a NodeCheckpointer makes it: seconds to its resume position, to agreement."""
    connection = Connection(port, statuses)
    try:
        declared = await connection.ask(request("GET", f"/v1/jobs/{JOB}"))
        key = f"Idempotency-Key: {node}-storm\r\n"
        stored = [{"epoch": 0, "attempt": "1"}]  # what the node lists on its storage
        body = {"declared_at": declared["updated_at"], "stored": stored}
        start = await connection.ask(request("POST", f"/v1/jobs/{JOB}/nodes/{node}/start", body, key))
        first_answer = time.perf_counter() - began
        answered()
        if start["attempt"] is None:
            raise RuntimeError(f"the start was declined: {start['refused']}")
        number, resume = start["attempt"]["attempt"], start["resume"]["resume"]
        await connection.ask(request("PUT", f"/v1/jobs/{JOB}/nodes/{node}/attempts/{number}", {"resumed_from": resume}))
        wait = f"/v1/jobs/{JOB}/resume-agreement?wait_s={AGREEMENT_WAIT_S:g}"
        while not (await connection.ask(request("GET", wait)))["agreed"]:
            pass
        return first_answer, time.perf_counter() - began
    finally:
        connection.close()


async def storm_once(port: int, nodes: list[str]) -> dict:
    statuses: Counter = Counter()
    before = cpu_seconds()
    spent: dict[str, float] = {}
    waiting = len(nodes)

    def answered() -> None:  # when the last node has its answer: what each part of the machine spent
        nonlocal waiting
        waiting -= 1
        if waiting == 0:
            spent.update(cpu_spent(before, cpu_seconds()), wall=round(time.perf_counter() - began, 2))

    began = time.perf_counter()
    results = await asyncio.gather(
        *(restart(port, n, began, statuses, answered) for n in nodes), return_exceptions=True
    )
    failed = [r for r in results if isinstance(r, BaseException)]
    done = [r for r in results if not isinstance(r, BaseException)]

    def spread(values: list[float]) -> dict:
        ordered = sorted(values)
        return {
            "p50_s": statistics.median(ordered),
            "p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "max_s": ordered[-1],
        }

    return {
        "nodes": len(nodes),
        "first_answer": spread([first for first, _ in done]) if done else None,
        "agreed": spread([agreed for _, agreed in done]) if done else None,
        "cpu_s_to_the_last_first_answer": spent,
        "statuses": dict(statuses),
        "failed": len(failed),
        "first_failure": repr(failed[0])[:300] if failed else None,
    }


def storm(setup: str, count: int) -> dict:
    kind, processes = setup.split("-")
    nodes = [f"w{i:04d}" for i in range(count)]
    with scratch_database(kind, "ckptstore-storm-") as (url, tmp):
        root = f"{tmp}/storage"
        with replicas(url, int(processes), root, tmp, worker_connections=16384) as port:
            prepare(port, nodes, root)
            return asyncio.run(storm_once(port, nodes))


def commit_tail(processes: int, duration: int) -> dict:
    with scratch_database("postgres", "ckptstore-storm-") as (url, tmp):
        root = f"{tmp}/storage"
        populate(url, 1000, 8, 10, root)
        with replicas(url, processes, root, tmp) as port:
            return run_wrk(port, "commit", duration, 1000, 8, root, salt=3, connections=64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4096)
    parser.add_argument("--setups", nargs="+", default=["sqlite-1", "postgres-1", "postgres-3"])
    parser.add_argument("--commit-duration", type=int, default=10, help="seconds of each commit-tail run (0: none)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    raise_open_files()
    record = Results("bench/storm.py", args.out).record

    for setup in args.setups:
        record(f"storm/{setup}", storm(setup, args.nodes))
    if args.commit_duration:
        for processes in (1, 3):
            record(f"commit_tail/postgres-{processes}", commit_tail(processes, args.commit_duration))


if __name__ == "__main__":
    main()
