"""The storage-exception map (ckptstore/storage/failures.py): every exception class of every backend has a
kind, and real failures of real backends — local disk, moto's S3, the GCS emulator — are told apart:
an outage is transient, a missing bucket or a root under a file is a misconfiguration."""

from __future__ import annotations

import errno
import importlib
import inspect
import uuid

import pytest

from ckptstore import Store
from ckptstore.errors import StorageUnavailableError
from ckptstore.storage.failures import BY_CLASS, failure_of, failure_of_type
from tests.servers import free_port

BACKEND_MODULES = (
    "botocore.exceptions",
    "aiohttp.client_exceptions",
    "aiohttp.http_exceptions",
    "s3fs.errors",
    "gcsfs.retry",
    "google.auth.exceptions",
    "google.api_core.exceptions",
    "fsspec.exceptions",
    "requests.exceptions",
    "urllib3.exceptions",
)


@pytest.mark.parametrize("module", BACKEND_MODULES)
def test_every_exception_class_of_every_backend_has_a_kind(module):
    loaded = importlib.import_module(module)
    classes = [
        cls
        for _, cls in inspect.getmembers(loaded, inspect.isclass)
        if issubclass(cls, Exception) and cls.__module__ == module and not issubclass(cls, Warning)
    ]
    unmapped = [cls.__qualname__ for cls in classes if failure_of_type(cls) is None]
    assert not unmapped, f"{module}: no kind for {unmapped} (add them to ckptstore/storage/failures.py)"


def test_every_name_in_the_map_is_a_real_class():
    missing = []
    for name in BY_CLASS:
        module, _, qualname = name.rpartition(".")
        try:
            found = getattr(importlib.import_module(module), qualname)
        except (ImportError, AttributeError):
            missing.append(name)
            continue
        assert issubclass(found, BaseException), name
    assert not missing, f"names that no installed backend defines: {missing}"


def test_errors_that_are_not_the_backends_pass_through():
    assert failure_of(ValueError("a bug of ours")) is None
    assert failure_of(KeyError("x")) is None


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (FileNotFoundError(errno.ENOENT, "gone"), "missing"),
        (PermissionError(errno.EACCES, "no"), "denied"),
        (NotADirectoryError(errno.ENOTDIR, "a file on the way"), "misconfigured"),
        (OSError(errno.EREMCHG, "PermanentRedirect"), "misconfigured"),  # s3fs: the bucket is in another region
        (OSError(errno.EIO, "InternalError"), "unavailable"),
        (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), "unavailable"),
        (TimeoutError(), "unavailable"),
    ],
)
def test_os_errors_by_class_and_errno(error, kind):
    assert failure_of(error) == kind


def test_botocore_and_gcsfs_errors_by_the_code_they_carry():
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError
    from gcsfs.retry import HttpError

    def client_error(code: str) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": code}}, "PutObject")

    assert failure_of(client_error("NoSuchBucket")) == "misconfigured"
    assert failure_of(client_error("AccessDenied")) == "denied"
    assert failure_of(client_error("SlowDown")) == "unavailable"
    assert failure_of(NoCredentialsError()) == "denied"
    assert failure_of(EndpointConnectionError(endpoint_url="http://127.0.0.1:9")) == "unavailable"
    assert failure_of(HttpError({"code": 403, "message": "forbidden"})) == "denied"
    assert failure_of(HttpError({"code": 503, "message": "later"})) == "unavailable"


def test_a_root_under_a_regular_file_is_a_misconfiguration(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    report = Store(str(tmp_path / "file" / "ckpt")).accessible()
    assert not report.ok and report.failure == "misconfigured" and report.permanent, report


@pytest.mark.s3
def test_a_missing_bucket_is_a_misconfiguration_and_a_dead_endpoint_an_outage(moto_s3):
    missing = Store(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/jobs", storage_options=moto_s3.options)
    report = missing.accessible()
    assert not report.ok and report.failure == "misconfigured", report
    dead = {"endpoint_url": f"http://127.0.0.1:{free_port()}", "key": "x", "secret": "x"}
    dead["config_kwargs"] = {"retries": {"max_attempts": 1}, "connect_timeout": 1}
    report = Store("s3://ckpt/jobs", storage_options=dead).accessible(timeout=30)
    assert not report.ok and report.failure == "unavailable" and not report.permanent, report
    with pytest.raises(StorageUnavailableError) as raised:
        Store("s3://ckpt/jobs", storage_options=dead).save("j", "n", 0, {"w": [1.0]}, attempt=1)
    assert raised.value.failure == "unavailable" and not raised.value.permanent


@pytest.mark.gcs
def test_the_gcs_emulator_failures_have_kinds(gcs_emulator):
    store = Store(f"gs://no-such-bucket-{uuid.uuid4().hex[:8]}/jobs", storage_options=gcs_emulator.options)
    report = store.accessible()
    assert not report.ok and report.failure == "misconfigured", report  # its 404 on the write
