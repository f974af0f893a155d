"""`ckptstore prestage JOB --node NODE --to DIR`: the copy a node would resume from, staged into a new
local tier before training starts (an init container's step); the training then restores it from the
local tier. A fresh job stages nothing and says so (exit 0); a damaged durable copy is not staged (1)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import numpy as np

from ckptstore import Position
from ckptstore.client.engine.node import NodeCheckpointer

CLI = os.path.join(os.path.dirname(sys.executable), "ckptstore")
STATE = {"w": np.arange(4096, dtype=np.float32), "b": np.ones(8, dtype=np.int64)}


def prestage(url: str, job: str, to: str) -> subprocess.CompletedProcess[str]:
    command = [CLI, "prestage", job, "--node", "n0", "--to", to, "--url", url]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def trained(service, job: str) -> None:
    node = NodeCheckpointer(storage=service.storage, service=service.live.url, job=job, node="n0")
    try:
        node.start()
        for epoch in range(2):
            node.save(Position(epoch), {k: v + epoch for k, v in STATE.items()})
        node.wait()
    finally:
        node.close()


def test_a_prestaged_copy_is_restored_from_the_new_local_tier(sqlite_service, tmp_path):
    job = f"stage-{uuid.uuid4().hex[:6]}"
    trained(sqlite_service, job)
    local = str(tmp_path / "new-machine-ssd")
    result = prestage(sqlite_service.live.url, job, local)
    assert result.returncode == 0 and "verified" in result.stdout, (result.stdout, result.stderr)
    node = NodeCheckpointer(
        storage=sqlite_service.storage, local_storage=local, service=sqlite_service.live.url, job=job, node="n0"
    )
    try:
        restored = node.start()
        assert restored is not None and restored.copy.tier == "local" and restored.copy.position == Position(1)
        arrays = restored.checkpoint.arrays
        for name, value in STATE.items():
            assert np.array_equal(arrays[name], value + 1), name
    finally:
        node.close()
    again = prestage(sqlite_service.live.url, job, local)
    assert again.returncode == 0, again.stderr  # staging twice keeps the copy


def test_a_fresh_job_stages_nothing_and_a_damaged_copy_is_not_staged(sqlite_service, tmp_path):
    fresh = prestage(sqlite_service.live.url, f"fresh-{uuid.uuid4().hex[:6]}", str(tmp_path / "a"))
    assert fresh.returncode == 0 and "nothing to stage" in fresh.stdout, (fresh.stdout, fresh.stderr)
    job = f"damaged-{uuid.uuid4().hex[:6]}"
    trained(sqlite_service, job)
    blobs = [
        os.path.join(folder, name)
        for folder, _, names in os.walk(os.path.join(sqlite_service.storage, job))
        for name in names
        if name.endswith(".safetensors")
    ]
    assert blobs
    for path in blobs:  # every blob of the job: the copy to stage cannot verify
        with open(path, "r+b") as handle:
            handle.seek(-1, os.SEEK_END)
            last = handle.read(1)
            handle.seek(-1, os.SEEK_END)
            handle.write(bytes([last[0] ^ 0xFF]))
    damaged = prestage(sqlite_service.live.url, job, str(tmp_path / "b"))
    assert damaged.returncode == 1, (damaged.stdout, damaged.stderr)
    assert "to prestage" in damaged.stderr
