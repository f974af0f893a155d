"""The resume audit of a Keras `fit` sees what changes its batches though the steps per epoch stay
the same (43 with validation_split=0.1: 3,000 samples in batches of 64 or 63, or 2,990 in 64s):
the seed `keras.utils.set_random_seed` set, the batch size, the number of samples — each named as
drift and refused under resume_check="raise"; the unchanged run resumed from the epoch's end that
ended the first fit checks its counters and says its data unverified (the next epoch's order is drawn
as its iterator is made, and the first fit ended before it drew one: nothing recorded to check)."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")

from ckptstore.client.keras import BackupAndRestore  # noqa: E402
from ckptstore.errors import ResumeDriftError  # noqa: E402


def fit(storage: str, *, epochs: int, seed: int = 1, batch_size: int = 64, samples: int = 3000) -> None:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(0).standard_normal((samples, 4)).astype(np.float32)
    backup = BackupAndRestore(storage=storage, job="fit", delete_checkpoint=False, resume_check="raise")
    model.fit(x, x[:, :1], batch_size=batch_size, epochs=epochs, validation_split=0.1, callbacks=[backup], verbose=0)


@pytest.mark.parametrize(
    "change,named",
    [
        ({"seed": 2}, "data (fit): seed 1 → 2"),
        ({"batch_size": 63}, "data (fit): batch size 64 → 63"),
        ({"samples": 2990}, "data (fit): dataset length 2700 → 2691"),
    ],
    ids=["seed", "batch-size", "dataset-length"],
)
def test_a_change_that_keeps_the_steps_per_epoch_is_named_and_refused(tmp_path, change, named):
    fit(str(tmp_path), epochs=1)
    with pytest.raises(ResumeDriftError) as refused:
        fit(str(tmp_path), epochs=2, **change)
    assert named in str(refused.value), str(refused.value)
    assert "steps per epoch" not in str(refused.value), "43 steps an epoch either way"


def test_the_unchanged_fit_checks_its_counters_and_says_its_batches_are_unverified(tmp_path, capsys):
    fit(str(tmp_path), epochs=1)
    fit(str(tmp_path), epochs=2)
    err = capsys.readouterr().err
    assert (
        "resume audit: unverified, not shown to be exact (the first step's counters (epoch 1, batch 0, iterations 43) match the saved run's"
        in err
    ), err
    assert "an epoch's end whose order is drawn as the next iterator is made" in err, err
    assert "resume audit: exact" not in err
