"""Peer replicas (`peer_replicas=N`): each committed local copy also kept on another node's local tier,
so that a node back on a new machine restores from a peer's disk, not the durable tier. Real
processes: two gloo ranks with local tiers, the durable tier on moto behind nginx, which logs every S3
request — what a rerun read from S3 is counted, not assumed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

import pytest

from ckptstore import Position, Store
from tests.servers import S3RequestLog
from tests.test_torch import ROOT, assert_bit_equal, final, ranks

pytestmark = pytest.mark.s3

KILLED_AT = ["--kill-epoch", "1", "--kill-batch", "7"]  # rank 0 dies there; its newest copy is 1.b6


@pytest.fixture(scope="module")
def s3_log(moto_s3, tmp_path_factory):
    upstream = moto_s3.endpoint_url.removeprefix("http://")
    log = S3RequestLog(str(tmp_path_factory.mktemp("s3-log")), upstream)
    yield log
    log.stop()


class PeerJob:
    """One per-rank job of two ranks with a local tier under `tmp`, peer_replicas=1 and the durable tier
    on S3 through `s3_log`. On one machine the ranks share the local root, as the ranks of one host do
    (the job declares one local root): rank 0's disk is its own folder and the copies it holds for rank 1
    (`.peers/<job>/node-1`), rank 1's the rest."""

    def __init__(self, tmp, service_url: str, s3_log: S3RequestLog, bucket: str):
        self.tmp, self.s3_log, self.service_url = tmp, s3_log, service_url
        self.job = f"peers-{uuid.uuid4().hex[:6]}"
        self.storage = f"s3://{bucket}/{self.job}"
        self.local = str(tmp / "local")

    def args(self, *more: str, peers: str = "1") -> list[str]:
        return [
            "--per-rank",
            "--job",
            self.job,
            "--storage",
            self.storage,
            "--endpoint",
            self.s3_log.endpoint_url,
            "--service",
            self.service_url,
            "--local-storage",
            self.local,
            "--peer-replicas",
            peers,
            *more,
        ]

    def killed(self) -> None:
        """Run until rank 0 dies at 1.b7 (its manager waits until 1.b6 is on rank 1's disk first)."""
        ranks(self.tmp, 2, *self.args(*KILLED_AT), killed_rank=0)

    def new_machine_for_rank_0(self) -> None:
        """Rank 0 comes back on a machine whose disk holds nothing of the job."""
        shutil.rmtree(os.path.join(self.local, self.job, "node-0"))
        shutil.rmtree(os.path.join(self.local, ".peers", self.job, "node-1"), ignore_errors=True)

    def blob_reads(self, since: int, node: str = "node-0") -> list[str]:
        """The S3 GETs of `node`'s tensor blobs logged after the first `since` requests."""
        blobs = f"/{self.job}/{node}/.blobs/"
        return [line for line in self.s3_log.requests()[since:] if line.startswith("GET ") and blobs in line]

    def held_blob(self) -> str:
        """The largest blob rank 1 holds for node-0."""
        folder = os.path.join(self.local, ".peers", self.job, "node-0", ".blobs")
        return max((os.path.join(folder, name) for name in os.listdir(folder)), key=os.path.getsize)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, sqlite_service, s3_log, moto_s3):
    """The uninterrupted run's final state, per rank."""
    tmp = tmp_path_factory.mktemp("peers-baseline")
    job = PeerJob(tmp, sqlite_service.live.url, s3_log, moto_s3.bucket)
    return [final(output) for output in ranks(tmp, 2, *job.args())]


@pytest.fixture
def peer_job(tmp_path, sqlite_service, s3_log, moto_s3) -> PeerJob:
    return PeerJob(tmp_path, sqlite_service.live.url, s3_log, moto_s3.bucket)


def rerun(job: PeerJob, baseline: list, peers: str = "1") -> list[str]:
    """The job run again to its end: both ranks resume at 1.b6, each bit-equal to the uninterrupted run."""
    resumed = ranks(job.tmp, 2, *job.args(peers=peers))
    assert [r.splitlines()[0] for r in resumed] == ["RESUMED 1 6", "RESUMED 1 6"]
    for got, want in zip(resumed, baseline, strict=True):
        assert_bit_equal(final(got), want)
    return resumed


