"""The parts of peer replicas one at a time: the blob server (its token, its paths), the filesystem over
it (a copy pulled through it verifies, a damaged one is refused), the ring, the options, and the
service's record of blob servers and peer copies."""

from __future__ import annotations

import os
import uuid

import httpx
import numpy as np
import pytest

from ckptstore import Position, Store
from ckptstore.client.engine.options import CheckpointOptions
from ckptstore.client.peers.blob_server import HELD, HELD_DIR, OWN, BlobServer
from ckptstore.client.peers.filesystem import peer_store
from ckptstore.client.peers.ring import held_by, holders_of
from ckptstore.errors import CorruptCheckpointError, StorageUnavailableError
from tests.builders import commit_body, declare


@pytest.fixture
def served(tmp_path):
    """A local tier with one committed copy of j/n0 at epoch 1, served by a blob server."""
    local = Store(str(tmp_path / "local"), tier="local")
    arrays = {"w": np.arange(50_000, dtype=np.float32), "b": np.ones(7)}
    local.write(local.key("j", "n0", Position(1), 1).on("local"), arrays, step=5)
    server = BlobServer(local.url, "j", host="127.0.0.1")
    yield local, server, arrays
    server.close()


def test_a_blob_server_answers_its_token_only_and_never_outside_its_root(served, tmp_path):
    local, server, _ = served
    manifest = f"{server.url}/{OWN}/j/n0/0000000001/1/MANIFEST.json"
    assert httpx.get(manifest).status_code == 401
    assert httpx.get(manifest, headers={"Authorization": "Bearer " + "x" * 43}).status_code == 401
    auth = {"Authorization": f"Bearer {server.token}"}
    assert httpx.get(manifest, headers=auth).status_code == 200
    ranged = httpx.get(manifest, headers=auth | {"Range": "bytes=2-9"})
    assert ranged.status_code == 206 and ranged.content == httpx.get(manifest, headers=auth).content[2:10]
    (tmp_path / "secret").write_text("outside")
    os.symlink(tmp_path / "secret", os.path.join(local.url, "j", "link"))
    os.makedirs(os.path.join(local.url, HELD_DIR, "j"))
    assert httpx.get(manifest, headers=auth | {"Range": "bytes=9-2"}).status_code == 416
    local.write(local.key("other", "n0", Position(1), 1).on("local"), {"x": np.ones(3)})  # another job, same root
    for path in (
        "/own/../secret",
        "/own/%2e%2e/secret",
        "/own/j/link",
        f"/own/{HELD_DIR}/j",
        "/own/other/n0/0000000001/1/MANIFEST.json",
        "/own?list",
        "/etc/passwd",
        "/",
    ):
        assert httpx.get(server.url + path, headers=auth).status_code == 404, path
    listed = httpx.get(f"{server.url}/{OWN}/j/n0", params={"list": ""}, headers=auth).json()
    assert {entry["name"] for entry in listed} == {f"{OWN}/j/n0/.blobs", f"{OWN}/j/n0/0000000001"}


def test_a_copy_pulled_through_a_blob_server_verifies_and_a_damaged_one_is_refused(served, tmp_path):
    local, server, arrays = served
    source = peer_store(server.url, server.token, OWN)
    held = Store(os.path.join(local.url, HELD_DIR), tier="peer")
    key = source.manifest_keys("j", "n0")[-1]
    held.copy_from(source, key, verify="sizes")
    restored = peer_store(server.url, server.token, HELD).read_copy(key)
    assert all(restored.arrays[name].tobytes() == value.tobytes() for name, value in arrays.items())

    blobs = os.path.join(local.url, "j", "n0", ".blobs")
    blob = max((os.path.join(blobs, name) for name in os.listdir(blobs)), key=os.path.getsize)
    with open(blob, "r+b") as handle:
        handle.seek(-8, os.SEEK_END)
        handle.write(b"\xff" * 8)
    other = Store(str(tmp_path / "other"), tier="peer")
    with pytest.raises(CorruptCheckpointError):
        other.copy_from(source, key, verify="sizes")
    assert other.manifest_keys("j", "n0") == [], "nothing committed from a damaged source"


def test_a_blob_server_gone_is_an_outage_not_a_verdict(served):
    _, server, _ = served
    source = peer_store(server.url, server.token, OWN)
    server.close()
    with pytest.raises(StorageUnavailableError):
        source.manifest_keys("j", "n0")


def test_the_ring_gives_each_node_the_next_ones_and_never_itself():
    nodes = ["a", "b", "c", "d"]
    assert holders_of("a", nodes, 1) == ["b"] and holders_of("d", nodes, 2) == ["a", "b"]
    assert held_by("a", nodes, 1) == ["d"] and held_by("a", nodes, 2) == ["c", "d"]
    assert holders_of("a", ["a"], 3) == [] and holders_of("a", ["a", "b"], 5) == ["b"]
    assert holders_of("x", nodes, 1) == []


