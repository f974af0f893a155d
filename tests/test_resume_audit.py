"""The resume audit: each save records a fingerprint; each restore compares it with the live run and
names every difference — refused under resume_check="raise" before anything is assigned, said once
under "warn", kept with the attempt on the service (`resume.audited`). `check_restore()` is the same
audit changing nothing; `ckptstore diff` compares two saved fingerprints."""

from __future__ import annotations

import json
import uuid

import pytest

torch = pytest.importorskip("torch", reason="the [torch] extra is not installed")

from torch import nn  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from ckptstore import Position, Store  # noqa: E402
from ckptstore.client.torch import CheckpointManager  # noqa: E402
from ckptstore.errors import ResumeDriftError  # noqa: E402

BASE = {"optimizer": "Adam", "width": 16, "batch": 8, "samples": 64, "seed": 0}


def run(root: str, job: str, *, service: str | None = None, resume_check: str = "warn", save: bool = True, **change):
    """A small PyTorch run configured as BASE with `change`: restores, trains three batches, saves."""
    config = BASE | change
    torch.manual_seed(config["seed"])
    model = nn.Sequential(nn.Linear(4, config["width"]), nn.ReLU(), nn.Linear(config["width"], 1))
    optimizer = getattr(torch.optim, config["optimizer"])(model.parameters(), lr=1e-3)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(config["samples"], 4, generator=torch.Generator().manual_seed(1))
    )
    loader = StatefulDataLoader(dataset, batch_size=config["batch"], shuffle=True, generator=torch.Generator())
    manager = CheckpointManager(
        objects={"model": model, "optimizer": optimizer, "data": loader},
        storage=root,
        service=service,
        job=job,
        node="n0",
        async_save=False,
        resume_check=resume_check,
    )
    return manager, model, optimizer, loader


def train_and_save(manager, model, optimizer, loader) -> None:
    for batch, (x,) in enumerate(loader):
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
        if batch == 2:
            manager.save(0, batch=3)
            break


def first_run(root: str, job: str, service: str | None = None) -> None:
    """The saved run: BASE, three batches, saved at 0.b3."""
    manager, *objects = run(root, job, service=service)
    manager.restore_or_initialize()
    train_and_save(manager, *objects)
    manager.close()


@pytest.fixture
def saved(tmp_path):
    root, job = str(tmp_path / "ckpt"), f"audit-{uuid.uuid4().hex[:6]}"
    first_run(root, job)
    return root, job


DRIFTS = {
    "Adam -> AdamW": ({"optimizer": "AdamW"}, "optimizer: saved Adam, restoring into AdamW"),
    "a layer widened": ({"width": 32}, "model: 0.weight (16, 4) float32 → (32, 4) float32"),
    "batch size": ({"batch": 16}, "data (data): batch size 8 → 16"),
    "dataset length": ({"samples": 80}, "data (data): dataset length 64 → 80"),
    "seed": ({"seed": 1}, "seed: the saved run was seeded with 0, this run with 1"),
}


@pytest.mark.parametrize("case", DRIFTS)
def test_each_change_is_named_and_refused_under_raise_before_anything_is_assigned(case, saved):
    change, named = DRIFTS[case]
    root, job = saved
    manager, model, *_ = run(root, job, resume_check="raise", **change)
    audit = manager.check_restore()
    assert audit is not None and audit.verdict == "drift", audit
    assert any(named in difference for difference in audit.differences), audit.differences
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ResumeDriftError) as refused:
        manager.restore_or_initialize()
    assert list(refused.value.differences) == audit.differences and named in str(refused.value)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "nothing was assigned"
    manager.close()


def test_an_unchanged_run_audits_exact_and_check_restore_changes_nothing(saved, capsys):
    root, job = saved
    manager, model, *_ = run(root, job)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    audit = manager.check_restore()
    assert audit is not None and audit.verdict == "unverified", "a dry run declares, it proves nothing"
    assert audit.differences == [
        "a dry run: what the resumed run draws and counts is checked at its first step, not here"
    ]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "a dry run assigns nothing"
    assert manager.checkpointer.attempt is None, "and registers no attempt"
    manager.restore_or_initialize()
    assert manager.audit is not None and manager.audit.verdict == "exact"
    assert "resumed from epoch 0 batch 3" in capsys.readouterr().err
    manager.close()


