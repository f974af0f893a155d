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


# -- the metadata service, on SQLite and on PostgreSQL ------------------------------------------


@dataclass
class Service:
    """A live service plus what tests need to know about it."""

    name: str
    live: Any
    storage: str

    def client(self, **kwargs):
        return self.live.client(**kwargs)


def service_settings(tmp: str, db_url: str, **overrides) -> Any:
    from ckptstore.server.settings import Settings

    storage = f"{tmp}/storage"
    return Settings(
        **{"db_url": db_url, "storage": storage, "storage_roots": f"{storage},s3://ckpt,memory://ckpt"} | overrides
    )


@pytest.fixture(scope="session")
def sqlite_service(tmp_path_factory) -> Iterator[Service]:
    from tests.live import LiveService

    tmp = str(tmp_path_factory.mktemp("sqlite-service"))
    live = LiveService(service_settings(tmp, f"sqlite:///{tmp}/service.db"))
    yield Service("sqlite", live, f"{tmp}/storage")
    live.stop()


@pytest.fixture(scope="session")
def postgres_service(tmp_path_factory) -> Iterator[Service]:
    from tests.live import LiveService, ScratchPostgres, postgres_available

    if not postgres_available():
        pytest.fail("PostgreSQL is not reachable on 127.0.0.1:5432 and could not be started")
    database = ScratchPostgres()
    tmp = str(tmp_path_factory.mktemp("pg-service"))
    live = LiveService(service_settings(tmp, database.url))
    yield Service("postgres", live, f"{tmp}/storage")
    live.stop()
    database.drop()


@pytest.fixture(params=["sqlite", "postgres"])
def service(request) -> Service:
    """Each service test runs against SQLite and PostgreSQL."""
    return request.getfixturevalue(f"{request.param}_service")


@pytest.fixture
def job_name() -> str:
    return f"job-{uuid.uuid4().hex[:12]}"
