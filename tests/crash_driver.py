"""Deterministic crash trials: a forked writer SIGKILLs itself at a named phase of save or delete.

Run as `python -m tests.crash_driver ROOT PHASE TRIALS [S3_ENDPOINT] [SERVICE_URL]`; prints a JSON
summary. Runs in its own process so that forking happens without other threads around (moto,
pytest plugins). After every kill a fresh Store checks: nothing partial is listed, everything
listed loads bit-exactly, and the killed checkpoint is committed exactly when the phase is past
the commit. ROOT may be s3://… (with the endpoint of moto's server). With a service, the job has
three nodes: n0 and n1 commit each epoch normally, the killed writer is n2, and the service's last
good epoch must be the new epoch exactly when n2's commit record was posted, else the previous one.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np

from ckptstore import Store
from ckptstore.storage.filesystem import Storage
from tests.builders import failed_loads

JOB, NODE = "crash", "node-0"
NODES = ("n0", "n1", "n2")
SHARD_SIZE = 64 << 10
PHASES = (
    "after_shards",
    "mid_shard",
    "before_rename",
    "after_rename",
    "before_manifest",
    "after_manifest",
    "mid_delete",
)
OBJECT_STORE_PHASES = ("after_shards", "mid_shard", "before_manifest", "after_manifest", "mid_delete")
SERVICE_PHASES = ("after_shards", "before_manifest", "before_commit_record", "after_commit_record")
COMMITTED_AFTER = {
    "after_shards": False,
    "mid_shard": False,
    "before_rename": False,
    "after_rename": True,
    "before_manifest": False,
    "after_manifest": True,
    "mid_delete": False,
    "before_commit_record": True,
    "after_commit_record": True,
}


def arrays_for(epoch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(epoch)
    return {f"layer{i}/kernel": rng.standard_normal(12_000 + 97 * i).astype(np.float32) for i in range(6)} | {
        "bias": rng.standard_normal(33).astype(np.float32)
    }


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(phase: str, trial: int) -> None:
    """Patch the real code path so this process SIGKILLs itself at `phase`."""
    from ckptstore.client.service.rest import ServiceClient

    write_object, remove_prefix, rename = Storage.write_object, Storage.remove_prefix, os.rename
    publish, commit = Storage.publish_object, ServiceClient.commit
    if phase == "after_shards":
        written = []
        kill_after = 1 + trial % 4

        def counted(self, relpath, chunks, *size):
            write_object(self, relpath, chunks, *size)
            written.append(relpath)
            if len(written) == kill_after:
                die()

        Storage.write_object = counted
    elif phase == "mid_shard":

        def partial(self, relpath, chunks, *size):
            def cut():
                for index, chunk in enumerate(chunks):
                    if index == 1 + trial % 2:
                        die()
                    yield chunk

            write_object(self, relpath, cut(), *size)

        Storage.write_object = partial
    elif phase == "before_rename":
        os.rename = lambda *a, **k: die()
    elif phase == "after_rename":
        os.rename = lambda *a, **k: (rename(*a, **k), die())
    elif phase == "before_manifest":
        Storage.publish_object = lambda *a, **k: die()
    elif phase == "after_manifest":
        Storage.publish_object = lambda *a, **k: (publish(*a, **k), die())
    elif phase == "before_commit_record":
        ServiceClient.commit = lambda *a, **k: die()
    elif phase == "after_commit_record":
        ServiceClient.commit = lambda *a, **k: (commit(*a, **k), die())
    elif phase == "mid_delete":
        Storage.remove_prefix = lambda self, relpath: die() or remove_prefix(self, relpath)


def open_store(root: str, endpoint: str | None, **kwargs) -> Store:
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"} if endpoint else None
    return Store(root, storage_options=options, shard_size=SHARD_SIZE, **kwargs)


def run(root: str, phase: str, trials: int, endpoint: str | None = None, service: str | None = None) -> dict:
    from ckptstore.client.service.rest import ServiceClient

    summary = {
        "phase": phase,
        "trials": trials,
        "killed": 0,
        "partial_listed": 0,
        "bad_loads": 0,
        "wrong_commit_state": 0,
        "wrong_last_good": 0,
    }
    node = "n2" if service else NODE
    job = f"{JOB}-{phase}" if service else JOB
    if service:
        with ServiceClient(service) as client:
            client.put_job(job, list(NODES), storage_root=root)
    for trial in range(trials):
        if phase == "mid_delete":
            open_store(root, endpoint).save(job, node, trial, arrays_for(trial), attempt=1)
        attempts = {}
        if service:  # this epoch's other two nodes commit normally; n2 is a new process start per trial
            with ServiceClient(service) as client:
                for other in NODES:
                    attempts[other] = str(client.start_attempt(job, other))
                for other in NODES[:2]:
                    ref = open_store(root, endpoint).save(job, other, trial, arrays_for(trial), attempt=attempts[other])
                    client.commit(ref)
        pid = os.fork()
        if pid == 0:
            try:
                arm(phase, trial)
                store = open_store(root, endpoint, concurrency=1)
                if phase == "mid_delete":
                    store.delete(job, node, trial)
                elif service:
                    ref = store.save(job, node, trial, arrays_for(trial), attempt=attempts[node])
                    ServiceClient(service).commit(ref)
                else:
                    store.save(job, node, trial, arrays_for(trial), attempt=1)
            finally:
                os._exit(99)  # only reached if the kill did not happen
        _, status = os.waitpid(pid, 0)
        summary["killed"] += os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        reader = open_store(root, endpoint)
        infos = reader.list_checkpoints(job, node)
        listed = {i.key.position.epoch for i in infos if i.committed}
        if (trial in listed) != COMMITTED_AFTER[phase]:
            summary["wrong_commit_state"] += 1
        unreadable, wrong = failed_loads(reader, job, node, listed, arrays_for)
        summary["partial_listed"] += unreadable
        summary["bad_loads"] += wrong
        if service:
            with ServiceClient(service) as client:
                answer = client.last_good_epoch(job)
            posted = phase == "after_commit_record"
            expected = trial if posted else (trial - 1 if trial > 0 else None)
            if answer.epoch != expected:
                summary["wrong_last_good"] += 1
            elif expected is not None:  # every node's part of the answer loads bit-exact
                for part_node, where in answer.nodes.items():
                    got = reader.load(job, part_node, expected, attempt=where.attempt)
                    if any(got[k].tobytes() != arrays_for(expected)[k].tobytes() for k in got):
                        summary["bad_loads"] += 1
            if not posted:  # the restarted n2 saves this epoch again, under a new attempt
                with ServiceClient(service) as client:
                    attempt = str(client.start_attempt(job, node))
                    client.commit(reader.save(job, node, trial, arrays_for(trial), attempt=attempt))
    return summary


if __name__ == "__main__":
    endpoint = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] != "-" else None
    service = sys.argv[5] if len(sys.argv) > 5 else None
    print(json.dumps(run(sys.argv[1], sys.argv[2], int(sys.argv[3]), endpoint, service)))
