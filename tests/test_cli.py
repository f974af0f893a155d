"""Every `ckptstore` subcommand against a real service on loopback and real storage (local disk,
moto S3), with its exit codes and --json output."""

from __future__ import annotations

import json
import os
import uuid

import numpy as np
import pytest

from ckptstore import CopyKey, Position, Store
from ckptstore.client.cli.main import main
from ckptstore.client.service.rest import ServiceClient
from tests.conftest import service_settings
from tests.live import LiveService

NODES = ["n0", "n1"]


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def cli_json(capsys, *argv: str):
    code, out, err = cli(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def make_job(url: str, job: str, root: str, *, epochs: int = 4, attempts: int = 1, retention=None) -> None:
    """A two-node job: `attempts` process starts per node, each committing `epochs` epochs in turn."""
    store = Store(root)
    with ServiceClient(url) as client:
        client.put_job(job, NODES, storage_root=root, retention=retention)
        epoch = 0
        for _ in range(attempts):
            for node in NODES:
                attempt = client.start_attempt(job, node)
                for e in range(epoch, epoch + epochs):
                    arrays = {"w": np.full(256, e, np.float32), "b": np.arange(e + 1, dtype=np.int64)}
                    ref = store.save(job, node, e, arrays, attempt=attempt, metadata={"metrics": {"loss": 1 / (e + 1)}})
                    client.commit(ref, metrics={"loss": 1 / (e + 1)})
            epoch += epochs


@pytest.fixture
def local_job(sqlite_service, job_name):
    make_job(sqlite_service.live.url, job_name, sqlite_service.storage)
    return sqlite_service.live.url, job_name, sqlite_service.storage


def shard_path(root: str, job: str, node: str, epoch: int, attempt: str = "1") -> str:
    store, key = Store(root), CopyKey(job, node, Position(epoch), attempt)
    return store._storage.path(store.manifest(key).shards[0].key(key.relpath))


def test_jobs_epochs_and_last_good_in_text_and_json(capsys, local_job):
    url, job, _ = local_job
    jobs = cli_json(capsys, "jobs", "--url", url, "--limit", "1000")
    assert {"job": job, "last_good_epoch": 3} in [{k: j[k] for k in ("job", "last_good_epoch")} for j in jobs]
    records = cli_json(capsys, "epochs", job, "--url", url)
    assert sorted((r["node"], r["epoch"]) for r in records) == [(n, e) for n in NODES for e in range(4)]
    assert {r["node"] for r in cli_json(capsys, "epochs", job, "--node", "n1", "--url", url)} == {"n1"}
    answer = cli_json(capsys, "last-good", job, "--url", url)
    assert answer["epoch"] == 3 and set(answer["nodes"]) == set(NODES)
    assert cli_json(capsys, "last-good", job, "--max-epoch", "1", "--url", url)["epoch"] == 1
    code, out, _ = cli(capsys, "last-good", job, "--url", url)
    assert code == 0 and "last good epoch: 3" in out
    code, out, _ = cli(capsys, "epochs", job, "--url", url)
    assert code == 0 and len(out.splitlines()) == 1 + 8


def test_exit_codes_for_not_found_usage_and_an_unreachable_service(capsys, sqlite_service, job_name, tmp_path):
    url = sqlite_service.live.url
    assert cli(capsys, "epochs", job_name, "--url", url)[0] == 3
    assert cli(capsys, "last-good", job_name, "--url", url)[0] == 3
    with ServiceClient(url) as client:
        client.put_job(job_name, NODES)
    assert cli(capsys, "last-good", job_name, "--url", url)[0] == 3, "no good epoch yet"
    assert cli(capsys, "verify", job_name, "--url", url)[0] == 3, "nothing to verify"
    assert cli(capsys, "inspect", f"{tmp_path}/{job_name}/n0/0000000001/1")[0] == 3
    assert cli(capsys, "epochs", "bad name!", "--url", url)[0] == 2
    assert cli(capsys, "inspect", f"{tmp_path}/not-a-checkpoint")[0] == 2
    with pytest.raises(SystemExit) as usage:
        main(["epochs"])
    assert usage.value.code == 2
    code, _, err = cli(capsys, "jobs", "--url", "http://127.0.0.1:9")
    assert code == 1 and "cannot be used" in err


def test_inspect_shows_the_manifest(capsys, local_job):
    _, job, root = local_job
    location = Store(root).location(CopyKey(job, "n0", Position(2), "1"))
    manifest = cli_json(capsys, "inspect", location)
    assert (manifest["epoch"], manifest["attempt"], manifest["metadata"]["metrics"]) == (2, "1", {"loss": 1 / 3})
    code, out, _ = cli(capsys, "inspect", location)
    assert code == 0 and "2 tensors" in out and "F32" in out and "[256]" in out


def test_verify_catches_a_flipped_byte_and_the_service_stops_counting_it(capsys, local_job):
    url, job, root = local_job
    assert cli(capsys, "verify", job, "--url", url)[0] == 0
    path = shard_path(root, job, "n1", 3)
    with open(path, "r+b") as handle:
        handle.seek(os.path.getsize(path) - 5)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x01]))
    assert cli(capsys, "verify", job, "1", "--url", url)[0] == 0, "epoch 1 alone is intact"
    code, out, _ = cli(capsys, "verify", job, "--url", url, "--json")
    assert code == 1
    bad = [r for r in json.loads(out) if not r["ok"]]
    assert [(r["node"], r["epoch"], r["state"], r["marked"]) for r in bad] == [("n1", 3, "corrupt", "corrupt")]
    assert bad[0]["problems"][0]["kind"] == "checksum_mismatch"
    assert cli_json(capsys, "last-good", job, "--url", url)["epoch"] == 2


