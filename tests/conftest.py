"""Shared fixtures: real storage backends (local disk, moto S3, GCS emulator) as session servers."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.servers import GcsEmulator, MotoS3  # noqa: I001  (sets env before gcsfs is imported)


@dataclass
class Backend:
    """A storage root URL on one backend plus the options to open it; a fresh prefix per test."""

    name: str
    url: str
    options: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    server = MotoS3()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[GcsEmulator]:
    server = GcsEmulator()
    yield server
    server.stop()


@pytest.fixture(params=["local", "s3", "gcs"])
def backend(request: pytest.FixtureRequest, tmp_path) -> Backend:
    """Each contract test runs on every backend, against a real server where there is one."""
    prefix = uuid.uuid4().hex
    if request.param == "local":
        return Backend("local", str(tmp_path / prefix))
    if request.param == "s3":
        server = request.getfixturevalue("moto_s3")
        return Backend("s3", f"s3://{server.bucket}/{prefix}", dict(server.options))
    server = request.getfixturevalue("gcs_emulator")
    return Backend("gcs", f"gs://{server.bucket}/{prefix}", dict(server.options))
