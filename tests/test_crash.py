"""Crash consistency and durability of the commit protocol on local disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ckptstore import Store
from tests.crash_driver import OBJECT_STORE_PHASES, PHASES, SERVICE_PHASES

KILLS_PER_PHASE = 20


def run_driver(tmp_path, phase: str, kills: int, *extra: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "tests.crash_driver", str(tmp_path), phase, str(kills), *extra],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["killed"] == kills, summary
    assert summary["partial_listed"] == 0, summary
    assert summary["bad_loads"] == 0, summary
    assert summary["wrong_commit_state"] == 0, summary
    assert summary["wrong_last_good"] == 0, summary
    return summary


@pytest.mark.parametrize("phase", PHASES)
def test_a_kill_at_any_phase_never_shows_a_partial_checkpoint(tmp_path, phase):
    run_driver(tmp_path, phase, KILLS_PER_PHASE)


@pytest.mark.s3
@pytest.mark.parametrize("phase", OBJECT_STORE_PHASES)
def test_a_kill_at_any_phase_on_s3_never_shows_a_partial_checkpoint(moto_s3, phase):
    root = f"s3://{moto_s3.bucket}/crash-{phase}-{os.getpid()}"
    run_driver(root, phase, 8, moto_s3.endpoint_url)


@pytest.mark.parametrize("phase", SERVICE_PHASES)
def test_a_kill_of_one_node_of_three_keeps_the_last_good_answer_right(tmp_path, sqlite_service, phase):
    root = f"{sqlite_service.storage}/crash3-{phase}"
    run_driver(root, phase, 8, "-", sqlite_service.live.url)


def test_commit_order_is_fsync_file_then_rename_then_fsync_dir(tmp_path, monkeypatch):
    """A SIGKILL keeps the page cache, so kills cannot prove durability: spy on the syscalls."""
    events: list[tuple[str, str]] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def renamer(real):
        def rename(src, dst, *args, **kwargs):
            events.append(("rename", str(dst)))
            return real(src, dst, *args, **kwargs)

        return rename

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", renamer(real_rename))
    monkeypatch.setattr(os, "replace", renamer(real_replace))
    store = Store(str(tmp_path), shard_size=1024)
    ref = store.save("job", "n", 0, {f"t{i}": np.arange(300, dtype=np.float32) * i for i in range(4)}, attempt=1)
    directory = ref.location
    blobs = ref.shard_locations
    pool = os.path.dirname(blobs[0])
    manifest = f"{directory}/MANIFEST.json"
    index = {event: i for i, event in enumerate(events)}
    rename_at = index[("rename", manifest)]
    temp_fsyncs = [i for i, (kind, path) in enumerate(events) if kind == "fsync" and ".MANIFEST.json.tmp-" in path]
    blob_fsyncs = [i for i, (kind, path) in enumerate(events) if kind == "fsync" and path.startswith(f"{pool}/.tmp-")]
    blob_renames = [index[("rename", blob)] for blob in blobs]
    assert len(set(blobs)) == 4 and len(blob_fsyncs) == 4
    assert max(blob_fsyncs) < min(blob_renames), "every blob is fsynced under its temporary name before its rename"
    assert max(blob_renames) < index[("fsync", pool)] < rename_at, "the pool's entries are durable before the manifest"
    assert temp_fsyncs and max(temp_fsyncs) < rename_at, "the manifest's temp file is fsynced before its rename"
    dir_fsyncs = [i for i, e in enumerate(events) if e == ("fsync", directory)]
    assert any(i < rename_at for i in dir_fsyncs), "the copy's directory entries are durable before the manifest"
    assert any(i > rename_at for i in dir_fsyncs), "the directory is fsynced after the rename"
    for parent in (os.path.dirname(directory), os.path.dirname(os.path.dirname(directory))):
        assert ("fsync", parent) in index, f"new parent directory {parent} is made durable"
