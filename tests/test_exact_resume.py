"""The exactness matrix, as users write their pipelines: real processes SIGKILLed at a random
mid-epoch batch (or right after an epoch's end), restarted, and compared with an uninterrupted run
— every model, optimizer and scheduler value and the torch RNG bit-equal, and the resume audit
says `exact`. Then the audit's other half: every listed change between two runs is named as drift,
and refused under resume_check="raise" before anything is assigned."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

pytest.importorskip("torch", reason="the [torch] extra is not installed")

from tests.test_torch import assert_bit_equal, final, ranks, run_job  # noqa: E402

PIPELINES = ["docs", "shuffle", "shuffle-gen", "plain", "stateful"]


def kill_point(where: str) -> tuple[int, int]:
    """A random mid-epoch batch of epoch 1 (after at least one save), or epoch 2's first batch."""
    return (1, int(np.random.default_rng().integers(3, 12))) if where == "mid-epoch" else (2, 0)


@pytest.mark.parametrize("where", ["mid-epoch", "epoch-end"])
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_each_pipeline_as_users_write_it_resumes_bit_exactly_and_audits_exact(pipeline, where, tmp_path):
    args = ["--loader", pipeline, "--storage", str(tmp_path / "ckpt")]
    baseline = final(run_job(tmp_path, *args, "--job", f"base-{uuid.uuid4().hex[:6]}"))
    job = ["--job", f"killed-{uuid.uuid4().hex[:6]}"]
    epoch, batch = kill_point(where)
    run_job(tmp_path, *args, *job, "--kill-epoch", str(epoch), "--kill-batch", str(batch), killed=True)
    resumed = run_job(tmp_path, *args, *job)
    saved = batch - batch % 3
    assert resumed.splitlines()[0] == (f"RESUMED 1 {saved}" if batch else "RESUMED 1 None"), batch
    assert "resume audit: exact" in resumed, resumed
    assert_bit_equal(final(resumed), baseline)


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


def test_a_plain_shuffling_loader_outside_objects_is_audited_as_drift_mid_epoch(tmp_path):
    args = ["--loader", "unsaved", "--storage", str(tmp_path / "ckpt"), "--job", "unsaved"]
    run_job(tmp_path, *args, "--kill-epoch", "1", "--kill-batch", "7", killed=True)
    resumed = run_job(tmp_path, *args)
    assert "resume audit: DRIFT" in resumed
    assert "with no data loader, sampler or iterator in objects" in resumed


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