def test_peer_replicas_need_a_local_tier_and_the_service(monkeypatch, tmp_path):
    common = {"job": "j", "storage": str(tmp_path)}
    with pytest.raises(ValueError, match="needs local_storage"):
        CheckpointOptions.resolve(**common, service="http://127.0.0.1:1", peer_replicas=1)
    with pytest.raises(ValueError, match="needs local_storage"):
        CheckpointOptions.resolve(**common, local_storage=str(tmp_path / "l"), peer_replicas=1)
    with pytest.raises(ValueError, match="non-negative"):
        CheckpointOptions.resolve(**common, peer_replicas=-1)
    monkeypatch.setenv("CKPTSTORE_PEER_REPLICAS", "2")
    options = CheckpointOptions.resolve(**common, local_storage=str(tmp_path / "l"), service="http://127.0.0.1:1")
    assert options.peer_replicas == 2


def test_the_service_records_blob_servers_and_peer_copies_of_the_jobs_nodes(service):
    job = f"peers-{uuid.uuid4().hex[:6]}"
    with service.client() as http:
        declare(http, service.storage, job, ["n0", "n1"], local_root="/local")
        url = f"/v1/jobs/{job}/nodes/n1/blob-server"
        token = "t" * 43
        assert http.put(url, json={"url": "http://10.0.0.2:4100", "token": token}).status_code == 200
        assert http.put(url, json={"url": "http://10.0.0.3:4101", "token": token}).status_code == 200
        servers = http.get(f"/v1/jobs/{job}/blob-servers").json()
        assert [(s["node"], s["url"]) for s in servers] == [("n1", "http://10.0.0.3:4101")], "the newest replaces"
        for bad in ({"url": "file:///etc", "token": token}, {"url": "http://h:1", "token": "short"}):
            assert http.put(url, json=bad).status_code == 422, bad
        unknown = http.put(f"/v1/jobs/{job}/nodes/n9/blob-server", json={"url": "http://h:1", "token": token})
        assert unknown.status_code == 422

        commits = f"/v1/jobs/{job}/nodes/n0/checkpoints"
        for holder in ("n9", "n1/../n0"):
            body = commit_body(f"peer://{holder}", job, "n0", 1, tier="peer")
            assert http.post(commits, json=body).status_code == 422, holder
        body = commit_body("peer://n1", job, "n0", 1, tier="peer")
        assert http.post(commits, json=body).status_code == 201
        other = commit_body(service.storage, job, "n1", 1)
        assert http.post(f"/v1/jobs/{job}/nodes/n1/checkpoints", json=other).status_code == 201
        answer = http.get(f"/v1/jobs/{job}/last-good-epoch", params={"node": "n0"}).json()
        copies = answer["nodes"]["n0"]["copies"]
        assert [(c["tier"], c["location"]) for c in copies] == [("peer", body["location"])]


def test_a_holder_pulls_a_nodes_newest_attempt_records_it_and_keeps_the_newest_few(sqlite_service, tmp_path):
    from ckptstore.client import ServiceClient
    from ckptstore.client.peers.replication import PeerReplicator
    from ckptstore.client.service.wire import commit_request

    job = f"pull-{uuid.uuid4().hex[:6]}"
    owner = Store(str(tmp_path / "owner"), tier="local")
    for epoch, attempt in ((2, 1), (3, 1), (1, 2)):  # attempt 2 resumed from epoch 0: its epoch 1 is the newest
        key = owner.key(job, "n0", Position(epoch), attempt).on("local")
        owner.write(key, {"w": np.full(1000, epoch * 10 + attempt, np.float32)})
    server = BlobServer(owner.url, job, host="127.0.0.1")
    held = Store(str(tmp_path / "holder" / HELD_DIR), tier="peer")
    commits, marks = [], []
    with ServiceClient(sqlite_service.live.url) as client:
        client.put_job(job, ["n0", "n1"], storage_root=sqlite_service.storage, local_root=owner.url)
        client.register_blob_server(job, "n0", server.url, server.token)
        replicator = PeerReplicator(
            held=held,
            client=client,
            job=job,
            node="n1",
            sources=["n0"],
            keep=1,
            commit=commits.append,
            mark=lambda *marked: marks.append(marked),
        )
        try:
            replicator._pull_newest("n0")
            assert [(k.position.epoch, k.attempt) for k in held.manifest_keys(job, "n0")] == [(1, "2")]
            key = owner.key(job, "n0", Position(4), 2).on("local")
            owner.write(key, {"w": np.zeros(1000, np.float32)})
            replicator._pull_newest("n0")
        finally:
            server.close()
        assert [(k.position.epoch, k.attempt) for k in held.manifest_keys(job, "n0")] == [(4, "2")], "keep=1"
        assert [(m[0].position.epoch, m[1], m[2]) for m in marks] == [(1, "deleted", "retention")]
        locations = [commit_request(c).location for c in commits]
        assert locations == [f"peer://n1/{job}/n0/0000000001/2", f"peer://n1/{job}/n0/0000000004/2"]
        recorded = client.commit_many(job, commits)
        assert all(not isinstance(r, Exception) and r.tier == "peer" for r in recorded), recorded
