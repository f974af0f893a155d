"""One storage-error boundary: an outage reaches every caller as StorageUnavailableError — on S3 with
the endpoint stopped mid-run, and on a local root whose filesystem turns read-only — and a missing
checkpoint stays CheckpointNotFoundError."""

from __future__ import annotations

import errno
import subprocess
import uuid
from pathlib import Path

import pytest

from ckptstore import CopyKey, Position, Store
from ckptstore.client.engine.node import NodeCheckpointer
from ckptstore.errors import CheckpointNotFoundError, ConfigurationError, StorageUnavailableError
from tests.builders import arrays_for, bit_equal
from tests.servers import tmpfs

NO_RETRIES = {"config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}}


def every_call_is_unavailable(store: Store) -> None:
    """Each public operation that touches storage raises StorageUnavailableError, naming the root."""
    calls = {
        "save": lambda: store.save("job", "n0", 1, arrays_for(1), attempt="1"),
        "load": lambda: store.load("job", "n0", 0),
        "read named": lambda: store.load("job", "n0", 0, attempt="1", names=["layer0"]),
        "manifest": lambda: store.manifest(CopyKey("job", "n0", Position(0), "1")),
        "list_positions": lambda: store.list_positions("job", "n0"),
        "list_jobs": lambda: store.list_jobs(),
        "next_attempt": lambda: store.next_attempt("job", "n0"),
        "verify": lambda: store.verify("job", "n0", 0, attempt="1"),
        "delete": lambda: store.delete("job", "n0", 0, attempt="1"),
    }
    for what, call in calls.items():
        with pytest.raises(StorageUnavailableError) as raised:
            call()
        assert store.url.split("://")[-1].split("/")[0] in str(raised.value), what
        assert raised.value.__cause__ is not None, f"{what}: raised from the backend's error"


@pytest.mark.s3
def test_s3_endpoint_stopped_mid_run_is_storage_unavailable_everywhere():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    options = {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing", **NO_RETRIES}
    root = f"s3://ckpt/boundary-{uuid.uuid4().hex[:8]}"
    store = Store(root, storage_options=options)
    try:
        store._storage.fs.mkdir("ckpt")
    except FileExistsError:
        pass
    store.save("job", "n0", 0, arrays_for(0), attempt="1")
    assert bit_equal(store.load("job", "n0", 0), arrays_for(0))
    server.stop()
    every_call_is_unavailable(store)
    assert not store.accessible(timeout=20).ok


@pytest.fixture
def read_only_later(tmp_path):
    """A tmpfs that a test can turn read-only."""
    with tmpfs(str(tmp_path / "fs"), "64m") as mountpoint:

        def make_read_only() -> None:
            subprocess.run(["mount", "-o", "remount,ro", mountpoint], check=True)

        yield Path(mountpoint), make_read_only


def test_a_local_root_turned_read_only_refuses_writes_as_unavailable_and_still_reads(read_only_later):
    mountpoint, make_read_only = read_only_later
    store = Store(str(mountpoint / "root"))
    store.save("job", "n0", 0, arrays_for(0), attempt="1")
    node = NodeCheckpointer(job="job", storage=store.url, node="n0", async_save=False)
    strict = NodeCheckpointer(job="job", storage=store.url, node="n0", async_save=False, on_error="raise")
    node.start(), strict.start()
    make_read_only()
    with pytest.raises(StorageUnavailableError) as raised:
        store.save("job", "n0", 1, arrays_for(1), attempt="1")
    assert raised.value.errno == errno.EROFS and "Read-only" in str(raised.value)
    with pytest.raises(StorageUnavailableError):
        store.delete("job", "n0", 0, attempt="1")
    assert bit_equal(store.load("job", "n0", 0), arrays_for(0)), "reads still work"
    assert store.list_positions("job", "n0") == [Position(0)]
    assert not store.accessible().ok
    node.save(Position(2), arrays_for(2))
    assert node.skipped_saves == 1, "on_error='warn': the save is skipped, training goes on"
    with pytest.raises(StorageUnavailableError):
        strict.save(Position(2), arrays_for(2))
    late = NodeCheckpointer(job="job", storage=store.url, node="n0", async_save=False)
    with pytest.raises(ConfigurationError, match="Read-only"):
        late.start()  # read-only from the start: refused before training, whatever on_error says


def test_missing_is_not_found_not_unavailable(tmp_path):
    store = Store(str(tmp_path / "root"))
    with pytest.raises(CheckpointNotFoundError):
        store.load("job", "n0", 0)
    with pytest.raises(CheckpointNotFoundError):
        store.verify("job", "n0", 0)
    assert store.list_positions("job", "n0") == []
