"""The public API: each package re-exports its names, and the core stays free of web/framework imports."""

from __future__ import annotations

import subprocess
import sys
import typing

import ckptstore
import ckptstore.errors


def test_core_exports_are_importable():
    for name in ckptstore.__all__:
        assert getattr(ckptstore, name) is not None, name
    for name in ckptstore.errors.__all__:
        error = getattr(ckptstore.errors, name)
        if name == "Failure":  # the kinds a StorageUnavailableError carries, beside the tree
            assert set(typing.get_args(error)) == {"missing", "denied", "misconfigured", "unavailable"}
            continue
        assert issubclass(error, ckptstore.CkptStoreError), name


def test_error_tree_matches_the_design():
    assert issubclass(ckptstore.ServiceUnavailableError, ckptstore.ServiceError)
    assert issubclass(ckptstore.RequestRejectedError, ckptstore.ServiceError)
    assert ckptstore.RequestRejectedError(409, "fenced", "newer attempt").status == 409


def test_importing_the_core_pulls_in_no_web_or_framework_module():
    code = (
        "import sys, ckptstore, ckptstore.retention; "
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('fastapi','starlette','uvicorn','sqlalchemy','tensorflow','keras','server','client','s3fs','gcsfs')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_unreachable_storage_reports_not_accessible(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    report = ckptstore.Store(str(blocker / "root")).accessible()
    assert not report.ok and report.latency_ms is None and "Error" in report.error
