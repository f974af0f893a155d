"""`ckptstore.client.lightning.BackupAndRestore`: a Lightning `fit` (Dropout, AdamW, a shuffling loader;
tests/lightning_job.py) SIGKILLed and run again with a plain `trainer.fit` ends bit-equal to an
uninterrupted run — mid-epoch and at an epoch's end, with torchdata's `StatefulDataLoader` or a plain
`DataLoader` (whose epoch is drawn again and its trained batches skipped), killed at an epoch's last
batch or right after its end, past a corrupt newest copy."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("lightning", reason="the [lightning] extra is not installed")

from ckptstore import Position, Store  # noqa: E402
from tests.job_runs import assert_same, damage_own_blob, resumed_position, run_job, settled_verdict  # noqa: E402

STEPS_PER_EPOCH = 12  # 384 samples, batches of 32; saves every 5 steps (or at each epoch's end)


def run(tmp_path, job: str, *flags: str, kill_at: int | None = None) -> tuple[str, dict[str, np.ndarray]]:
    return run_job(
        "lightning_job", tmp_path, "--storage", str(tmp_path / "ckpt"), "--job", job, *flags, kill_at=kill_at
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, dict[str, np.ndarray]]:
    tmp_path = tmp_path_factory.mktemp("lightning-base")
    return {"stateful": run(tmp_path, "stateful")[1], "plain": run(tmp_path, "plain", "--plain-loader")[1]}


@pytest.mark.parametrize(
    "flags",
    [(), ("--plain-loader",), ("--epochs-only",), ("--epochs-only", "--plain-loader")],
    ids=["mid-epoch-stateful-loader", "mid-epoch-plain-loader", "epoch-end-stateful-loader", "epoch-end-plain-loader"],
)
def test_a_fit_killed_resumes_bit_exactly(tmp_path, uninterrupted, flags):
    kill_at = int(np.random.default_rng().integers(STEPS_PER_EPOCH + 6, 2 * STEPS_PER_EPOCH))  # mid epoch 1
    run(tmp_path, "killed", *flags, kill_at=kill_at)
    stderr, final = run(tmp_path, "killed", *flags)
    # Steps 15 and 20 are batches 3 and 8 of epoch 1.
    epochs_only = "--epochs-only" in flags
    assert resumed_position(stderr) == (Position(0) if epochs_only else Position(1, 3 if kill_at < 20 else 8))
    # Mid-epoch the proof sees the data (a StatefulDataLoader's next ids, a plain loader's batch before
    # the position drawn again); from an epoch's end, the first batch against what the saved run drew
    # first after the save (recorded late, beside the copy).
    assert settled_verdict(stderr) == "exact", stderr[-2000:]
    assert "epoch's order" not in stderr and "start anew" not in stderr, stderr[-2000:]
    skipped = "are drawn again and skipped" in stderr
    assert skipped == ("--plain-loader" in flags and not epochs_only), stderr[-2000:]
    assert_same(final, uninterrupted["plain" if "--plain-loader" in flags else "stateful"], at_least=12)


@pytest.mark.parametrize("loader", ["stateful", "plain"])
@pytest.mark.parametrize(
    "kill_at,resumed",
    [(24, Position(1, 6)), (25, Position(1))],
    ids=["killed-at-an-epochs-last-batch", "killed-right-after-an-epoch-end"],
)
def test_saves_due_at_an_epochs_last_batch_are_epoch_ends_and_every_kill_point_resumes_exactly(
    tmp_path, uninterrupted, loader, kill_at, resumed
):
    """Every 6 steps of 12-step epochs: the saves due at steps 12 and 24 (epochs' last batches) are
    taken at the epochs' ends. Killed at step 24 (the last batch done, the epoch not ended) the run
    resumes from step 18; killed at step 25, from epoch 1's end (the first batch of epoch 2, as the
    saved run drew it, recorded late) — both proven exact and bit-equal."""
    flags = ["--every", "6"] + (["--plain-loader"] if loader == "plain" else [])
    run(tmp_path, "every6", *flags, kill_at=kill_at)
    positions = Store(str(tmp_path / "ckpt")).list_positions("every6", "n0")
    assert Position(0) in positions and Position(0, 12) not in positions, positions
    stderr, final = run(tmp_path, "every6", *flags)
    assert resumed_position(stderr) == resumed, stderr[-2000:]
    assert settled_verdict(stderr) == "exact", stderr[-2000:]
    assert_same(final, uninterrupted[loader], at_least=12)


def test_a_corrupt_newest_copy_is_fallen_back_from(tmp_path, uninterrupted):
    run(tmp_path, "damaged", kill_at=2 * STEPS_PER_EPOCH + 7)  # saves at steps 25 and 30: epoch 2 batches 1, 6
    assert Store(str(tmp_path / "ckpt")).latest("damaged", "n0") == Position(2, 6)
    damage_own_blob(str(tmp_path / "ckpt"), "damaged", Position(2, 6), Position(2, 1))
    stderr, final = run(tmp_path, "damaged")
    assert resumed_position(stderr) == Position(2, 1), stderr[-2000:]
    assert_same(final, uninterrupted["stateful"], at_least=12)
