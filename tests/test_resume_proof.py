"""The resume proof sees what the resumed run does: the DDP tutorial's loop (one rank here: a
`DistributedSampler` told its world) resumed mid-epoch is `exact` when the loop calls `set_epoch`,
and `drift` when it forgets — the sampler then hands out epoch 0's order again, which nothing the
code declares shows. The verdict is kept with the attempt and said as `resume.audited`; under
resume_check="raise" the forgetful loop is refused before its first batch trains."""

from __future__ import annotations

import itertools
import uuid

import pytest

torch = pytest.importorskip("torch", reason="the [torch] extra is not installed")

from ckptstore import Position  # noqa: E402
from ckptstore.client import ServiceClient  # noqa: E402
from ckptstore.client.torch import CheckpointManager  # noqa: E402
from ckptstore.errors import ResumeDriftError  # noqa: E402

SAMPLES, BATCH = 64, 4  # 16 batches an epoch


def manager_and_loader(root: str, job: str, url: str, resume_check: str = "warn"):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    dataset = torch.utils.data.TensorDataset(torch.arange(SAMPLES, dtype=torch.float32).reshape(-1, 1).repeat(1, 2))
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=1, rank=0, seed=3)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    objects = {"model": model, "data": loader}
    manager = CheckpointManager(
        objects=objects, storage=root, job=job, node="n0", service=url, async_save=False, resume_check=resume_check
    )
    return manager, model, loader


def train(
    root: str,
    job: str,
    url: str,
    *,
    stop_at: tuple[int, int] | None = None,
    set_epoch: bool = True,
    peek: bool = False,
    **kw,
):
    """The tutorial loop: epochs 0 and 1, a save every 4 batches and at each epoch's end (`peek`: a
    first batch drawn to look at, before the loop makes its own iterator)."""
    manager, model, loader = manager_and_loader(root, job, url, **kw)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    start = manager.restore_or_initialize()
    if peek:
        next(iter(loader))
    for epoch in range(start, 2):
        if set_epoch:
            loader.sampler.set_epoch(epoch)
        for batch, (x,) in enumerate(loader, start=manager.first_batch(epoch)):
            if (epoch, batch) == stop_at:
                manager.close()
                return manager
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()
            if (batch + 1) % 4 == 0:
                manager.save(epoch, batch=batch + 1)
        manager.save(epoch)
    manager.close()
    return manager


def test_a_loop_that_forgets_set_epoch_is_drift_kept_with_the_attempt_and_refused_under_raise(sqlite_service, capsys):
    url = sqlite_service.live.url
    root = f"{sqlite_service.storage}/{uuid.uuid4().hex[:6]}"
    good, forgetful = f"proof-good-{uuid.uuid4().hex[:6]}", f"proof-forgets-{uuid.uuid4().hex[:6]}"
    for job in (good, forgetful):
        train(root, job, url, stop_at=(1, 6))  # killed in epoch 1: resumes from batch 4
    assert train(root, good, url).audit.verdict == "exact"
    assert "resume audit: exact — proven: the first 16 sample ids data handed out" in capsys.readouterr().err

    with pytest.raises(ResumeDriftError, match="the first samples drawn after the restore are"):
        train(root, forgetful, url, set_epoch=False, resume_check="raise")
    forgot = train(root, forgetful, url, set_epoch=False)
    assert forgot.audit.verdict == "drift", forgot.audit
    assert forgot.audit.differences[0].startswith("data (data): the first samples drawn after the restore are")

    with ServiceClient(url) as client:
        kept = {job: [a.audit.verdict for a in client.list_attempts(job) if a.audit] for job in (good, forgetful)}
        events = client.events(forgetful, after=0, types=["resume.audited"])  # a stream: the first two
        said = [event.data["verdict"] for event in itertools.islice(events, 2)]
    assert kept == {good: ["exact"], forgetful: ["drift", "drift"]}, kept
    assert said == ["drift", "drift"]


def test_a_loop_that_peeks_at_the_restored_loader_then_iterates_again_is_not_exact(sqlite_service):
    """The ids seen first are the saved run's next, but the loop trains from another iterator — here
    one that starts the epoch over, whose ids the proof goes on comparing: drift. (Where the next
    iterator went on from the peeked batch, the ids would match and the verdict would be unverified:
    another iterator was made. Never exact.)"""
    url = sqlite_service.live.url
    root, job = f"{sqlite_service.storage}/{uuid.uuid4().hex[:6]}", f"proof-peeks-{uuid.uuid4().hex[:6]}"
    train(root, job, url, stop_at=(1, 6))
    peeked = train(root, job, url, peek=True)
    assert peeked.audit.verdict == "drift", peeked.audit
    assert peeked.audit.differences[0].startswith("data (data): the first samples drawn after the restore are")


