"""Bounded schemathesis runs against the service's own OpenAPI document: no 5xx, and every answer
conforms to the documented schema (status codes, content type, body shape) — one operation at a
time, and in stateful sequences that chain operations through the links schemathesis infers
(a job created by PUT is then read, committed to, queried and deleted; after the DELETE it is gone).

Driven through schemathesis' Python API (its pytest plugin does not support pytest 9 yet).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ensure_resource_availability,
    response_schema_conformance,
    status_code_conformance,
    use_after_free,
)

import tests.fuzz_hooks  # noqa: F401  (registers the hooks for the in-process run)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
STATEFUL_CHECKS = CHECKS + [use_after_free, ensure_resource_availability]
# CI runs 25 per operation and 20 s of sequences; bench/RESULTS.md's long run sets both higher.
EXAMPLES_PER_OPERATION = int(os.environ.get("CKPTSTORE_FUZZ_EXAMPLES", "25"))
ARTIFACTS = pathlib.Path(__file__).resolve().parent.parent / "test-artifacts" / "schemathesis"
STATEFUL_SECONDS = int(os.environ.get("CKPTSTORE_FUZZ_STATEFUL_SECONDS", "20"))


def test_no_server_errors_and_answers_match_the_schema(sqlite_service):
    schema = schemathesis.openapi.from_url(f"{sqlite_service.live.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15, "every route of the API is fuzzed"
    for operation in operations:

        @settings(
            max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        @given(case=operation.as_strategy())
        def call(case):
            case.call_and_validate(base_url=sqlite_service.live.url, checks=CHECKS)

        call()


@pytest.mark.slow  # a long run: scripts/test.sh -m slow runs it (the default run stays near 30 minutes)
def test_stateful_sequences_through_the_inferred_links(sqlite_service):
    """schemathesis' stateful phase, run by its CLI (its engine tolerates what a live service's state
    does to hypothesis' replays): chains of calls along the 54 links it infers from the schema.
    Its summary and JSON report go to test-artifacts/schemathesis/."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    report = ARTIFACTS / "stateful.json"
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"{sqlite_service.live.url}/openapi.json"]
    command += ["--phases", "stateful", "--checks", ",".join(check.__name__ for check in STATEFUL_CHECKS)]
    command += ["--max-examples", "40", "--max-time", str(STATEFUL_SECONDS), "--workers", "1"]
    command += ["--report", "json", "--report-json-path", str(report)]
    hooks = {"SCHEMATHESIS_HOOKS": "tests.fuzz_hooks", "PYTHONPATH": str(ARTIFACTS.parent.parent)}
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=STATEFUL_SECONDS + 120, cwd=ARTIFACTS, env=os.environ | hooks
    )
    (ARTIFACTS / "stateful.txt").write_text(result.stdout)
    summary = json.loads(report.read_text())
    assert result.returncode == 0 and not summary["failures"] and not summary["errors"], result.stdout[-6000:]
    assert summary["phases"]["stateful"]["status"] == "success"
    assert summary["test_cases"]["generated"] >= 100, summary["test_cases"]
    covered = re.search(r"API Links:\s+(\d+) covered", result.stdout)
    assert covered and int(covered.group(1)) >= 5, f"too few links followed:\n{result.stdout[-3000:]}"