def test_a_new_machine_restores_from_the_peer_replica_and_reads_no_blob_from_s3(peer_job, baseline, sqlite_service):
    peer_job.killed()
    with sqlite_service.client() as http:
        records = http.get(f"/v1/jobs/{peer_job.job}/checkpoints", params={"node": "node-0", "epoch": 1}).json()
    held = [r["location"] for r in records if r["tier"] == "peer" and r["batch"] == 6]
    assert held and held[0].startswith("peer://node-1/"), records
    peer_job.new_machine_for_rank_0()
    since = len(peer_job.s3_log.requests())
    resumed = rerun(peer_job, baseline)
    assert "(peer copy" in resumed[0], resumed[0][-3000:]
    assert "node-0 keeps the copies of node-1, which runs on the same machine" in resumed[0], "said: one host here"
    assert peer_job.blob_reads(since) == [], "rank 0 read no tensor blob from S3"


def test_a_damaged_peer_replica_is_said_and_the_restore_reads_the_durable_tier(peer_job, baseline):
    peer_job.killed()
    peer_job.new_machine_for_rank_0()
    with open(peer_job.held_blob(), "r+b") as handle:
        handle.seek(-100, os.SEEK_END)
        byte = handle.read(1)
        handle.seek(-100, os.SEEK_END)
        handle.write(bytes([byte[0] ^ 0x10]))
    since = len(peer_job.s3_log.requests())
    resumed = rerun(peer_job, baseline)
    assert "(durable copy" in resumed[0] and "(peer) corrupt" in resumed[0], resumed[0][-3000:]
    assert peer_job.blob_reads(since), "the durable tier was read instead"


def stand_in_peer(job: PeerJob, *more: str) -> subprocess.Popen:
    """Rank 1's disk served by a process of its own, registered as node-1's blob server."""
    command = [sys.executable, "-m", "tests.peer_server", "--root", job.local, "--service", job.service_url]
    command += ["--job", job.job, "--node", "node-1", *more]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().startswith("READY "), "the stand-in started"
    return process


def test_a_peer_dying_mid_transfer_is_passed_over_for_the_durable_tier(peer_job, baseline):
    peer_job.killed()
    peer_job.new_machine_for_rank_0()
    peer = stand_in_peer(peer_job, "--die-in-blob")
    try:
        since = len(peer_job.s3_log.requests())
        # rank 1 runs without peers, so the stand-in stays node-1's registered server
        resumed = rerun(peer_job, baseline, peers="1,0")
        assert peer.wait(timeout=60) == -9, "the peer died mid-transfer"
    finally:
        peer.kill()
    assert "(durable copy" in resumed[0] and "went away" in resumed[0], resumed[0][-3000:]
    assert "no node that keeps this node's copies is running" in resumed[0], "the end of the run does not wait"
    assert peer_job.blob_reads(since)


def test_prestage_from_a_peer_fills_a_new_local_tier_and_nothing_is_read_from_s3(peer_job, baseline):
    peer_job.killed()
    peer_job.new_machine_for_rank_0()
    since = len(peer_job.s3_log.requests())
    peer = stand_in_peer(peer_job)
    try:
        cli = os.path.join(os.path.dirname(sys.executable), "ckptstore")
        staged = subprocess.run(
            [cli, "prestage", peer_job.job, "--node", "node-0", "--to", peer_job.local]
            + ["--url", peer_job.service_url],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        peer.kill()
    assert staged.returncode == 0, staged.stderr
    assert f"peer://node-1/{peer_job.job}/node-0/" in staged.stdout, staged.stdout + staged.stderr  # its source
    local = Store(peer_job.local, tier="local")
    assert local.copies(peer_job.job, "node-0", Position(1, 6)), "staged into the new local tier"
    resumed = rerun(peer_job, baseline)
    assert "(local copy" in resumed[0], resumed[0][-3000:]
    assert peer_job.blob_reads(since) == [], "neither the prestage nor the rerun read a tensor blob from S3"
