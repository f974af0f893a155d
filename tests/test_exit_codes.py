"""Refusals end a training process with codes a scheduler can act on (docs/operations.md, "Exit codes"):
78 ConfigurationError, 79 ResumeRefusedError, 80 ResumeDriftError, 81 FencedError — real processes,
nothing caught by the script. And the other way: any other error still ends with 1, a clean run with 0."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from ckptstore.client import ServiceClient
from ckptstore.client.engine.exit_codes import exit_code_of
from ckptstore.errors import ConfigurationError, FencedError, ResumeDriftError, ResumeRefusedError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("torch", reason="the [torch] extra is not installed")


def job_run(*args: str, pause: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "tests.refusal_job", *args]
    if pause is not None:
        command += ["--pause-after-first-save", pause]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_each_refusal_has_its_code_and_a_wrapped_one_too():
    assert [exit_code_of(e("x")) for e in (ConfigurationError, ResumeRefusedError, ResumeDriftError, FencedError)] == [
        78,
        79,
        80,
        81,
    ]
    try:
        try:
            raise FencedError("fenced")
        except FencedError as exc:
            raise RuntimeError("a framework's wrapper") from exc
    except RuntimeError as wrapped:
        assert exit_code_of(wrapped) == 81
    assert exit_code_of(ValueError("not ours")) is None


def test_a_missing_bucket_exits_78(moto_s3):
    result = job_run(
        "--storage", f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/jobs", "--endpoint", moto_s3.endpoint_url,
        "--job", f"missing-{uuid.uuid4().hex[:6]}",
    )  # fmt: skip
    assert result.returncode == 78, (result.returncode, result.stderr[-2000:])
    assert "ConfigurationError" in result.stderr and "STARTED" not in result.stdout


def test_a_drifted_resume_under_raise_exits_80_and_an_exact_one_runs_to_0(tmp_path):
    common = ["--storage", str(tmp_path / "ckpt"), "--job", f"drift-{uuid.uuid4().hex[:6]}"]
    first = job_run(*common)
    assert first.returncode == 0 and "SAVED 1" in first.stdout, first.stderr[-2000:]
    same = job_run(*common, "--resume-check", "raise")
    assert same.returncode == 0 and "STARTED 2" in same.stdout, same.stderr[-2000:]
    drifted = job_run(*common, "--optimizer", "adam", "--resume-check", "raise")
    assert drifted.returncode == 80, (drifted.returncode, drifted.stderr[-2000:])
    assert "ResumeDriftError" in drifted.stderr and "STARTED" not in drifted.stdout


def test_a_fenced_zombie_exits_81(tmp_path, sqlite_service):
    job = f"zombie-{uuid.uuid4().hex[:6]}"
    go = tmp_path / "go"
    command = [sys.executable, "-m", "tests.refusal_job", "--storage", sqlite_service.storage, "--job", job]
    command += ["--service", sqlite_service.live.url, "--pause-after-first-save", str(go)]
    zombie = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert zombie.stdout is not None
        lines = []
        for line in zombie.stdout:  # ends when the process does: no line "SAVED" means it failed first
            lines.append(line)
            if line.startswith("SAVED"):
                break
        assert lines and lines[-1].startswith("SAVED"), lines
        with ServiceClient(sqlite_service.live.url) as client:
            client.start_attempt(job, "n0")  # a replacement of the node starts: this process is a zombie
        go.touch()
        _, stderr = zombie.communicate(timeout=120)
    finally:
        zombie.kill()
    assert zombie.returncode == 81, (zombie.returncode, stderr[-2000:])
    assert "FencedError" in stderr


def test_any_other_error_still_exits_1(tmp_path):
    result = job_run("--storage", str(tmp_path / "ckpt"), "--job", "not a valid name!")
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
