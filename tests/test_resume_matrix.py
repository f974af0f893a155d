"""The resume matrix: every framework set-up as users write it × where the job dies — mid-epoch, at an
epoch's last batch, right after an epoch's end (its first batch after the epoch-end save trained) —
killed, run again, and compared with an uninterrupted run (every model and optimizer value): the
resume proof says `exact` only of a bit-equal resume, never `drift` of one, and `unverified` only
where the set-up hides its data (listed, and said). Real processes SIGKILLed (Keras over tf.data is
interrupted in this process, as a crash would end its fit)."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from tests.job_runs import run_job, settled_verdict

Kill = tuple[int, int]  # the job dies as it reaches (epoch, batch), or after that many steps: (step, 0)
Run = Callable[[Path, str, "Kill | None", pytest.CaptureFixture], "tuple[str, dict[str, np.ndarray]]"]
KILL_POINTS = ("mid-epoch", "last-batch", "after-epoch-end")


@dataclass(frozen=True)
class SetUp:
    """One framework set-up: how to run it (killed at a `kills` point, or to its end) — its output and
    final arrays —, the extras it needs, and where its resume is `unverified` (its data hidden)."""

    run: Run
    kills: dict[str, Kill]
    needs: tuple[str, ...]
    unverified: frozenset[str] = field(default_factory=frozenset)


def _by_batches(module: str, *flags: str) -> Run:
    """A job of tests/ killed before a batch (--kill-epoch/--kill-batch): the PyTorch loop, Keras' fit
    over NumPy arrays (as keras.io writes it) or a TF custom loop."""

    def run(tmp_path: Path, job: str, kill: Kill | None, capsys: pytest.CaptureFixture) -> tuple[str, dict]:
        from tests.test_torch import final
        from tests.test_torch import run_job as run_process

        args = [*flags, "--storage", str(tmp_path / "ckpt"), "--job", job]
        if kill is not None:
            run_process(
                tmp_path, *args, "--kill-epoch", str(kill[0]), "--kill-batch", str(kill[1]), killed=True, module=module
            )
            return "", {}
        output = run_process(tmp_path, *args, module=module)
        return output, final(output)

    return run


def _keras_tfdata(reshuffle: bool, save_freq: int | str = 5) -> Run:
    def run(tmp_path: Path, job: str, kill: Kill | None, capsys: pytest.CaptureFixture) -> tuple[str, dict]:
        from tests.keras_tfdata import fit

        capsys.readouterr()
        arrays = fit(str(tmp_path / job), save_freq, kill, check="warn", reshuffle=reshuffle)
        return capsys.readouterr().err, {} if arrays is None else {str(i): a for i, a in enumerate(arrays)}

    return run


def _by_steps(module: str, *flags: str) -> Run:
    """A job of tests/ killed after a number of optimizer steps (Lightning, Hugging Face, JAX)."""

    def run(tmp_path: Path, job: str, kill: Kill | None, capsys: pytest.CaptureFixture) -> tuple[str, dict]:
        args = ["--storage", str(tmp_path / "ckpt"), "--job", job, *flags]
        return run_job(module, tmp_path, *args, kill_at=None if kill is None else kill[0])

    return run


# 12 batches an epoch (Keras, torch, Lightning, HF), 8 (JAX); a copy every 3-6 batches and at each
# epoch's end. A kill (epoch, batch) lands before that batch trains; a kill (step, 0) after that step.
TORCH_KILLS = {"mid-epoch": (1, 7), "last-batch": (1, 11), "after-epoch-end": (2, 0)}  # (2, 0): its ids drawn
SETUPS: dict[str, SetUp] = {
    **{
        f"torch-{loader}": SetUp(
            _by_batches("tests.torch_job", "--loader", loader),
            TORCH_KILLS,
            ("torch",),
            # The loader outside objects: its batches are not seen, and mid-epoch not put back either.
            frozenset(KILL_POINTS) if loader == "unsaved" else frozenset(),
        )
        for loader in ("docs", "shuffle", "shuffle-gen", "plain", "stateful", "unsaved")
    },
    "keras-numpy": SetUp(
        _by_batches("tests.train_job", "--mode", "keras", "--save-freq", "4", "--as-users-write"),
        {"mid-epoch": (3, 6), "last-batch": (3, 11), "after-epoch-end": (3, 1)},
        ("tensorflow",),
    ),
    "keras-tfdata-reshuffling": SetUp(
        _keras_tfdata(reshuffle=True),
        {"mid-epoch": (1, 7), "last-batch": (1, 12), "after-epoch-end": (2, 1)},
        ("tensorflow",),
    ),
    "keras-tfdata-reshuffling-save-freq-epoch": SetUp(  # as the README recommended for such pipelines
        _keras_tfdata(reshuffle=True, save_freq="epoch"),
        {"mid-epoch": (1, 7), "last-batch": (1, 12), "after-epoch-end": (2, 1)},
        ("tensorflow",),
    ),
    "keras-tfdata-fixed": SetUp(
        _keras_tfdata(reshuffle=False),
        {"mid-epoch": (1, 7), "last-batch": (1, 12), "after-epoch-end": (2, 1)},
        ("tensorflow",),
    ),
    "tf-loop": SetUp(
        _by_batches("tests.train_job", "--mode", "loop"),
        {"mid-epoch": (3, 6), "last-batch": (3, 11), "after-epoch-end": (3, 1)},
        ("tensorflow",),
    ),
    **{
        f"lightning-{loader}": SetUp(
            _by_steps("lightning_job", "--every", "6", *(["--plain-loader"] if loader == "plain" else [])),
            {"mid-epoch": (20, 0), "last-batch": (24, 0), "after-epoch-end": (25, 0)},
            ("lightning",),
        )
        for loader in ("stateful", "plain")
    },
    "hf": SetUp(
        _by_steps("hf_job"),
        {"mid-epoch": (17, 0), "last-batch": (23, 0), "after-epoch-end": (25, 0)},
        ("transformers",),
    ),
    "jax": SetUp(
        _by_steps("jax_job"), {"mid-epoch": (13, 0), "last-batch": (16, 0), "after-epoch-end": (17, 0)}, ("optax",)
    ),
}
_UNINTERRUPTED: dict[str, dict[str, np.ndarray]] = {}


def bit_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> bool:
    return set(got) == set(want) and all(
        got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes() for k in want
    )


@pytest.mark.parametrize("setup,where", list(itertools.product(SETUPS, KILL_POINTS)))
def test_a_resume_is_called_exact_only_when_bit_equal_and_a_bit_equal_one_never_drift(setup, where, tmp_path, capsys):
    case = SETUPS[setup]
    for module in case.needs:
        pytest.importorskip(module, reason=f"the extra with {module} is not installed")
    if setup not in _UNINTERRUPTED:  # one uninterrupted run per set-up (a worker runs a whole file)
        _UNINTERRUPTED[setup] = case.run(tmp_path, f"base-{uuid.uuid4().hex[:6]}", None, capsys)[1]
    job = f"killed-{uuid.uuid4().hex[:6]}"
    case.run(tmp_path, job, case.kills[where], capsys)
    output, final = case.run(tmp_path, job, None, capsys)
    verdict, exact = settled_verdict(output), bit_equal(final, _UNINTERRUPTED[setup])
    assert not (verdict == "exact" and not exact), f"a false exact: {output[-3000:]}"
    assert not (exact and verdict == "drift"), f"a false drift: {output[-3000:]}"
    assert verdict == ("unverified" if where in case.unverified else "exact"), output[-3000:]
    # The premise: every set-up resumes bit-exactly but the loader outside objects, mid-epoch.
    assert exact == (setup != "torch-unsaved" or where == "after-epoch-end"), "the matrix's premise"
