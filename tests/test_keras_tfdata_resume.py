"""Keras `fit` over the everyday reshuffling pipeline — `from_tensor_slices(…).shuffle(N).batch(b)`,
which reshuffles each epoch — interrupted and fitted again: bit-equal to an uninterrupted fit at
every kill point (mid-epoch, at an epoch's last batch, right after an epoch's end; `save_freq=5` and
"epoch"). The pipeline's N-th iterator draws the N-th order, and a new process starts from N = 0:
the callback makes the iterators the saved run had made (the control below shows the resume is
not exact without that). The resume proof says `exact` mid-epoch — the batch before the position,
drawn again to skip it, is the saved run's — and from an epoch's end — the first batch trained is
the one the saved run trained after the save (recorded late, beside the copy); never `exact` of the
controls, which it refuses or calls drift."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from ckptstore.client.keras import _DataIterations  # noqa: E402
from tests.keras_tfdata import BATCHES, assert_bit_equal, fit  # noqa: E402


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return fit(str(tmp_path_factory.mktemp("tfdata-base")), "epoch")


@pytest.mark.parametrize(
    "save_freq,interrupt,resumed_at",
    [(5, (1, 7), "mid"), (5, (1, BATCHES), "mid"), (5, (2, 1), "end"), ("epoch", (1, 7), "end")],
    ids=["mid-epoch", "at-an-epochs-last-batch", "right-after-an-epoch-end", "save-freq-epoch-mid-epoch"],
)
def test_a_reshuffling_pipeline_resumes_bit_exactly(tmp_path, uninterrupted, save_freq, interrupt, resumed_at, capsys):
    assert fit(str(tmp_path), save_freq, interrupt) is None
    resumed = fit(str(tmp_path), save_freq)
    assert_bit_equal(resumed, uninterrupted)
    err = capsys.readouterr().err
    assert "resume audit: exact" in err and "reshuffling order is the saved run's" in err, err[-2000:]
    seen = "batch before the position (drawn again to skip it)" if resumed_at == "mid" else "first batch (the one the"
    assert f"proven: fit's {seen}" in err, err[-2000:]


def test_from_an_epochs_end_another_first_batch_is_drift_and_no_record_is_unverified(
    tmp_path, uninterrupted, monkeypatch, capsys
):
    """The controls from an epoch's end: the catching up switched off, the resumed epoch draws another
    order than the saved run trained after the save — drift, not bit-equal; a run interrupted right at
    its epoch-end save (before it trained a batch after it) left no record — unverified, never exact."""
    assert fit(str(tmp_path / "a"), "epoch", (1, 1)) is None
    monkeypatch.setattr(_DataIterations, "catch_up", lambda self, saved: 0)
    with pytest.raises(AssertionError, match="arrays differ"):
        assert_bit_equal(fit(str(tmp_path / "a"), "epoch", check="warn"), uninterrupted)
    err = capsys.readouterr().err
    assert "resume audit: DRIFT" in err and "is not the one the saved run trained after the save" in err, err[-2000:]
    monkeypatch.undo()
    assert fit(str(tmp_path / "b"), "epoch", (1, 0)) is None
    assert_bit_equal(fit(str(tmp_path / "b"), "epoch", check="warn"), uninterrupted)
    err = capsys.readouterr().err
    assert "resume audit: unverified" in err and "recorded nothing it drew after it" in err, err[-2000:]


def test_without_making_the_saved_runs_iterators_the_resume_is_drift_never_exact(
    tmp_path, uninterrupted, monkeypatch, capsys
):
    """The control: the same resume with the catching up switched off draws epoch 0's order again —
    not bit-equal, said as drift, and refused under resume_check="raise" before a batch trains."""
    monkeypatch.setattr(_DataIterations, "catch_up", lambda self, saved: 0)
    assert fit(str(tmp_path), 5, (1, 7)) is None
    from ckptstore.errors import ResumeDriftError

    with pytest.raises(ResumeDriftError, match="the batch before the resumed position"):
        fit(str(tmp_path), 5)
    resumed = fit(str(tmp_path), 5, check="warn")
    with pytest.raises(AssertionError, match="arrays differ"):
        assert_bit_equal(resumed, uninterrupted)
    err = capsys.readouterr().err
    assert "resume audit: DRIFT" in err and "resume audit: exact" not in err, err[-2000:]
