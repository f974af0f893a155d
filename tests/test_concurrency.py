"""32 concurrent committers (16 threads + 16 processes) on overlapping jobs, nodes and positions,
on SQLite and PostgreSQL; and two attempts racing on one position."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import random

import httpx
import numpy as np

from ckptstore import Store
from ckptstore.client.service.operations import apply_retention
from ckptstore.client.service.rest import ServiceClient
from tests.builders import commit_body

JOBS, NODES, EPOCHS = 2, 4, 5


def post_all(url: str, items: list[tuple[str, str, dict]]) -> list[tuple[int, str | None]]:
    """Post commits one after another; (status, Retry-After) for each. Runs in threads and processes."""
    answers = []
    with httpx.Client(base_url=url, timeout=60) as http:
        for job, node, payload in items:
            response = http.post(f"/v1/jobs/{job}/nodes/{node}/checkpoints", json=payload)
            answers.append((response.status_code, response.headers.get("retry-after")))
    return answers


def test_32_concurrent_committers_lose_nothing_and_duplicate_nothing(service, job_name):
    root = service.storage
    jobs = [f"{job_name}-{j}" for j in range(JOBS)]
    with ServiceClient(service.live.url) as client:
        for job in jobs:
            client.put_job(job, [f"n{i}" for i in range(NODES)], storage_root=root)
    work = [
        (job, f"n{n}", commit_body(root, job, f"n{n}", e)) for job in jobs for n in range(NODES) for e in range(EPOCHS)
    ]
    conflicting = [(job, node, payload | {"bytes": 999}) for job, node, payload in work[::7]]
    items = work * 3 + conflicting  # every commit posted three times, some with other content
    random.Random(5).shuffle(items)
    chunks = [items[i::32] for i in range(32)]
    context = multiprocessing.get_context("spawn")
    with (
        concurrent.futures.ThreadPoolExecutor(16) as threads,
        concurrent.futures.ProcessPoolExecutor(16, mp_context=context) as processes,
    ):
        futures = [threads.submit(post_all, service.live.url, c) for c in chunks[:16]]
        futures += [processes.submit(post_all, service.live.url, c) for c in chunks[16:]]
        answers = [a for f in futures for a in f.result()]
    statuses = [status for status, _ in answers]
    assert not [s for s in statuses if s >= 500 and s != 503], "no 5xx but 503"
    assert all(retry for status, retry in answers if status == 503), "503 always carries Retry-After"
    assert set(statuses) <= {200, 201, 409, 503} and 409 in statuses, "other content answers 409"
    created = statuses.count(201)
    assert created == len(work), "each distinct commit created exactly once"
    with ServiceClient(service.live.url) as client:
        for job in jobs:
            records = client.list_checkpoints(job, limit=10_000)
            keys = [(r.node, r.epoch, r.attempt) for r in records]
            assert len(keys) == len(set(keys)) == NODES * EPOCHS, "no duplicates, nothing lost"
            assert {r.bytes for r in records} <= {100, 999}
            assert client.last_good_epoch(job).epoch == EPOCHS - 1


def test_two_attempts_racing_on_one_position_newest_counts_and_gc_removes_the_loser(sqlite_service, job_name):
    root = sqlite_service.storage
    store = Store(root)
    with ServiceClient(sqlite_service.live.url) as client:
        client.put_job(job_name, ["n0"], storage_root=root, retention={"grace_seconds": 0})
        old = client.start_attempt(job_name, "n0")
        old_ref = store.save(job_name, "n0", 3, {"w": np.zeros(8, np.float32)}, attempt=old)
        new = client.start_attempt(job_name, "n0")  # the replacement process starts while the old one writes
        new_ref = store.save(job_name, "n0", 3, {"w": np.ones(8, np.float32)}, attempt=new)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            outcomes = list(pool.map(lambda ref: _try_commit(client, ref), [old_ref, new_ref]))
        assert outcomes == ["fenced", "committed"]
        assert [(r.epoch, r.attempt) for r in client.list_checkpoints(job_name)] == [(3, str(new))]
        assert [i.key.attempt for i in store.list_checkpoints(job_name, "n0")] == [str(old), str(new)], (
            "both on storage"
        )
        removed = apply_retention(client, job_name)
        assert [(r.attempt, r.reason) for r in removed] == [(str(old), "superseded")]
    assert [i.key.attempt for i in store.list_checkpoints(job_name, "n0")] == [str(new)]
    assert store.load(job_name, "n0", 3)["w"].tolist() == [1.0] * 8


def _try_commit(client: ServiceClient, ref) -> str:
    from ckptstore.errors import FencedError

    try:
        client.commit(ref)
        return "committed"
    except FencedError:
        return "fenced"
