"""A restart is right or loud (issue 28): the reproductions, with real processes (tests/counter_job.py,
SIGKILL), a real service on loopback, and moto behind a proxy that can be switched off. None of them
may train again from scratch, or stall, with exit code 0 and not a word."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from ckptstore import Position, Store
from ckptstore.client import ServiceClient
from tests.conftest import service_settings
from tests.faults import FaultProxy
from tests.live import LiveService

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def counter_job(tmp_path, storage: str, job: str, *args: str, timeout: float = 180, **env: str):
    """Run tests.counter_job to its end (or its kill); (process, the batches it trained)."""
    log = tmp_path / f"{job}-{uuid.uuid4().hex[:6]}.log"
    result = subprocess.run(
        [sys.executable, "-m", "tests.counter_job", "--storage", storage, "--job", job, "--log", str(log), *args],
        cwd=ROOT,
        env=os.environ | env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = log.read_text().split("\n") if log.exists() else []
    return result, [tuple(float(v) if "." in v else int(v) for v in line.split()) for line in lines if line]


def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckptstore.client.cli.main", *argv], cwd=ROOT, capture_output=True, text=True
    )


def test_a_job_declared_with_a_count_refuses_a_process_named_otherwise_at_start(tmp_path, sqlite_service):
    url, job, storage = sqlite_service.live.url, f"count-{uuid.uuid4().hex[:6]}", sqlite_service.storage
    declared = cli("jobs", "declare", job, "--nodes", "2", "--storage-root", storage, "--url", url)
    assert declared.returncode == 0 and "nodes node-0, node-1" in declared.stdout and "RANK=i" in declared.stdout
    result, trained = counter_job(tmp_path, storage, job, "--service", url, "--node", "myhost")
    assert result.returncode != 0 and trained == [], "refused before the first batch"
    assert "ConfigurationError" in result.stderr and "node-0, node-1" in result.stderr, result.stderr[-1500:]
    with ServiceClient(url) as client:
        assert client.get_job(job).nodes == ["node-0", "node-1"], "the node set never grows behind the user's back"


def test_a_node_set_naming_a_node_that_never_runs_refuses_the_restart_with_the_reason(tmp_path, sqlite_service):
    """node-0 trains alone in a job declared for two: nothing can become good. Its restart is refused,
    naming node-1 — not a silent start from scratch."""
    url, job, storage = sqlite_service.live.url, f"half-{uuid.uuid4().hex[:6]}", sqlite_service.storage
    assert cli("jobs", "declare", job, "--nodes", "2", "--storage-root", storage, "--url", url).returncode == 0
    killed, first = counter_job(tmp_path, storage, job, "--service", url, "--node", "node-0", "--kill-at", "1.5")
    assert killed.returncode == -9 and len(first) == 15
    again, trained = counter_job(tmp_path, storage, job, "--service", url, "--node", "node-0")
    assert again.returncode != 0 and trained == []
    assert "ResumeRefusedError" in again.stderr and "node-1 never started" in again.stderr, again.stderr[-1500:]
    anyway, trained = counter_job(tmp_path, storage, job, "--service", url, "--node", "node-0", "--fresh")
    assert anyway.returncode == 0 and "starts from scratch as asked (fresh_start)" in anyway.stderr
    assert trained[0][:2] == (0, 0)


def test_declaring_a_list_of_nodes_replaces_the_set_and_is_recorded(tmp_path, sqlite_service):
    url, job, storage = sqlite_service.live.url, f"list-{uuid.uuid4().hex[:6]}", sqlite_service.storage
    assert cli("jobs", "declare", job, "--nodes", "a,b", "--storage-root", storage, "--url", url).returncode == 0
    assert cli("jobs", "declare", job, "--nodes", "n0", "--storage-root", storage, "--url", url).returncode == 0
    result, trained = counter_job(tmp_path, storage, job, "--service", url)
    assert result.returncode == 0 and len(trained) == 30
    with ServiceClient(url) as client:
        assert client.get_job(job).nodes == ["n0"]
        assert client.last_good_epoch(job).epoch == 2
    with sqlite_service.client() as http:
        page = http.get("/v1/events", params={"format": "json", "job": job, "after": 0, "types": "job.updated"}).json()
    changed = [e["data"] for e in page["events"] if e["data"]["nodes_changed"]]
    assert [d["nodes"] for d in changed] == [1], "the change of the node set is an event"


def test_a_job_declared_without_its_storage_root_refuses_a_process_saving_elsewhere_at_start(tmp_path, sqlite_service):
    url, job = sqlite_service.live.url, f"root-{uuid.uuid4().hex[:6]}"
    assert cli("jobs", "declare", job, "--nodes", "n0", "--url", url).returncode == 0  # the service's default root
    elsewhere = f"{sqlite_service.storage}/elsewhere"
    result, trained = counter_job(tmp_path, elsewhere, job, "--service", url)
    assert result.returncode != 0 and trained == []
    assert "ConfigurationError" in result.stderr and "its declared storage root" in result.stderr
    assert elsewhere in result.stderr, "both roots are named"


@pytest.mark.parametrize("known", [False, True], ids=["new job", "known job"])
def test_checkpoints_written_while_the_service_was_away_are_resumed_from(tmp_path, known):
    settings = service_settings(str(tmp_path), f"sqlite:///{tmp_path}/svc.db")
    storage, job = settings.default_storage, f"away-{uuid.uuid4().hex[:6]}"
    live = LiveService(settings)
    port = live.port
    if known:  # two epochs recorded while the service was up
        result, _ = counter_job(tmp_path, storage, job, "--service", live.url, "--epochs", "2")
        assert result.returncode == 0
    live.stop()
    killed, _ = counter_job(tmp_path, storage, job, "--service", live.url, "--epochs", "4", "--kill-at", "3.5")
    assert killed.returncode == -9
    live = LiveService(settings, port=port)
    try:
        again, trained = counter_job(tmp_path, storage, job, "--service", live.url, "--epochs", "4")
        assert again.returncode == 0 and again.stdout.startswith("RESUMED 3 3"), again.stdout + again.stderr[-1500:]
        assert trained[0][:2] == (3, 3), "nothing committed is trained again"
        said = (
            rf"ckptstore: {job}/n0: (1 checkpoint copy|\d+ checkpoint copies) on storage had no record in the service"
        )
        assert re.search(said, again.stderr) and "recorded now" in again.stderr, again.stderr[-1500:]
        with ServiceClient(live.url) as client:
            assert client.last_good_epoch(job).epoch == 3
    finally:
        live.stop()


def steps_per_second(trained: list, start: float, end: float) -> float:
    return sum(start <= t < end for _, _, t in trained) / (end - start)


@pytest.mark.slow
@pytest.mark.s3
def test_a_12_second_s3_outage_costs_training_at_most_two_thirds_of_its_step_rate(tmp_path, moto_s3):
    proxy = FaultProxy(moto_s3.endpoint_url)
    storage = f"s3://{moto_s3.bucket}/outage-{uuid.uuid4().hex[:6]}"
    options = json.dumps(moto_s3.options | {"endpoint_url": proxy.endpoint_url})
    switched: dict[str, float] = {}

    def outage() -> None:
        time.sleep(6)  # the run is up and saving (the clock of this test, not a synchronisation)
        switched["off"] = time.time()
        proxy.rate, proxy.kinds = 1.0, ("reset",)
        time.sleep(12)
        proxy.rate = 0.0
        switched["on"] = time.time()

    switcher = threading.Thread(target=outage)
    switcher.start()
    try:
        args = ["--storage-options", options, "--epochs", "1", "--batches", "1400", "--save-every", "20"]
        result, trained = counter_job(tmp_path, storage, "outage", *args, "--batch-seconds", "0.02")
    finally:
        switcher.join()
        proxy.stop()
    assert result.returncode == 0, result.stderr[-2000:]
    before = steps_per_second(trained, trained[0][2], switched["off"])
    during = steps_per_second(trained, switched["off"], switched["on"])
    assert during >= before / 3, (before, during)
    assert "skipped: the save at" in result.stderr, "the outage is reported"
    assert "Task exception was never retrieved" not in result.stderr
    assert Store(storage, storage_options=moto_s3.options).latest("outage", "n0") == Position(0), "caught up"


@pytest.mark.s3
def test_a_dead_endpoint_from_the_start_refuses_or_with_fresh_start_trains_at_full_speed(tmp_path):
    """Storage-only, nothing can say whether copies wait there: the start waits (CKPTSTORE_STORAGE_WAIT_S)
    and refuses (exit 79); with fresh_start it trains at full speed and says nothing was saved."""
    from tests.servers import free_port

    dead = {"endpoint_url": f"http://127.0.0.1:{free_port()}", "key": "x", "secret": "x"}
    dead["config_kwargs"] = {"retries": {"max_attempts": 1}, "connect_timeout": 1}
    options = ["--storage-options", json.dumps(dead)]
    refused, trained = counter_job(tmp_path, "s3://ckpt/dead", "dead", *options, CKPTSTORE_STORAGE_WAIT_S="1")
    assert refused.returncode == 79 and not trained, refused.stderr[-2000:]
    assert "cannot see its copies" in refused.stderr and "waiting up to 1 s" in refused.stderr
    started = time.monotonic()
    result, trained = counter_job(tmp_path, "s3://ckpt/dead", "dead", *options, CKPTSTORE_FRESH_START="1")
    assert result.returncode == 0 and len(trained) == 30, result.stderr[-2000:]
    assert "does not answer now" in result.stderr, "said once at start"
    assert "0 of " in result.stderr and "nothing of this run can be resumed from" in result.stderr
    assert time.monotonic() - started < 60, "no stall: the end waits a little for the save still retrying"


@pytest.mark.parametrize("where", ["missing bucket", "root under a file"])
def test_permanent_misconfiguration_fails_before_the_first_batch_whatever_on_error_says(tmp_path, moto_s3, where):
    if where == "missing bucket":
        storage = f"s3://no-such-bucket-{uuid.uuid4().hex[:6]}/jobs"
        args = ["--storage-options", json.dumps(moto_s3.options)]
    else:
        (tmp_path / "file").write_text("a regular file")
        storage, args = str(tmp_path / "file" / "ckpt"), []
    result, trained = counter_job(tmp_path, storage, "misconfigured", *args)
    assert result.returncode != 0 and trained == [], "no batch trained"
    assert "ConfigurationError" in result.stderr and "cannot be used (misconfigured)" in result.stderr
    assert "the bucket must exist" in result.stderr, "the message names the fix"


def test_a_node_added_after_a_good_position_is_not_waited_for_when_resuming_from_it(sqlite_service, job_name):
    """The restore agreement waits for the nodes the resume position was judged with: a node declared
    since applies to later positions only (found by the restart property test: the restore hung)."""
    root = sqlite_service.storage
    with ServiceClient(sqlite_service.live.url) as client:
        client.put_job(job_name, ["n0"], storage_root=root)
        attempt = client.start_attempt(job_name, "n0")
        client.commit(Store(root).save(job_name, "n0", 0, {"w": [1.0]}, attempt=attempt))
        client.put_job(job_name, ["n0", "n1"], storage_root=root)
        again = client.start_attempt(job_name, "n0")
        client.report_resume(job_name, "n0", again, resumed_from=Position(0), skipped=[])
        agreement = client.resume_agreement(job_name)
        assert agreement.agreed and agreement.waiting == [], agreement


def test_copy_of_a_job_skips_a_bad_copy_and_copies_the_newer_intact_ones(tmp_path):
    source, target = str(tmp_path / "source"), str(tmp_path / "target")
    store = Store(source)
    refs = [store.save("job", "n0", epoch, {"w": [float(epoch)]}, attempt="1") for epoch in range(3)]
    shard = Path(refs[0].shard_locations[0])
    shard.write_bytes(shard.read_bytes()[:-2] + b"xx")
    result = cli("copy", f"{source}/job", target)
    assert result.returncode == 1 and "NOT COPIED" in result.stdout and "2 checkpoints copied" in result.stdout
    assert Store(target).list_epochs("job", "n0") == [1, 2], "the newer intact copies were copied"


def test_a_service_url_with_a_path_is_refused_at_construction(tmp_path):
    from ckptstore.client.engine.node import NodeCheckpointer

    with pytest.raises(ValueError, match="without a path such as '/v1'"):
        NodeCheckpointer(job="j", storage=str(tmp_path), service="http://127.0.0.1:8080/v1")


def test_the_resume_line_appears_only_once_the_state_is_in_place(tmp_path, capsys):
    from ckptstore.client.tensorflow.manager import CheckpointManager
    from ckptstore.client.tensorflow.state import StateMismatchError
    from tests.counter_job import Counter

    first = CheckpointManager(storage=str(tmp_path), job="mismatch", node="n0", objects={"model": Counter()})
    first.restore_or_initialize()
    first.save(0)
    first.close()
    wider = Counter()
    wider.array = wider.array.repeat(2)
    second = CheckpointManager(storage=str(tmp_path), job="mismatch", node="n0", objects={"model": wider})
    with pytest.raises(StateMismatchError):
        second.restore_or_initialize()
    assert "resumed from" not in capsys.readouterr().err, "no resume was announced: it failed"


def test_reindex_of_a_root_that_does_not_exist_fails_instead_of_finding_nothing(tmp_path, sqlite_service):
    result = cli("reindex", str(tmp_path / "no-such-root"), "--check", "--url", sqlite_service.live.url)
    assert result.returncode == 3 and "no storage root there" in result.stderr


def test_last_good_after_a_finished_fit_lists_no_deleted_positions_and_exits_0(tmp_path, sqlite_service):
    url, job = sqlite_service.live.url, f"done-{uuid.uuid4().hex[:6]}"
    from ckptstore.client.engine.node import NodeCheckpointer

    node = NodeCheckpointer(job=job, storage=sqlite_service.storage, service=url, node="n0", async_save=False)
    node.start()
    for epoch in range(3):
        node.save(Position(epoch), {"w": np.full(4, epoch, np.float32)})
    node.delete_all(cause="fit_finished", reason="fit finished")
    node.close()
    result = cli("last-good", job, "--url", url)
    assert result.returncode == 0 and "not good" not in result.stdout, result.stdout + result.stderr
    assert "deleted on purpose" in result.stderr