def test_a_peek_whose_next_iterator_goes_on_from_it_is_unverified_not_exact(tmp_path):
    """docs/pytorch.md's loader (a ResumableSampler goes on where it was): the ids the loop trains after
    a peek are the saved run's next ones — but not the batch the uninterrupted run trained first. The
    ids match; another iterator was made: unverified."""
    from ckptstore.client.torch import ResumableSampler

    def docs_loop():
        dataset = torch.utils.data.TensorDataset(torch.arange(SAMPLES, dtype=torch.float32).reshape(-1, 1))
        loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=ResumableSampler(dataset, seed=1))
        manager = CheckpointManager(
            objects={"data": loader}, storage=str(tmp_path), job="peek", node="n0", async_save=False
        )
        return manager, loader

    manager, loader = docs_loop()
    manager.restore_or_initialize()
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    manager.save(0, batch=3)
    manager.close()
    manager, loader = docs_loop()
    manager.restore_or_initialize()
    next(iter(loader))  # a peek
    next(iter(loader))  # the loop's own iterator: the batch after the peeked one
    manager.checkpoint_if_preempted(0, 4)
    assert manager.audit.verdict == "unverified", manager.audit
    assert any("another iterator was made after its first ids were seen" in d for d in manager.audit.differences)
    manager.close()


def test_torchdata_shuffling_resumed_after_an_epoch_end_is_proven_by_what_the_saved_run_drew_next(tmp_path):
    """torchdata's `StatefulDataLoader(shuffle=True, generator=…)` saved at an epoch's end draws the next
    epoch's order from its generator as the next iterator is made — after the save. Predicting that order
    from the generator at the save would be a belief: a loop that uses the generator between epochs
    trains another order after a resume (torchdata sets the saved state back), and the prediction would
    match the resumed run, not the saved one (this test failed with such a prediction: `exact` over a
    resume that drew other samples). What the saved run drew after the save, recorded late beside the
    copy, is what the resume is checked against: drift here; unverified where the saved run was killed
    before it drew (nothing recorded), never exact."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ckptstore import Store

    def loop(job: str):
        dataset = torch.utils.data.TensorDataset(torch.arange(SAMPLES, dtype=torch.float32).reshape(-1, 1))
        loader = StatefulDataLoader(dataset, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(7))
        manager = CheckpointManager(
            objects={"data": loader}, storage=str(tmp_path), job=job, node="n0", async_save=False
        )
        return manager, loader

    def resumed(job: str):
        manager, loader = loop(job)
        assert manager.restore_or_initialize() == 1
        torch.randint(10, (1,), generator=loader.generator)
        drawn = next(iter(loader))[0].flatten().tolist()
        manager.checkpoint_if_preempted(1, 1)
        manager.close()
        return manager.audit, drawn

    for job, drew_on in [("drew-on", True), ("killed-at-the-save", False)]:
        manager, loader = loop(job)
        manager.restore_or_initialize()
        for _ in loader:  # epoch 0
            pass
        manager.save(0)
        torch.randint(10, (1,), generator=loader.generator)  # the loop uses the generator between epochs
        uninterrupted = next(iter(loader))[0].flatten().tolist() if drew_on else None
        manager.close()
        (copy,) = Store(str(tmp_path)).copies(job, "n0", Position(0))
        assert (Store(str(tmp_path)).drawn_next(copy) is not None) == drew_on
        audit, drawn = resumed(job)
        if drew_on:
            assert drawn != uninterrupted, "the premise: this resume is not exact"
            assert audit.verdict == "drift", audit
            assert "not the saved run's data stream" in audit.differences[0], audit
        else:
            assert audit.verdict == "unverified", audit
            assert "recorded nothing it drew after it" in " ".join(audit.differences), audit


def test_what_the_saved_run_drew_after_an_epoch_end_follows_the_copy_to_the_durable_tier(tmp_path):
    """With a local tier the late record is kept beside the local copy, and replication carries it (or
    it is written after) to the durable tier: a new machine, its local tier empty, proves the resume."""
    import shutil

    from torchdata.stateful_dataloader import StatefulDataLoader

    from ckptstore import Store

    durable, local = tmp_path / "durable", tmp_path / "local"

    def loop():
        dataset = torch.utils.data.TensorDataset(torch.arange(SAMPLES, dtype=torch.float32).reshape(-1, 1))
        loader = StatefulDataLoader(dataset, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(7))
        manager = CheckpointManager(
            objects={"data": loader}, storage=str(durable), local_storage=str(local), job="tiers", node="n0"
        )
        return manager, loader

    manager, loader = loop()
    manager.restore_or_initialize()
    for _ in loader:
        pass
    manager.save(0)
    uninterrupted = next(iter(loader))[0].flatten().tolist()
    manager.wait()
    manager.close()
    for root in (durable, local):
        (copy,) = Store(str(root)).copies("tiers", "n0", Position(0))
        assert Store(str(root)).drawn_next(copy) == {"world": [1, 0], "next": {"data": uninterrupted}}
    shutil.rmtree(local)  # a new machine
    manager, loader = loop()
    assert manager.restore_or_initialize() == 1
    assert next(iter(loader))[0].flatten().tolist() == uninterrupted
    manager.checkpoint_if_preempted(1, 1)
    assert manager.audit.verdict == "exact", manager.audit
    manager.close()