def test_gc_runs_the_plan_and_removes_leftovers_and_superseded_attempts(capsys, sqlite_service, job_name):
    url, root = sqlite_service.live.url, sqlite_service.storage
    make_job(url, job_name, root, epochs=3, retention={"keep_last": 1, "grace_seconds": 60})
    store = Store(root)
    # An uncommitted leftover of attempt 1 and a superseded attempt 1 at epoch 2 (attempt 2 re-saved it).
    leftover = store.location(CopyKey(job_name, "n0", Position(7), "1"))
    os.makedirs(leftover)
    with open(f"{leftover}/shard-00000.safetensors", "wb") as handle:
        handle.write(b"partial")
    with ServiceClient(url) as client:
        attempt = client.start_attempt(job_name, "n1")
        client.commit(store.save(job_name, "n1", 2, {"w": np.zeros(4, np.float32)}, attempt=attempt))
    old = os.path.getmtime(leftover) - 3600
    for directory, _, files in os.walk(os.path.join(root, job_name)):
        for name in files:
            os.utime(os.path.join(directory, name), (old, old))
    planned = cli_json(capsys, "gc", job_name, "--dry-run", "--url", url)
    reasons = sorted((r["node"], r["position"], r["attempt"], r["reason"]) for r in planned)
    assert ("n0", "7", "1", "uncommitted") in reasons
    assert ("n1", "2", "1", "superseded") in reasons
    assert {(n, p) for n, p, _, why in reasons if why == "retention"} == {(n, p) for n in NODES for p in ("0", "1")}
    assert os.path.isdir(leftover), "a dry run deletes nothing"
    assert cli(capsys, "gc", job_name, "--url", url)[0] == 0
    assert not os.path.exists(leftover)
    assert [i.key.attempt for i in store.list_checkpoints(job_name, "n1") if i.key.position.epoch == 2] == ["2"]
    assert store.list_positions(job_name, "n0") == store.list_positions(job_name, "n1")
    assert [p.epoch for p in store.list_positions(job_name, "n0")] == [2]
    assert cli_json(capsys, "last-good", job_name, "--url", url)["epoch"] == 2
    assert cli_json(capsys, "gc", job_name, "--dry-run", "--url", url) == [], "nothing left to collect"


def test_reindex_after_losing_the_database_restores_last_good_and_attempt_counters(capsys, tmp_path):
    root = str(tmp_path / "storage")
    first = LiveService(service_settings(str(tmp_path), f"sqlite:///{tmp_path}/first.db"))
    job = f"lost-{uuid.uuid4().hex[:6]}"
    make_job(first.url, job, root, epochs=2, attempts=2)
    with ServiceClient(first.url) as client:
        third = client.start_attempt(job, "n0")  # a third start of n0 that died mid-save
    leftover = Store(root).location(CopyKey(job, "n0", Position(4), third))
    os.makedirs(leftover)
    with open(f"{leftover}/shard-00000.safetensors", "wb") as handle:
        handle.write(b"partial")
    with ServiceClient(first.url) as client:
        before = client.last_good_epoch(job)
        counters = {a.node: int(a.attempt) for a in client.list_attempts(job)}
    first.stop()
    second = LiveService(service_settings(str(tmp_path), f"sqlite:///{tmp_path}/second.db"))
    try:
        code, out, _ = cli(capsys, "reindex", root, "--check", "--url", second.url, "--json")
        assert code == 1
        (report,) = json.loads(out)
        assert report["created"] and len(report["missing_in_service"]) == 8 and not report["applied"]
        assert cli(capsys, "last-good", job, "--url", second.url)[0] == 3, "--check writes nothing"
        assert cli(capsys, "reindex", root, "--url", second.url)[0] == 0
        with ServiceClient(second.url) as client:
            after = client.last_good_epoch(job)
            assert (after.epoch, after.resume) == (before.epoch, before.resume)
            assert after.nodes == before.nodes
            assert client.start_attempt(job, "n1") == str(counters["n1"] + 1)
            assert client.start_attempt(job, "n0") == str(counters["n0"] + 1), "the leftover of attempt 3 counts"
        assert cli_json(capsys, "reindex", root, "--check", "--url", second.url)[0]["counters_behind"] == {}
        _, out, _ = cli(capsys, "reindex", root, "--check", "--url", second.url)
        assert "0 difference(s)" in out
    finally:
        second.stop()


def test_copy_from_s3_to_local_is_verified_on_arrival(capsys, sqlite_service, moto_s3, monkeypatch, tmp_path, job_name):
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    s3_root = f"s3://{moto_s3.bucket}/{uuid.uuid4().hex[:8]}"
    make_job(sqlite_service.live.url, job_name, s3_root, epochs=2)
    local = str(tmp_path / "copy")
    copied = cli_json(capsys, "copy", f"{s3_root}/{job_name}", local)
    assert len(copied) == 4
    copy = Store(local)
    assert all(copy.verify(job_name, n, e).ok for n in NODES for e in range(2))
    assert copy.load(job_name, "n1", 1)["w"].tolist() == [1.0] * 256
    assert len(cli_json(capsys, "copy", f"{s3_root}/{job_name}", local)) == 4, "a re-run is a verified no-op"
    one = Store(s3_root).location(CopyKey(job_name, "n0", Position(0), "1"))
    assert cli_json(capsys, "copy", one, str(tmp_path / "one"))[0]["source"] == one
    assert cli(capsys, "copy", f"{s3_root}/no-such-job", local)[0] == 3
