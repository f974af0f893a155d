"""cp_accessible: whether storage can be written, read back and cleaned up now, and if not, why.

A failure says what kind it is (`ckptstore.storage.failures`), so a start can tell a misconfiguration
(permanent: a missing bucket, a root under a file, access denied) from an outage (transient).
"""

from __future__ import annotations

import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from ckptstore.errors import StorageUnavailableError
from ckptstore.report import AccessReport
from ckptstore.storage.failures import failure_of
from ckptstore.storage.filesystem import Storage

__all__ = ["probe_access"]

# Probes run on these long-lived threads, so that a probe's timeout needs no thread started per call
# (~0.4-2 ms: a small checkpoint's whole restore is ~10 ms). A probe hung on a dead mount keeps its
# thread; once all are held, later probes time out in the queue, which is what that storage deserves.
_PROBES = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ckptstore-probe")


def probe_access(storage: Storage, *, timeout: float) -> AccessReport:
    """Write, read back and delete a probe object in the storage's probe folder; never raises."""
    relpath = f"{storage.probe_dir}/{secrets.token_hex(8)}"
    payload = b"ckptstore probe " + secrets.token_bytes(16)

    def probe() -> None:
        storage.make_prefix(storage.probe_dir)
        storage.write_object(relpath, [payload], len(payload))  # not published: nothing reads it but this
        try:
            if bytes(storage.read_object(relpath)) != payload:
                raise OSError("probe object read back different bytes")
        finally:
            storage.remove_file(relpath)

    started = time.perf_counter()
    try:
        _PROBES.submit(probe).result(timeout=timeout)
    except FutureTimeout:
        return AccessReport(False, None, f"storage did not answer within {timeout:g} s", "unavailable")
    except Exception as exc:  # any failure means "not accessible"; the text and kind say why
        cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
        failure = exc.failure if isinstance(exc, StorageUnavailableError) else failure_of(cause) or "unavailable"
        # A write that finds nothing to write into: the bucket (or the root's parent) does not exist.
        failure = "misconfigured" if failure == "missing" else failure
        return AccessReport(False, None, f"{type(exc).__name__}: {exc}", failure)
    return AccessReport(ok=True, latency_ms=round((time.perf_counter() - started) * 1000, 3))
