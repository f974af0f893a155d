"""Hardening, fourth pass (issue 48): each finding with a test that fails without its fix.

- URL-2: a request asks for a URL's life; it gets at most the service's configured one.
- FP-1: a fingerprint read from storage is untrusted: a malformed one is drift, never a crash — in a
  restore (the training goes on, or refuses under resume_check="raise") and in `ckptstore diff`.
- Leftovers: retention's reason is said once ("retention: retention" before); `s3//ckpt/jobs` is refused
  (it became a relative folder `s3/`).
(D57, the start's line about copies the service had no record of: tests/test_resume_truth.py.)
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

from ckptstore import Position, Store
from ckptstore.client import ServiceClient
from ckptstore.fingerprint import FINGERPRINT_KEY, differences
from ckptstore.format.layout import position_dirname
from tests.conftest import service_settings
from tests.live import LiveService

CLI = os.path.join(os.path.dirname(sys.executable), "ckptstore")


def test_a_url_lives_at_most_as_long_as_the_service_says(tmp_path, moto_s3):
    options = {f"s3://{moto_s3.bucket}": moto_s3.options}
    settings = service_settings(str(tmp_path), f"sqlite:///{tmp_path}/db", storage_options=options)
    live = LiveService(settings.model_copy(update={"url_expiry_seconds": 60}))
    try:
        with live.client() as http:
            job = f"expiry-{uuid.uuid4().hex[:6]}"
            body = {"nodes": ["n0"], "storage_root": f"s3://{moto_s3.bucket}/{job}"}
            assert http.put(f"/v1/jobs/{job}", json=body).status_code == 201
            assert http.post(f"/v1/jobs/{job}/nodes/n0/attempts", json={}).status_code == 201
            key = f"{job}/n0/{position_dirname(Position(0))}/1/x"
            for asked, given in ((43200, 60), (30, 30), (None, 60)):
                wanted = {"attempt": "1", "objects": [{"method": "GET", "key": key}]}
                if asked is not None:
                    wanted["expires_s"] = asked
                answer = http.post(f"/v1/jobs/{job}/nodes/n0/urls", json=wanted)
                assert answer.status_code == 200, answer.text
                assert answer.json()["expires_s"] == given
                assert f"X-Amz-Expires={given}&" in answer.json()["urls"][0]["url"] + "&"
    finally:
        live.stop()


SAVED = {
    "framework": {"name": "torch", "versions": {"torch": "2.13.0"}},
    "world": {"size": 2, "rank": 0},
    "seed": 1,
    "rng_ranks": 2,
    "objects": {"model": {"type": "Linear", "arrays": {"weight": "float32[2,4]"}}},
    "data": {},
}


@pytest.mark.parametrize(
    "field, value",
    [
        ("world", "8"),
        ("framework", "torch"),
        ("rng_ranks", "2"),
        ("objects", {"model": "Linear"}),
        ("objects", ["model"]),
        ("data", {"loader": 7}),
        ("rank_seeds", 3),
    ],
)
def test_a_malformed_fingerprint_is_drift_never_an_exception(field, value):
    live = copy.deepcopy(SAVED) | {"data": {"loader": {"type": "DataLoader", "batch_size": 8}}}
    saved = copy.deepcopy(SAVED) | {field: value}
    found = differences(saved, live)
    assert found == [f for f in found if "fingerprint is malformed" in f] and len(found) == 1, found
    assert differences(copy.deepcopy(SAVED), live) == [], "the well-formed one is exact"


def _torch_manager(storage: str, job: str, **options):
    import torch
    from torch import nn

    from ckptstore.client.torch import CheckpointManager

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return CheckpointManager(
        objects={"model": model, "optimizer": optimizer}, storage=storage, job=job, node="n0", **options
    )


def test_a_restore_from_a_copy_with_a_malformed_fingerprint_is_drift_and_diff_says_so(tmp_path, capsys):
    pytest.importorskip("torch")
    storage, job = str(tmp_path / "ckpt"), f"fp-{uuid.uuid4().hex[:6]}"
    mgr = _torch_manager(storage, job, async_save=False)
    mgr.restore_or_initialize()
    mgr.save(0)
    mgr.close()
    store = Store(storage)
    loaded = store.load(job, "n0", 0)
    (first,) = store.manifest_keys(job, "n0")
    metadata = dict(store.manifest(first).metadata)
    metadata[FINGERPRINT_KEY] = dict(metadata[FINGERPRINT_KEY]) | {"world": "8", "framework": "torch"}
    store.save(job, "n0", 1, dict(loaded), attempt="9", metadata=metadata)  # verifies: a well-formed manifest
    warned = _torch_manager(storage, job)
    assert warned.restore_or_initialize() == 2, "the training goes on (resume_check='warn')"
    assert warned.audit is not None and warned.audit.verdict == "drift"
    assert "fingerprint is malformed" in warned.audit.differences[0]
    warned.close()
    from ckptstore.errors import ResumeDriftError

    with pytest.raises(ResumeDriftError, match="malformed"):
        _torch_manager(storage, job, resume_check="raise").restore_or_initialize()
    a, b = store.location(first), store.location(store.key(job, "n0", Position(1), "9"))
    result = subprocess.run([CLI, "diff", job, a, b], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "malformed" in result.stdout, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr


def test_retention_says_its_reason_once(tmp_path, sqlite_service):
    from ckptstore.client.engine.node import NodeCheckpointer

    job = f"reason-{uuid.uuid4().hex[:6]}"
    node = NodeCheckpointer(
        storage=sqlite_service.storage, service=sqlite_service.live.url, job=job, node="n0", max_to_keep=1
    )
    try:
        node.start()
        for epoch in range(3):
            node.save(Position(epoch), {"w": np.full(4, epoch, np.float32)})
            node.wait()
        node.reports.drain(timeout=30)
    finally:
        node.close()
    with ServiceClient(sqlite_service.live.url) as client:
        deleted = client.list_checkpoints(job, state="deleted")
    assert deleted and {(r.cause, r.reason) for r in deleted} == {("retention", "outside the job's retention policy")}


@pytest.mark.parametrize("mistyped", ["s3//ckpt/jobs", "gs//bucket/jobs", "s3:/ckpt/jobs"])
def test_a_mistyped_storage_url_is_refused(mistyped, tmp_path, monkeypatch):
    from ckptstore.client.engine.options import CheckpointOptions

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="did you mean"):
        CheckpointOptions.resolve(storage=mistyped, job="j")
    assert not os.listdir(tmp_path), "nothing written"
    assert CheckpointOptions.resolve(storage="runs//2026", job="j").storage == "runs//2026", "a folder of that name"


def test_a_decompression_bomb_is_found_short_before_its_claim_is_allocated():
    """CODEC-1: an encoded blob's decoded size comes from its manifest. A small frame claiming far more
    than it decodes to is refused having held one piece at a time; one decoding to more than its claim
    is stopped there. Under an address-space limit below the claim it is still "corrupt" (ValueError),
    never MemoryError (a subprocess with RLIMIT_AS at 1.5 GiB, claiming 8 GiB)."""
    import tracemalloc

    import zstandard

    from ckptstore.format.codec import decode

    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (64 << 20))
    assert len(bomb) < 64 << 10
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="decodes to"):
            decode(bomb, 512 << 20)
        assert tracemalloc.get_traced_memory()[1] < 48 << 20, "at most a few pieces held, never the claim"
    finally:
        tracemalloc.stop()
    with pytest.raises(ValueError, match="more than"):
        decode(bomb, 1 << 20)
    limited = (
        "import resource, zstandard\n"
        "resource.setrlimit(resource.RLIMIT_AS, (3 << 29, 3 << 29))\n"
        "from ckptstore.format.codec import decode\n"
        "bomb = zstandard.ZstdCompressor(level=19, write_content_size=False).compress(bytes(16 << 20))\n"
        "try:\n"
        "    decode(bomb, 8 << 30)\n"
        "except ValueError as exc:\n"
        "    print('corrupt:', exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", limited], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "corrupt: decodes to" in result.stdout, result.stdout + result.stderr


def test_an_audit_is_the_newest_attempt_s_about_a_position_it_has_and_is_never_rewritten(sqlite_service):
    """AUDIT-2: a fenced attempt cannot overwrite its drift with "exact"; an audit for a position the
    node never had is refused; "exact" with a difference is not an audit; the same report again is a no-op."""

    job = f"audit-{uuid.uuid4().hex[:6]}"
    with ServiceClient(sqlite_service.live.url) as client, sqlite_service.live.client() as http:
        client.put_job(job, nodes=["n0"], storage_root=sqlite_service.storage)
        first = client.start_attempt(job, "n0")
        store = Store(sqlite_service.storage)
        client.commit(store.save(job, "n0", 0, {"w": np.ones(2)}, attempt=first))
        drift = {"position": {"epoch": 0}, "verdict": "drift", "differences": ["seed: 1 → 2"]}
        path = f"/v1/jobs/{job}/nodes/n0/attempts/{first}/audit"
        assert http.put(path, json=drift).status_code == 200
        assert http.put(path, json=drift).status_code == 200, "the same report again"
        rewritten = {"position": {"epoch": 0}, "verdict": "exact", "differences": []}
        answer = http.put(path, json=rewritten)
        assert answer.status_code == 409 and answer.json()["error"] == "conflict", answer.text
        lying = {"position": {"epoch": 0}, "verdict": "exact", "differences": ["seed: 1 → 2"]}
        assert http.put(path, json=lying).status_code == 422
        second = client.start_attempt(job, "n0")
        fenced = http.put(path, json=rewritten)
        assert fenced.status_code == 409 and fenced.json()["error"] == "fenced", fenced.text
        never = {"position": {"epoch": 7, "batch": 3}, "verdict": "exact", "differences": []}
        answer = http.put(f"/v1/jobs/{job}/nodes/n0/attempts/{second}/audit", json=never)
        assert answer.status_code == 422 and "no checkpoint at" in answer.text, answer.text
        attempts = {a.attempt: a for a in client.list_attempts(job)}
        assert attempts[first].audit is not None and attempts[first].audit.verdict == "drift"


def test_a_fork_needs_a_right_to_its_parent_a_good_fork_point_and_reads_only_that(tmp_path, moto_s3):
    """FORK-1: with beta's token alone, `PUT /v1/jobs/beta` forked from alpha is 403 (it would read alpha's
    bytes and pin alpha's retention); with alpha's token beside it (or the admin token) it is declared;
    the fork point must be a good position of alpha; beta's URLs then reach alpha's copies at the fork
    point and blobs by id — not alpha's other positions, nor a listing of alpha's pool."""
    from ckptstore.format.layout import blob_key, blob_pool

    tokens = {"alpha": "alpha-" + uuid.uuid4().hex, "beta": "beta-" + uuid.uuid4().hex}
    options = {f"s3://{moto_s3.bucket}": moto_s3.options}
    root = f"s3://{moto_s3.bucket}/fork-{uuid.uuid4().hex[:6]}"
    settings = service_settings(
        str(tmp_path),
        f"sqlite:///{tmp_path}/db",
        storage_options=options,
        token="admin-" + uuid.uuid4().hex,
        job_tokens=tokens,
    )
    live = LiveService(settings)
    as_ = {job: {"Authorization": f"Bearer {token}"} for job, token in tokens.items()}
    try:
        with live.client() as http:
            assert (
                http.put(
                    "/v1/jobs/alpha", json={"nodes": ["n0"], "storage_root": root}, headers=as_["alpha"]
                ).status_code
                == 201
            )
            for epoch in (1, 2):
                assert http.post("/v1/jobs/alpha/nodes/n0/attempts", json={}, headers=as_["alpha"]).status_code == 201
                body = {
                    "epoch": epoch,
                    "attempt": str(epoch),
                    "location": f"{root}/alpha/n0/{position_dirname(Position(epoch))}/{epoch}",
                    "bytes": 1,
                    "checksums": {},
                }
                assert (
                    http.post("/v1/jobs/alpha/nodes/n0/checkpoints", json=body, headers=as_["alpha"]).status_code == 201
                )
            fork = {"nodes": ["n0"], "storage_root": root, "parent": {"job": "alpha", "position": {"epoch": 1}}}
            refused = http.put("/v1/jobs/beta", json=fork, headers=as_["beta"])
            assert refused.status_code == 403 and "X-Ckptstore-Parent-Token" in refused.text, refused.text
            wrong = http.put(
                "/v1/jobs/beta", json=fork, headers=as_["beta"] | {"X-Ckptstore-Parent-Token": tokens["beta"]}
            )
            assert wrong.status_code == 403
            never = fork | {"parent": {"job": "alpha", "position": {"epoch": 1, "batch": 7}}}
            shown = as_["beta"] | {"X-Ckptstore-Parent-Token": tokens["alpha"]}
            assert http.put("/v1/jobs/beta", json=never, headers=shown).status_code == 422, "not a good position"
            assert http.get("/v1/jobs/alpha/gc-plan", headers=as_["alpha"]).status_code == 200
            assert http.put("/v1/jobs/beta", json=fork, headers=shown).status_code == 201
            assert http.post("/v1/jobs/beta/nodes/n0/attempts", json={}, headers=as_["beta"]).status_code == 201

            def ask(method: str, key: str) -> int:
                wanted = {"attempt": "1", "objects": [{"method": method, "key": key}]}
                return http.post("/v1/jobs/beta/nodes/n0/urls", json=wanted, headers=as_["beta"]).status_code

            at_fork = f"alpha/n0/{position_dirname(Position(1))}/1/MANIFEST.json"
            later = f"alpha/n0/{position_dirname(Position(2))}/2/MANIFEST.json"
            assert ask("GET", at_fork) == 200 and ask("LIST", f"alpha/n0/{position_dirname(Position(1))}") == 200
            assert ask("GET", blob_key("alpha", "n0", "ab" * 16)) == 200, "a blob, by the id a manifest names"
            assert ask("GET", later) == 403, "not alpha's other positions"
            assert ask("LIST", blob_pool("alpha", "n0")) == 403, "nor a listing of alpha's pool"
            assert ask("LIST", "alpha/n0") == 403
        with ServiceClient(live.url, token=tokens["beta"]) as beta:  # the Python client sends the header
            from ckptstore.wire.schema import ForkPoint, PositionBody

            point = ForkPoint(job="alpha", position=PositionBody(epoch=1))
            declared = beta.put_job("beta", ["n0"], storage_root=root, parent=point, parent_token=tokens["alpha"])
            assert declared.parent is not None
    finally:
        live.stop()


def test_a_fork_s_parent_is_the_job_it_was_forked_from_not_a_new_job_of_its_name(sqlite_service):
    """FORK-2: fork beta from alpha, forget alpha, declare a new alpha: beta reads nothing of the new
    alpha (no ancestor, no URL scope), and the new alpha's retention is not pinned by beta."""
    from ckptstore.wire.schema import ForkPoint, PositionBody

    alpha, beta = f"alpha-{uuid.uuid4().hex[:6]}", f"beta-{uuid.uuid4().hex[:6]}"
    store = Store(sqlite_service.storage)
    with ServiceClient(sqlite_service.live.url) as client:
        client.put_job(alpha, ["n0"], storage_root=sqlite_service.storage)
        client.commit(store.save(alpha, "n0", 1, {"w": np.ones(2)}, attempt=client.start_attempt(alpha, "n0")))
        point = ForkPoint(job=alpha, position=PositionBody(epoch=1))
        client.put_job(beta, ["n0"], storage_root=sqlite_service.storage, parent=point)
        assert [a.job for a in client.lineage(beta).ancestors] == [alpha]
        assert [c.job for c in client.lineage(alpha).children] == [beta]
        client.delete_job(alpha)
        again = f"{sqlite_service.storage}/again"  # the new alpha's own storage: its attempts start at 1 again
        client.put_job(alpha, ["n0"], storage_root=again, retention={"keep_last": 1})
        for epoch in (1, 2, 3):
            attempt = client.start_attempt(alpha, "n0")
            client.commit(Store(again).save(alpha, "n0", epoch, {"w": np.full(2, epoch)}, attempt=attempt))
        assert client.lineage(beta).ancestors == [], "the new alpha is not beta's parent"
        assert client.lineage(alpha).children == []
        planned = {(d.epoch, d.batch) for d in client.retention_plan(alpha).deletions}
        assert (1, None) in planned, "the new alpha's epoch 1 is not pinned by the old alpha's child"


