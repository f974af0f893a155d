"""A bounded schemathesis run against the service's own OpenAPI document: no 5xx, and every
answer conforms to the documented schema (status codes, content type, body shape).

Driven through schemathesis' Python API (its pytest plugin does not support pytest 9 yet).
"""

from __future__ import annotations

import os

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# CI runs 25 per operation; the long run in bench/RESULTS.md sets CKPTSTORE_FUZZ_EXAMPLES=100.
EXAMPLES_PER_OPERATION = int(os.environ.get("CKPTSTORE_FUZZ_EXAMPLES", "25"))


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
