"""Exactness under DDP and the audit's other half (the matrix over every framework and kill point is
tests/test_resume_matrix.py): replicated state restores every rank its own RNG; a loader outside
objects is unverified and refused mid-epoch under raise; a two-rank copy restored by one process is
drift, refused under resume_check="raise" before anything is assigned."""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("torch", reason="the [torch] extra is not installed")

from tests.test_torch import assert_bit_equal, final, ranks, run_job  # noqa: E402


@pytest.mark.parametrize("seeds", ["one seed", "per-rank seeds"])
def test_ddp_with_replicated_state_restores_every_rank_its_own_rng(seeds, tmp_path, sqlite_service):
    common = ["--storage", f"{sqlite_service.storage}/ddp-{uuid.uuid4().hex[:6]}", "--service", sqlite_service.live.url]
    common += ["--loader", "shuffle-gen"] + (["--seed-per-rank"] if seeds == "per-rank seeds" else [])
    baseline = ranks(tmp_path, 2, *common, "--job", f"ddp-base-{uuid.uuid4().hex[:6]}")
    job = ["--job", f"ddp-{uuid.uuid4().hex[:6]}"]
    ranks(tmp_path, 2, *common, *job, "--kill-epoch", "1", "--kill-batch", "8", killed_rank=0)
    resumed = ranks(tmp_path, 2, *common, *job)
    assert [r.splitlines()[0] for r in resumed] == ["RESUMED 1 6", "RESUMED 1 6"]
    for got, want in zip(resumed, baseline, strict=True):
        assert "resume audit: exact" in got
        assert_bit_equal(final(got), final(want))


def test_a_plain_shuffling_loader_outside_objects_is_unverified_and_refused_mid_epoch_under_raise(tmp_path):
    args = ["--loader", "unsaved", "--storage", str(tmp_path / "ckpt"), "--job", "unsaved"]
    import subprocess
    import sys

    from tests.test_torch import ROOT

    run_job(tmp_path, *args, "--kill-epoch", "1", "--kill-batch", "7", killed=True)
    refused = subprocess.run(
        [sys.executable, "-m", "tests.torch_job", *args, "--resume-check", "raise", "--out", str(tmp_path / "x")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == 80, refused.stderr[-3000:]  # ResumeDriftError's exit code
    assert "a mid-epoch resume it cannot verify" in refused.stderr, refused.stderr[-3000:]
    assert "no data loader or sampler in objects" in refused.stderr
    assert not (tmp_path / "x").exists(), "nothing trained on"


def test_a_two_rank_checkpoint_restored_by_one_process_is_drift_and_refused_under_raise(tmp_path, sqlite_service):
    import os
    import subprocess
    import sys

    from tests.test_torch import ROOT

    common = [
        "--storage",
        f"{sqlite_service.storage}/world-{uuid.uuid4().hex[:6]}",
        "--service",
        sqlite_service.live.url,
    ]
    job = ["--job", f"world-{uuid.uuid4().hex[:6]}"]
    ranks(tmp_path, 2, *common, *job, "--kill-epoch", "1", "--kill-batch", "4", killed_rank=0)
    alone = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.torch_job",
            *common,
            *job,
            "--resume-check",
            "raise",
            "--out",
            str(tmp_path / "x"),
        ],
        cwd=ROOT,
        env=os.environ | {"CKPTSTORE_NODE": "node-0"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert alone.returncode != 0 and "ResumeDriftError" in alone.stderr, alone.stderr[-2000:]
    assert "world size: saved by 2 process(es), restoring into 1" in alone.stderr