def test_warn_says_every_difference_once_on_the_resume_line_and_goes_on(saved, capsys):
    root, job = saved
    manager, *_ = run(root, job, optimizer="AdamW")
    assert manager.restore_or_initialize() == 0
    err = capsys.readouterr().err
    assert err.count("resume audit: DRIFT") == 1
    assert "\n  - optimizer: saved Adam, restoring into AdamW" in err
    manager.close()


def test_the_audit_is_kept_with_the_attempt_and_said_as_an_event(tmp_path, sqlite_service):
    from ckptstore.client import ServiceClient

    root, job = f"{sqlite_service.storage}/{uuid.uuid4().hex[:6]}", f"audited-{uuid.uuid4().hex[:6]}"
    url = sqlite_service.live.url
    first_run(root, job, url)
    manager, *_ = run(root, job, service=url, optimizer="AdamW")
    manager.restore_or_initialize()
    manager.close()
    refused, *_ = run(root, job, service=url, optimizer="AdamW", resume_check="raise")
    with pytest.raises(ResumeDriftError):
        refused.restore_or_initialize()  # a process that raises here exits without closing anything
    with ServiceClient(url) as client:
        attempts = client.list_attempts(job)
        assert attempts[0].audit is None, "the first start resumed nothing"
        for attempt in attempts[1:]:
            assert attempt.audit is not None and attempt.audit.verdict == "drift", "the refused one's is kept too"
            assert "optimizer: saved Adam, restoring into AdamW" in attempt.audit.differences
        event = next(client.events(job, after=0, types=["resume.audited"]))
    assert event.data["verdict"] == "drift" and event.data["attempt"] == attempts[1].attempt


def test_ckptstore_diff_names_what_changed_between_two_positions(tmp_path, sqlite_service, capsys):
    from ckptstore.client.cli.main import main

    root, job = f"{sqlite_service.storage}/{uuid.uuid4().hex[:6]}", f"diffed-{uuid.uuid4().hex[:6]}"
    url = sqlite_service.live.url
    first_run(root, job, url)
    manager, *objects = run(root, job, service=url, resume_check="off", batch=16)
    manager.restore_or_initialize()
    manager.save(1)
    manager.close()
    capsys.readouterr()
    assert main(["diff", job, "0:3", "0:3", "--url", url]) == 0
    assert "the same run" in capsys.readouterr().out
    assert main(["diff", job, "0:3", "1", "--url", url, "--json"]) == 1
    answer = json.loads(capsys.readouterr().out)
    assert "data (data): batch size 8 → 16" in answer["differences"]
    assert main(["diff", job, "0:3", "7", "--url", url]) == 3, "a position with no copy: not found"


def test_ckptstore_diff_of_two_positions_of_one_unchanged_run_finds_nothing(tmp_path, capsys):
    """Two positions of one run have different next samples by construction: diff compares what they
    share, and says the same run (exit 0); what each leads to is recorded for the resume proof."""
    from ckptstore.client.cli.main import main
    from ckptstore.fingerprint import differences

    root, job = str(tmp_path / "ckpt"), f"diff-same-{uuid.uuid4().hex[:6]}"
    manager, model, optimizer, loader = run(root, job)
    manager.restore_or_initialize()
    for batch, (x,) in enumerate(loader):
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
        if batch + 1 in (3, 6):
            manager.save(0, batch=batch + 1)
        if batch + 1 == 6:
            break
    manager.close()
    capsys.readouterr()
    store = Store(root)
    copies = [store.copies(job, "n0", Position(0, batch))[0] for batch in (3, 6)]
    assert main(["diff", job, *(store.location(copy) for copy in copies)]) == 0
    assert "the same run" in capsys.readouterr().out
    fingerprints = [store.manifest(copy).metadata["fingerprint"] for copy in copies]
    assert differences(*fingerprints) == []
    upcoming = [fingerprint["proof"]["next"]["data"] for fingerprint in fingerprints]
    assert upcoming[0] and upcoming[1] and upcoming[0][:8] != upcoming[1][:8], "each position's own next samples"


