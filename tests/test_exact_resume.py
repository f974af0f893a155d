"""The exactness matrix, as users write their pipelines: real processes SIGKILLed mid-epoch, at an
epoch's last batch and right after an epoch's end, restarted, and compared with an uninterrupted run
(every model, optimizer and scheduler value and the torch RNG): the resume proof says `exact` only of
a bit-equal resume, never `drift` of one, and `unverified` where it cannot see the data. Then the audit's other half: every listed change between two runs is named as drift,
and refused under resume_check="raise" before anything is assigned."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

pytest.importorskip("torch", reason="the [torch] extra is not installed")

from tests.job_runs import settled_verdict  # noqa: E402
from tests.test_torch import assert_bit_equal, final, ranks, run_job  # noqa: E402

PIPELINES = ["docs", "shuffle", "shuffle-gen", "plain", "stateful", "unsaved"]
# Where the job is killed (epoch, batch before which it dies; 12 batches an epoch, a copy every 3):
# mid-epoch, at an epoch's last batch, right after an epoch's end.
KILL_POINTS = {"mid-epoch": (1, 7), "last-batch": (1, 11), "after-epoch-end": (2, 0)}
# The verdict each resume must get. `unverified` where the data cannot be observed: the loader outside
# objects. (torchdata's shuffling loader at an epoch's end draws the next epoch's order as its iterator
# is made: the saved run's first draws after the save, recorded late, prove it.) Never `exact` unless
# bit-equal, never `drift` when bit-equal (asserted apart).
UNVERIFIED = {("unsaved", point) for point in KILL_POINTS}
_BASELINES: dict[str, dict[str, np.ndarray]] = {}


def bit_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> bool:
    return set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("where", list(KILL_POINTS))
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_exact_is_said_only_of_a_bit_exact_resume_and_every_bit_exact_one_is_not_drift(pipeline, where, tmp_path):
    args = ["--loader", pipeline, "--storage", str(tmp_path / "ckpt")]
    if pipeline not in _BASELINES:  # one uninterrupted run per pipeline (a worker runs a whole file)
        _BASELINES[pipeline] = final(run_job(tmp_path, *args, "--job", f"base-{uuid.uuid4().hex[:6]}"))
    job = ["--job", f"killed-{uuid.uuid4().hex[:6]}"]
    epoch, batch = KILL_POINTS[where]
    run_job(tmp_path, *args, *job, "--kill-epoch", str(epoch), "--kill-batch", str(batch), killed=True)
    resumed = run_job(tmp_path, *args, *job)
    assert resumed.splitlines()[0] == (f"RESUMED 1 {batch - batch % 3}" if batch else "RESUMED 1 None"), resumed
    verdict, exact = settled_verdict(resumed), bit_equal(final(resumed), _BASELINES[pipeline])
    assert not (verdict == "exact" and not exact), f"a false exact: {resumed}"
    assert not (exact and verdict == "drift"), f"a false drift: {resumed}"
    assert verdict == ("unverified" if (pipeline, where) in UNVERIFIED else "exact"), resumed
    assert exact == (pipeline != "unsaved" or where == "after-epoch-end"), "the matrix's own premise"


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
