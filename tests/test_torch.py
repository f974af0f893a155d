"""PyTorch: a loop killed mid-epoch resumes bit-exactly (plain DataLoader with ckptstore's sampler,
and torchdata's StatefulDataLoader; local disk and S3; with and without the service), 2-rank gloo
jobs (DDP, and per-rank state where one rank dies before committing), Distributed Checkpoint
through ckptstore (save with 2 ranks, load with 1 and 4; a corrupt shard never loaded), and the
state tree round-tripping Python values exactly."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the [torch] extra is not installed")

from ckptstore import Position, Store  # noqa: E402
from ckptstore.client.torch.state import flatten, unflatten  # noqa: E402
from tests.servers import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_job(
    tmp_path, *args: str, killed: bool = False, env: dict | None = None, module: str = "tests.torch_job"
) -> str:
    out = tmp_path / f"final-{uuid.uuid4().hex[:6]}.npz"
    process = subprocess.Popen(
        [sys.executable, "-m", module, *args, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=os.environ | (env or {}),
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # data loader workers a SIGKILLed job leaves behind
    if killed:
        assert process.returncode == -9, stderr[-3000:]
        return stdout
    assert process.returncode == 0, stderr[-3000:]
    return stdout + f"STDERR {stderr}\nOUT {out}\n"


def final(stdout: str) -> dict[str, np.ndarray]:
    path = stdout.strip().splitlines()[-1].removeprefix("OUT ")
    with np.load(path) as archive:
        return {k: archive[k] for k in archive.files}


def assert_bit_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].tobytes() == want[key].tobytes(), key


@pytest.mark.parametrize(
    "where,loader,with_service",
    [("local", "plain", False), ("local", "stateful", True), ("s3", "plain", True), ("s3", "stateful", False)],
)
def test_a_loop_killed_mid_epoch_resumes_bit_exactly(where, loader, with_service, tmp_path, request):
    args = ["--loader", loader]
    if where == "s3":
        moto = request.getfixturevalue("moto_s3")
        args += ["--storage", f"s3://{moto.bucket}/torch-{uuid.uuid4().hex[:6]}", "--endpoint", moto.endpoint_url]
    elif with_service:
        args += ["--storage", f"{request.getfixturevalue('sqlite_service').storage}/torch-{uuid.uuid4().hex[:6]}"]
    else:
        args += ["--storage", str(tmp_path / "ckpt")]
    if with_service:
        args += ["--service", request.getfixturevalue("sqlite_service").live.url]
    baseline = final(run_job(tmp_path, *args, "--job", f"base-{uuid.uuid4().hex[:6]}"))
    job = ["--job", f"killed-{uuid.uuid4().hex[:6]}"]
    kill_batch = int(np.random.default_rng().integers(1, 11))  # a random mid-epoch batch of epoch 1
    run_job(tmp_path, *args, *job, "--kill-epoch", "1", "--kill-batch", str(kill_batch), killed=True)
    resumed = run_job(tmp_path, *args, *job)
    saved = kill_batch - kill_batch % 3
    assert resumed.splitlines()[0] == (f"RESUMED 1 {saved}" if saved else "RESUMED 0 None"), kill_batch
    assert "resume audit: exact" in resumed
    assert_bit_equal(final(resumed), baseline)


def ranks(
    tmp_path, world: int, *args: str, killed_rank: int | None = None, module: str = "tests.torch_job"
) -> list[str]:
    """Run the job as `world` gloo ranks; with `killed_rank`, that rank SIGKILLs itself and the rest
    are killed once it is dead (a lost node takes the job down)."""
    port = str(free_port())
    processes = []
    for rank in range(world):
        env = os.environ | {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1"}
        out = tmp_path / f"rank{rank}-{uuid.uuid4().hex[:6]}.npz"
        command = [sys.executable, "-m", module, *args, "--out", str(out)]
        processes.append(
            (
                subprocess.Popen(
                    command,
                    cwd=ROOT,
                    env=env | {"MASTER_PORT": port},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
                out,
            )
        )
    outputs = []
    try:
        if killed_rank is not None:
            processes[killed_rank][0].wait(timeout=300)
            for process, _ in processes:
                process.kill()
        for rank, (process, out) in enumerate(processes):
            stdout, stderr = process.communicate(timeout=300)
            if killed_rank is None and process.returncode != 0:  # the others go with it, and say their end
                for other, _ in processes[rank + 1 :]:
                    other.kill()
                ends = [f"rank {rank} (rc {process.returncode}): {stderr[-3000:]}"]
                ends += [f"rank {r}: {p.communicate()[1][-1500:]}" for r, (p, _) in enumerate(processes) if r > rank]
                raise AssertionError("\n".join(ends))
            outputs.append(stdout + f"STDERR {stderr}\nOUT {out}\n")
    finally:  # a rank that failed leaves the others waiting in a collective: they go with it
        for process, _ in processes:
            process.kill()
    return outputs


def test_a_two_rank_ddp_job_killed_and_resumed_is_bit_exact(tmp_path, sqlite_service):
    storage = f"{sqlite_service.storage}/ddp-{uuid.uuid4().hex[:6]}"
    common = ["--storage", storage, "--service", sqlite_service.live.url]
    baseline = ranks(tmp_path, 2, *common, "--job", f"ddp-base-{uuid.uuid4().hex[:6]}")
    job = ["--job", f"ddp-{uuid.uuid4().hex[:6]}"]
    ranks(tmp_path, 2, *common, *job, "--kill-epoch", "1", "--kill-batch", "7", killed_rank=0)
    resumed = ranks(tmp_path, 2, *common, *job)
    assert [r.splitlines()[0] for r in resumed] == ["RESUMED 1 6", "RESUMED 1 6"], "every rank from rank 0's"
    for got, want in zip(resumed, baseline, strict=True):
        assert_bit_equal(final(got), final(want))
    assert Store(storage).list_nodes(job[1]) == ["node-0"], "replicated state: rank 0 writes"


def test_per_rank_state_a_rank_dying_before_its_commit_leaves_the_position_not_good(tmp_path, sqlite_service):
    from ckptstore.client import ServiceClient

    storage = f"{sqlite_service.storage}/perrank-{uuid.uuid4().hex[:6]}"
    common = ["--per-rank", "--storage", storage, "--service", sqlite_service.live.url]
    job = f"perrank-{uuid.uuid4().hex[:6]}"
    ranks(
        tmp_path,
        2,
        *common,
        "--job",
        job,
        "--die-before-save-epoch",
        "1",
        "--die-before-save-batch",
        "9",
        killed_rank=0,
    )
    with ServiceClient(sqlite_service.live.url) as client:
        nodes = {r.node for r in client.list_checkpoints(job, epoch=1) if r.batch == 9}
        assert nodes == {"node-0"}, "rank 0 committed 1.b9, rank 1 did not"
        assert client.last_good_epoch(job).resume.to_position() == Position(1, 6)
    resumed = ranks(tmp_path, 2, *common, "--job", job)
    assert [r.splitlines()[0] for r in resumed] == ["RESUMED 1 6", "RESUMED 1 6"]
    baseline = ranks(tmp_path, 2, *common, "--job", f"perrank-base-{uuid.uuid4().hex[:6]}")
    for got, want in zip(resumed, baseline, strict=True):
        assert_bit_equal(final(got), final(want))


def dcp_expected() -> dict[str, np.ndarray]:
    from tests.dcp_job import expected

    values = {k: (v.view(torch.int16) if v.dtype == torch.bfloat16 else v).numpy() for k, v in expected().items()}
    return values | {"step": np.array(7), "note": np.array("dcp")}


@pytest.mark.parametrize("load_world", [1, 4])
def test_dcp_saved_by_two_ranks_loads_exactly_on_one_and_on_four(load_world, tmp_path, sqlite_service):
    job = f"dcp-{uuid.uuid4().hex[:6]}"
    storage = f"{sqlite_service.storage}/{job}"
    common = ["--storage", storage, "--job", job, "--service", sqlite_service.live.url]
    ranks(tmp_path, 2, "save", *common, module="tests.dcp_job")
    ranks(tmp_path, 2, "save", *common, "--epoch", "1", module="tests.dcp_job")
    if load_world == 1:
        loaded = final(run_job(tmp_path, "load", *common, module="tests.dcp_job"))
    else:
        loaded = final(ranks(tmp_path, 4, "load", *common, module="tests.dcp_job")[0])
    assert_bit_equal(loaded, dcp_expected())
    from ckptstore.client import ServiceClient

    with ServiceClient(sqlite_service.live.url) as client:
        assert client.last_good_epoch(job).resume.to_position() == Position(1, None)
        assert {r.node for r in client.list_checkpoints(job, epoch=1)} == {"node-0", "node-1"}
    store = Store(storage)
    (copy,) = store.copies(job, "node-1", Position(1))
    manifest = store.manifest(copy)
    assert manifest.metadata["format"] == "torch.distributed.checkpoint"


def test_a_corrupt_dcp_shard_is_never_loaded_and_the_next_load_falls_back(tmp_path, sqlite_service):
    job = f"dcp-{uuid.uuid4().hex[:6]}"
    storage = f"{sqlite_service.storage}/{job}"
    common = ["--storage", storage, "--job", job, "--service", sqlite_service.live.url]
    ranks(tmp_path, 2, "save", *common, module="tests.dcp_job")
    # Other values at epoch 1: a byte-identical state would share every blob with epoch 0, and damage to
    # a shared blob fails both positions on that tier (docs/layout.md, "Content-addressed blobs").
    ranks(tmp_path, 2, "save", *common, "--epoch", "1", "--shift", "1", module="tests.dcp_job")
    store = Store(storage)
    (copy,) = store.copies(job, "node-1", Position(1))
    manifest = store.manifest(copy)
    (old,) = store.copies(job, "node-1", Position(0))
    shared = {s.file for s in store.manifest(old).shards}
    own = next(s for s in reversed(manifest.shards) if s.file not in shared)
    shard = Path(store._storage.path(own.key(copy.relpath)))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10  # a byte inside the last tensor's data
    shard.write_bytes(bytes(data))
    out = tmp_path / "never.npz"
    failed = subprocess.run(
        [sys.executable, "-m", "tests.dcp_job", "load", *common, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert failed.returncode != 0 and "CorruptCheckpointError" in failed.stderr, failed.stderr[-2000:]
    assert "marked corrupt" in failed.stderr and not out.exists(), "nothing loaded"
    loaded = final(run_job(tmp_path, "load", *common, module="tests.dcp_job"))
    assert_bit_equal(loaded, dcp_expected())  # epoch 0, the previous good position, holds the same values
    from ckptstore.client import ServiceClient

    with ServiceClient(sqlite_service.live.url) as client:
        assert client.last_good_epoch(job).resume.to_position() == Position(0, None)


def test_state_trees_round_trip_python_values_exactly():
    state = {
        0: {"step": torch.tensor(3.0), "exp_avg": torch.arange(4.0)},
        "betas": (0.9, 0.999),
        "flags": [True, None, "x", 2**70, -0.0, math.inf],
        "nested": {"bf16": torch.ones(3, dtype=torch.bfloat16), "np": np.arange(3, dtype=np.int16)},
        "npscalar": np.float32(1.5),
    }
    arrays: dict[str, np.ndarray] = {}
    tree = flatten(state, "x", arrays)
    back = unflatten(tree, {k: v.copy() for k, v in arrays.items()})
    assert back["betas"] == (0.9, 0.999) and isinstance(back["betas"], tuple)
    assert back["flags"][:4] == [True, None, "x", 2**70] and math.copysign(1, back["flags"][4]) == -1
    assert back["flags"][5] == math.inf and set(back) == set(state) and 0 in back
    assert torch.equal(back[0]["exp_avg"], state[0]["exp_avg"]) and back[0]["step"].item() == 3.0
    assert back["nested"]["bf16"].dtype == torch.bfloat16 and torch.equal(
        back["nested"]["bf16"], state["nested"]["bf16"]
    )
    assert back["nested"]["np"].dtype == np.int16 and back["npscalar"] == np.float32(1.5)
    with pytest.raises(TypeError, match=r"x\['bad'\]: object values"):
        flatten({"bad": object()}, "x", {})


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 32)).square().mean().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("stepped", [True, False], ids=["stepped-optimizer", "fresh-optimizer"])
def test_a_local_restore_writes_into_the_live_tensors_exactly(stepped, tmp_path, monkeypatch):
    from ckptstore.client.torch import CheckpointManager
    from ckptstore.deferred import VerifiedTensors

    model, optimizer = _trained(0)
    objects = {"model": model, "optimizer": optimizer}
    with CheckpointManager(storage=str(tmp_path), job="inplace", node="n0", objects=objects, async_save=False) as mgr:
        mgr.restore_or_initialize()
        mgr.save(0)
    if stepped:
        fresh, fresh_optimizer = _trained(1)  # same structure, other values: restored in place
    else:
        fresh = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)  # no state yet: loaded from new tensors
    read_in_place: list[str] = []
    original = VerifiedTensors.read_into
    monkeypatch.setattr(
        VerifiedTensors, "read_into", lambda self, targets: read_in_place.extend(targets) or original(self, targets)
    )
    objects = {"model": fresh, "optimizer": fresh_optimizer}
    with CheckpointManager(storage=str(tmp_path), job="inplace", node="n0", objects=objects, async_save=False) as mgr:
        assert mgr.restore_or_initialize() == 1
    # The model always goes in place; the optimizer only once it has state of the saved structure.
    assert {key.split("/")[0] for key in read_in_place} == ({"model", "optimizer"} if stepped else {"model"})
    for saved, restored in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(saved, restored)
    saved_state, restored_state = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    assert saved_state.keys() == restored_state.keys()
    for index, slots in saved_state.items():
        for slot, value in slots.items():
            assert torch.equal(value, restored_state[index][slot]), (index, slot)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_loads_a_local_copy_straight_into_the_state_tensors(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from ckptstore.client.torch.dcp import CkptstoreReader, CkptstoreWriter
    from ckptstore.deferred import VerifiedTensors

    saved = {
        "w": torch.randn(64, 32),
        "half": torch.randn(16).to(torch.bfloat16),
        "step": torch.tensor(7),
        "extra": {"note": "kept"},
    }
    dcp.save(saved, storage_writer=CkptstoreWriter(str(tmp_path), "dcp1", 0))
    read_in_place: list[str] = []
    original = VerifiedTensors.read_into
    monkeypatch.setattr(
        VerifiedTensors, "read_into", lambda self, targets: read_in_place.extend(targets) or original(self, targets)
    )
    target = {"w": torch.zeros(64, 32), "half": torch.zeros(16, dtype=torch.bfloat16), "step": torch.tensor(0)}
    target["extra"] = {"note": ""}
    pointer = target["w"].data_ptr()
    dcp.load(target, storage_reader=CkptstoreReader(str(tmp_path), "dcp1"))
    assert target["w"].data_ptr() == pointer and torch.equal(target["w"], saved["w"])
    assert torch.equal(target["half"], saved["half"]) and int(target["step"]) == 7
    assert target["extra"] == {"note": "kept"}
    assert len(read_in_place) >= 2  # the tensors went straight into the state's memory


def test_a_save_before_restore_or_initialize_is_refused_and_writes_nothing(tmp_path):
    """A script that saves without restoring would train over copies already on storage without seeing
    them: the first save says what to call, and nothing is written."""
    from ckptstore.client.torch import CheckpointManager
    from ckptstore.errors import ConfigurationError

    model, _ = _trained(0)
    with CheckpointManager(objects={"model": model}, storage=str(tmp_path), job="early", node="n0") as mgr:
        with pytest.raises(ConfigurationError, match=r"restore_or_initialize\(\)"):
            mgr.save(0)
        assert Store(str(tmp_path)).list_positions("early", "n0") == []
        assert mgr.restore_or_initialize() == 0 and mgr.save(0)