def test_a_start_that_cannot_see_its_copies_waits_then_refuses_and_a_new_job_starts_at_once(moto_s3, sqlite_service):
    """D36, D15: the durable tier does not answer at a restart. A job with checkpoints waits for it
    (`storage_wait_s`, said) and is then refused with ResumeRefusedError — never trained from scratch
    over copies it cannot see — unless fresh_start=True; a new job (the service holds none of its
    checkpoints) starts at once and says so. What a start spends on the dead endpoint is bounded."""
    import time

    from ckptstore.client.engine.node import NodeCheckpointer
    from ckptstore.errors import ResumeRefusedError
    from tests.servers import free_port

    root = f"s3://{moto_s3.bucket}/dead-{uuid.uuid4().hex[:6]}"
    dead = {"endpoint_url": f"http://127.0.0.1:{free_port()}", "key": "testing", "secret": "testing"}
    dead["config_kwargs"] = {"retries": {"max_attempts": 1}, "connect_timeout": 1}
    url, job = sqlite_service.live.url, f"unseen-{uuid.uuid4().hex[:6]}"
    with ServiceClient(url) as client:
        client.put_job(job, ["n0"], storage_root=root)
        store = Store(root, storage_options=moto_s3.options)
        client.commit(store.save(job, "n0", 0, {"w": np.ones(2)}, attempt=client.start_attempt(job, "n0")))

    def start(name: str, **options) -> tuple[float, object]:
        node = NodeCheckpointer(storage=root, storage_options=dead, service=url, job=name, node="n0", **options)
        began = time.monotonic()
        try:
            return time.monotonic() - began, node.start()
        except ResumeRefusedError as exc:
            return time.monotonic() - began, exc
        finally:
            node.close()

    took, refused = start(job, storage_wait_s=2)
    assert isinstance(refused, ResumeRefusedError), refused
    assert "cannot see its copies" in str(refused) and "fresh_start=True" in str(refused)
    assert took < 30, f"a dead endpoint held the start {took:.0f} s"
    took, fresh = start(job, storage_wait_s=2, fresh_start=True)
    assert fresh is None and took < 30
    took, new = start(f"new-{uuid.uuid4().hex[:6]}", storage_wait_s=600)
    assert new is None and took < 30, f"a new job waited {took:.0f} s for storage it has nothing on"
