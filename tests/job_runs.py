"""Running a training job module of tests/ as its own process, SIGKILLed or to its end, and
comparing its final state with an uninterrupted run's (the framework tests: JAX, Hugging Face,
Lightning)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np

from ckptstore import Position

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def job_parser() -> argparse.ArgumentParser:
    """The arguments every job module takes: --storage, --job, --out, --kill-at."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--storage", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-at", type=int, default=None)
    return parser


def run_job(module: str, out_dir: Path, *args: str, kill_at: int | None = None) -> tuple[str, dict[str, np.ndarray]]:
    """`python -m tests.<module> --out OUT.npz ARGS`: (its stderr, the arrays it wrote); with `kill_at`,
    asserts it was SIGKILLed (and returns no arrays)."""
    out = str(out_dir / f"{uuid.uuid4().hex[:6]}.npz")
    command = [sys.executable, "-m", f"tests.{module}", "--out", out, *args]
    command += [] if kill_at is None else ["--kill-at", str(kill_at)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if kill_at is not None:
        assert result.returncode == -9, result.stderr[-3000:]
        return result.stderr, {}
    assert result.returncode == 0, result.stderr[-3000:]
    with np.load(out) as archive:
        return result.stderr, {key: archive[key] for key in archive.files}


def documented_block(path: str, after: str, placeholders: dict[str, str]) -> str:
    """The first ```python block after the text `after` in the file at `path` (relative to the project),
    with each placeholder replaced (asserted present: a changed block fails loudly, not quietly)."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
        text = handle.read()
    code = re.search(r"```python\n(.*?)```", text[text.index(after) :], re.S).group(1)
    for placeholder, value in placeholders.items():
        assert placeholder in code, f"{path}: the block after {after!r} no longer has {placeholder!r}"
        code = code.replace(placeholder, value)
    return code


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray], *, at_least: int) -> None:
    """The same names, and every array the same bytes and dtype."""
    assert sorted(got) == sorted(want) and len(want) >= at_least
    different = [
        key for key, value in want.items() if got[key].dtype != value.dtype or got[key].tobytes() != value.tobytes()
    ]
    assert not different, different[:5]


def resumed_position(stderr: str) -> Position:
    """The position the process's resume line names."""
    match = re.search(r"resumed from epoch (\d+)(?: batch (\d+))?", stderr)
    assert match is not None, stderr[-2000:]
    return Position(int(match.group(1)), None if match.group(2) is None else int(match.group(2)))


def damage_own_blob(storage: str, job: str, newest: Position, previous: Position) -> None:
    """Flip a bit in the largest blob the copy at `newest` holds and the copy at `previous` does not."""
    from ckptstore import Store

    store = Store(storage)
    manifest = store.manifest(store.copies(job, "n0", newest)[-1])
    before = {s.file for s in store.manifest(store.copies(job, "n0", previous)[-1]).shards}
    shard = max((s for s in manifest.shards if s.file not in before), key=lambda s: s.bytes)
    path = os.path.join(storage, shard.file)
    with open(path, "rb") as handle:
        data = bytearray(handle.read())
    data[-3] ^= 0x10
    with open(path, "wb") as handle:
        handle.write(bytes(data))


def settled_verdict(output: str) -> str:
    """A resume's settled verdict (`exact`, `resharded`, `drift`, `unverified`): its proof's where there
    is one, else the resume line's (in output whose lines may be joined with " | ")."""
    said = re.findall(r"resume audit: ([^\n|]+)", output)
    assert said, f"no resume audit said: {output[-2000:]}"
    settled = [s for s in said if not s.startswith("the declared state matches")] or said
    last = settled[-1]
    return "drift" if last.startswith("DRIFT") else re.split(r"[ ,(:—]", last, maxsplit=1)[0]
