"""Forks: `fork_from="job@position"` starts a job from another job's checkpoint at the cost of what
changes, the service answers the lineage, and the parent's retention keeps the fork point."""

from __future__ import annotations

import os
import uuid

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ckptstore import Position, Store  # noqa: E402
from ckptstore.client import ServiceClient  # noqa: E402
from ckptstore.client.engine.fork import parse_fork_point  # noqa: E402


def lora_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A frozen 8 MiB base with a small trainable adapter (AdamW over the adapter only)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 8))
    model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, optimizer


def train_epoch(model: torch.nn.Module, optimizer: torch.optim.Optimizer, epoch: int) -> None:
    generator = torch.Generator().manual_seed(epoch)
    for _ in range(4):
        x = torch.randn(16, 1024, generator=generator)
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def pool_bytes(root: str, job: str, node: str) -> int:
    pool = os.path.join(root, job, node, ".blobs")
    return sum(os.path.getsize(os.path.join(pool, f)) for f in os.listdir(pool) if f.endswith(".safetensors"))


def manager(root: str, url: str, job: str, objects: dict, **options):
    from ckptstore.client.torch import CheckpointManager

    return CheckpointManager(
        storage=root, service=url, job=job, node="n0", objects=objects, async_save=False, **options
    )


def test_a_fork_starts_from_the_parent_checkpoint_writes_what_changed_and_restarts_as_itself(sqlite_service):
    root, url = sqlite_service.storage, sqlite_service.live.url
    parent, child = f"base-{uuid.uuid4().hex[:8]}", f"sweep-{uuid.uuid4().hex[:8]}"
    model, optimizer = lora_model(0)
    with manager(root, url, parent, {"model": model, "optimizer": optimizer}, max_to_keep=None) as mgr:
        for epoch in range(mgr.restore_or_initialize(), 4):
            train_epoch(model, optimizer, epoch)
            mgr.save(epoch)
            if epoch == 1:
                at_fork = {k: v.clone() for k, v in model.state_dict().items()}
    checkpoint_bytes = Store(root).manifest(Store(root).copies(parent, "n0", Position(3))[-1]).total_bytes

    fork_model, fork_optimizer = lora_model(1)  # another initialisation: everything comes from the parent
    objects = {"model": fork_model, "optimizer": fork_optimizer}
    with manager(root, url, child, objects, fork_from=f"{parent}@1") as mgr:
        assert mgr.restore_or_initialize() == 2, "the fork continues after the parent's epoch 1"
        for name, value in fork_model.state_dict().items():
            assert torch.equal(value, at_fork[name]), name
        for group in fork_optimizer.param_groups:
            group["lr"] = 1e-3  # the point of the fork
        train_epoch(fork_model, fork_optimizer, 2)
        mgr.save(2)
    written = pool_bytes(root, child, "n0")
    changed = 3 * sum(p.numel() * 4 for p in fork_model.parameters() if p.requires_grad)  # adapter + Adam m, v
    assert written <= changed + (16 << 10) <= 0.025 * checkpoint_bytes, f"{written} of {checkpoint_bytes} bytes"
    after_fork = {k: v.clone() for k, v in fork_model.state_dict().items()}

    again_model, again_optimizer = lora_model(2)
    objects = {"model": again_model, "optimizer": again_optimizer}
    with manager(root, url, child, objects, fork_from=f"{parent}@1") as mgr:
        assert mgr.restore_or_initialize() == 3, "a restart of the fork resumes the fork, not the parent"
        for name, value in again_model.state_dict().items():
            assert torch.equal(value, after_fork[name]), name

    with ServiceClient(url) as client:
        lineage = client.lineage(child)
        assert str(lineage.parent) == f"{parent}@1" and [str(a) for a in lineage.ancestors] == [f"{parent}@1"]
        assert [(c.job, c.position.epoch) for c in client.lineage(parent).children] == [(child, 1)]
        assert client.get_job(child).parent == parse_fork_point(f"{parent}@1")
        # keep_last=1 on the parent: its epochs 0 and 2 may go, the fork point may not.
        client.put_job(parent, ["n0"], storage_root=root, retention={"keep_last": 1})
        planned = {(d.epoch, d.batch) for d in client.retention_plan(parent).deletions}
        assert planned == {(0, None), (2, None)}


def test_a_fork_declaration_is_checked(sqlite_service, job_name):
    url = sqlite_service.live.url
    with ServiceClient(url) as client:
        client.put_job(job_name, ["n0"], storage_root=sqlite_service.storage)
        child = f"{job_name}-child"
        fork = parse_fork_point(f"{job_name}@0")
        with httpx.Client(base_url=url) as http:
            never = http.put(
                f"/v1/jobs/{child}", json={"nodes": ["n0"], "parent": {"job": job_name, "position": {"epoch": 0}}}
            )
            assert never.status_code == 422 and "not a good position" in never.text, "a position it never had"
            attempt = client.start_attempt(job_name, "n0")
            client.commit(Store(sqlite_service.storage).save(job_name, "n0", 0, {"w": np.ones(2)}, attempt=attempt))
            missing = http.put(
                f"/v1/jobs/{child}", json={"nodes": ["n0"], "parent": {"job": "nope", "position": {"epoch": 0}}}
            )
            assert missing.status_code == 404 and "nope" in missing.text
            itself = http.put(
                f"/v1/jobs/{job_name}", json={"nodes": ["n0"], "parent": {"job": job_name, "position": {"epoch": 0}}}
            )
            assert itself.status_code == 422
            client.put_job(child, ["n0"], storage_root=sqlite_service.storage, parent=fork)
            cycle = http.put(
                f"/v1/jobs/{job_name}", json={"nodes": ["n0"], "parent": {"job": child, "position": {"epoch": 0}}}
            )
            assert cycle.status_code == 422 and "cycle" in cycle.text
            other = http.put(
                f"/v1/jobs/{child}", json={"nodes": ["n0"], "parent": {"job": job_name, "position": {"epoch": 5}}}
            )
            assert other.status_code == 409
        assert client.put_job(child, ["n0"], storage_root=sqlite_service.storage).parent == fork, "null keeps it"
    for text in ("job", "job@", "job@x", "@3", "a/b@1"):
        with pytest.raises(ValueError):
            parse_fork_point(text)


def test_a_keras_fit_forked_from_another_job_resumes_exactly_where_the_parent_was(sqlite_service):
    from ckptstore.client.keras import BackupAndRestore
    from tests.test_fit_outages import fit
    from tests.train_job import final_state

    root, url = sqlite_service.storage, sqlite_service.live.url
    parent, child = f"keras-base-{uuid.uuid4().hex[:6]}", f"keras-fork-{uuid.uuid4().hex[:6]}"
    options = {"storage": root, "service": url, "node": "n0", "delete_checkpoint": False}
    uninterrupted = fit(BackupAndRestore(job=parent, **options), epochs=3)
    forked = fit(BackupAndRestore(job=child, fork_from=f"{parent}@1", **options), epochs=3)
    # The fork trained only epoch 2, from the parent's epoch 1: it ends bit-equal to the parent.
    want, got = final_state(uninterrupted), final_state(forked)
    assert want.keys() == got.keys() and all(want[k].tobytes() == got[k].tobytes() for k in want)
    with ServiceClient(url) as client:
        assert [c.epoch for c in client.list_checkpoints(child)] == [2]
        assert str(client.lineage(child).parent) == f"{parent}@1"