def test_a_world_size_change_and_a_rank_without_its_own_rng_are_named():
    from ckptstore.fingerprint import differences

    saved_run = {"world": {"size": 2, "rank": 0}, "rng_ranks": 2}
    assert differences(saved_run, {"world": {"size": 1, "rank": 0}}) == [
        "world size: saved by 2 process(es), restoring into 1"
    ]
    assert differences({"world": {"size": 2, "rank": 0}}, {"world": {"size": 2, "rank": 1}}) == []
    old = {"world": {"size": 2, "rank": 0}, "rng_ranks": 1}
    assert differences(old, {"world": {"size": 2, "rank": 1}}) == [
        "rank 1: RNG from rank 0 (the checkpoint holds the RNG of 1 rank(s))"
    ]


def test_a_replicated_save_without_every_ranks_rng_says_rank_0s_rng_is_restored(tmp_path, monkeypatch):
    """A preemption's save under DDP runs no collective: only rank 0's RNG is in it, and a rank 1
    restoring it is told so."""
    from ckptstore.fingerprint import differences

    manager, *_ = run(str(tmp_path / "ckpt"), "preempted")
    monkeypatch.setattr(manager, "_world", lambda: (2, 0))
    _, metadata = manager._capture(Position(0, 3))
    saved = metadata["fingerprint"]
    assert saved["rng_ranks"] == 1
    assert "rank 1: RNG from rank 0 (the checkpoint holds the RNG of 1 rank(s))" in differences(
        saved, saved | {"world": {"size": 2, "rank": 1}}
    )
    manager.close()


def test_a_generator_given_to_the_loader_since_the_save_is_named():
    from ckptstore.client.torch import ResumableSampler
    from ckptstore.client.torch.loaders import data_fingerprint
    from ckptstore.fingerprint import differences

    dataset = torch.utils.data.TensorDataset(torch.zeros(16, 1))

    def loader(generator):
        return StatefulDataLoader(dataset, batch_size=4, sampler=ResumableSampler(dataset), generator=generator)

    saved = {"data": {"data": data_fingerprint(loader(None))}}
    live = {"data": {"data": data_fingerprint(loader(torch.Generator()))}}
    assert differences(saved, live) == ["data (data): generators (its own, its sampler's) 0 → 1"]


def test_the_docs_loops_batch_size_is_named_with_the_loader_in_objects(tmp_path):
    """docs/pytorch.md's loop — a plain DataLoader over a ResumableSampler, the loader in objects: a
    batch size 32 → 64 is named and refused (the sampler alone cannot see it); unchanged, exact."""
    from torch.utils.data import DataLoader

    from ckptstore.client.torch import ResumableSampler

    def docs_loop(batch_size: int):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        dataset = torch.utils.data.TensorDataset(torch.randn(256, 4, generator=torch.Generator().manual_seed(1)))
        loader = DataLoader(dataset, batch_size=batch_size, sampler=ResumableSampler(dataset, seed=0))
        manager = CheckpointManager(
            objects={"model": model, "optimizer": optimizer, "data": loader},
            storage=str(tmp_path / "ckpt"),
            job="docs-loop",
            node="n0",
            async_save=False,
            resume_check="raise",
        )
        return manager, model, optimizer, loader

    manager, *objects = docs_loop(32)
    manager.restore_or_initialize()
    train_and_save(manager, *objects)
    manager.close()
    unchanged, *_ = docs_loop(32)
    assert unchanged.check_restore().verdict == "unverified"  # declared the same; only a resume proves it
    unchanged.close()
    changed, *_ = docs_loop(64)
    assert "data (data): batch size 32 → 64" in changed.check_restore().differences
    with pytest.raises(ResumeDriftError, match="batch size 32 → 64"):
        changed.restore_or_initialize()
    changed.close()
