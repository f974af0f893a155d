"""One-pass restore (issue 35, part 1): a local copy's bytes are read once, straight into the model's
memory, and checked there. The guarantee kept: a restore completes from one intact copy or raises —
a tensor found damaged after earlier ones were written into place makes the restore fall back to the
next intact copy, which overwrites every target; training never starts on a mix. Where that cannot be
guaranteed (a restore that is not strict, a job of several nodes waiting for each other), the copy is
checked whole first, as before."""

from __future__ import annotations

import uuid

import pytest

from ckptstore import Position, Store
from ckptstore.deferred import VerifiedTensors
from ckptstore.errors import CheckpointNotFoundError

torch = pytest.importorskip("torch", reason="the [torch] extra is not installed")

from ckptstore.client.torch import CheckpointManager  # noqa: E402


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


def state_of(model: torch.nn.Module) -> dict[str, bytes]:
    return {name: value.detach().numpy().tobytes() for name, value in model.state_dict().items()}


def damage_last_tensor(store: Store, job: str, position: Position) -> str:
    """Flip a byte in the model's tensor read last from its shard in the copy at `position` (those
    before it in the shard are read into place first)."""
    copy = store.copies(job, "n0", position)[-1]
    manifest = store.manifest(copy)
    last = max((t for t in manifest.tensors if t.name.startswith("model/")), key=lambda t: (t.shard, t.begin))
    assert sum(t.shard == last.shard for t in manifest.tensors) > 1, "others are read into place before it"
    path = store._storage.path(manifest.shards[last.shard].key(copy.relpath))
    with open(path, "r+b") as handle:
        handle.seek(last.end - 2)
        byte = handle.read(1)
        handle.seek(last.end - 2)
        handle.write(bytes([byte[0] ^ 0x40]))
    return last.name


def saved_twice(root: str, job: str, **options) -> dict[str, bytes]:
    """Epoch 0 and epoch 1 of one model, every value different between them; the state at epoch 0."""
    model = make_model(0)
    manager = CheckpointManager(objects={"model": model}, storage=root, job=job, node="n0", **options)
    manager.restore_or_initialize()
    manager.save(0)
    manager.wait()
    at_epoch_0 = state_of(model)
    with torch.no_grad():
        for value in model.parameters():
            value.add_(1.0)
    manager.save(1)
    manager.close()
    return at_epoch_0


def restored_watching(root: str, job: str, **options) -> tuple[CheckpointManager, torch.nn.Module, list[bool]]:
    """A fresh model restored by a new manager, and for each `read_into` whether its copy had been
    checked whole first (False: one pass)."""
    fresh, read_into = make_model(7), []
    original = VerifiedTensors.read_into

    def spy(self, targets):
        read_into.append(self._verified)
        return original(self, targets)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(VerifiedTensors, "read_into", spy)
        manager = CheckpointManager(objects={"model": fresh}, storage=root, job=job, node="n0", **options)
        assert manager.restore_or_initialize() == 1, "resumed after epoch 0: the copy at epoch 1 is damaged"
    return manager, fresh, read_into


@pytest.mark.parametrize("with_service", [False, True])
def test_a_tensor_found_damaged_in_place_falls_back_and_overwrites_every_target(tmp_path, request, with_service):
    job = f"onepass-{uuid.uuid4().hex[:6]}"
    options = {}
    if with_service:
        service = request.getfixturevalue("sqlite_service")
        options, root = {"service": service.live.url}, f"{service.storage}/{job}"
    else:
        root = str(tmp_path / "ckpt")
    at_epoch_0 = saved_twice(root, job, **options)
    damaged = damage_last_tensor(Store(root), job, Position(1))
    manager, fresh, read_into = restored_watching(root, job, **options)
    assert read_into == [False, False], "both copies read in one pass, the damaged one first"
    assert state_of(fresh) == at_epoch_0, "every value is epoch 0's: nothing of the damaged copy is left"
    assert manager.resume_position == Position(0)
    manager.close()
    if with_service:
        with service.client() as http:
            records = http.get(f"/v1/jobs/{job}/checkpoints", params={"epoch": 1}).json()
        assert [r["state"] for r in records] == ["corrupt"], "the damaged copy is marked for every later start"
        assert damaged in records[0]["reason"]


def test_without_strict_the_copy_is_checked_whole_before_anything_is_assigned(tmp_path):
    root, job = str(tmp_path / "ckpt"), f"loose-{uuid.uuid4().hex[:6]}"
    at_epoch_0 = saved_twice(root, job)
    damage_last_tensor(Store(root), job, Position(1))
    manager, fresh, read_into = restored_watching(root, job, strict=False)
    assert read_into == [True], "the damaged copy failed its whole check: only epoch 0's was read into place"
    assert state_of(fresh) == at_epoch_0
    manager.close()


def test_a_copy_damaged_everywhere_raises_rather_than_train_on_a_mix(tmp_path):
    root, job = str(tmp_path / "ckpt"), f"lost-{uuid.uuid4().hex[:6]}"
    saved_twice(root, job)
    store = Store(root)
    for position in (Position(0), Position(1)):
        damage_last_tensor(store, job, position)
    manager = CheckpointManager(objects={"model": make_model(7)}, storage=root, job=job, node="n0")
    with pytest.raises(CheckpointNotFoundError, match="no intact copy .* is left to resume from"):
        manager.restore_or_initialize()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_reads_in_one_pass_and_a_tensor_found_damaged_there_fails_the_load(tmp_path):
    """A DCP reader reads the durable tier only (it reshards; no local tier of its own), so a tensor found
    damaged as it lands leaves no copy to fall back to at that position: the load raises."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ckptstore.client.torch.dcp import CkptstoreReader, CkptstoreWriter

    torch.manual_seed(0)
    saved = {"a": torch.randn(64, 32), "b": torch.randn(256), "c": torch.randn(32, 32)}
    root = str(tmp_path / "ckpt")
    dcp.save(saved, storage_writer=CkptstoreWriter(root, "dcp1", 0))
    checked_whole_first: list[bool] = []
    original = VerifiedTensors.read_into

    def spy(self, targets):
        checked_whole_first.append(self._verified)
        return original(self, targets)

    def load() -> dict[str, torch.Tensor]:
        target = {name: torch.zeros_like(value) for name, value in saved.items()}
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(VerifiedTensors, "read_into", spy)
            dcp.load(target, storage_reader=CkptstoreReader(root, "dcp1"))
        return target

    target = load()
    assert checked_whole_first == [False], "read straight into the targets, each tensor checked there"
    assert all(torch.equal(target[name], saved[name]) for name in saved)
    store = Store(root)
    (copy,) = store.copies("dcp1", "node-0", Position(0))
    manifest = store.manifest(copy)
    last = max((t for t in manifest.tensors if t.name != "dcp/metadata"), key=lambda t: (t.shard, t.begin))
    with open(store._storage.path(manifest.shards[last.shard].key(copy.relpath)), "r+b") as handle:
        handle.seek(last.end - 2)
        byte = handle.read(1)
        handle.seek(last.end - 2)
        handle.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(CheckpointException) as failed:  # DCP's wrapper of a rank's error
        load()
    message = str(failed.value)
    assert "CorruptCheckpointError: no intact copy of node-0's part" in message
    assert f"tensor {last.name!r}" in message and "does not match its checksum" in message
