"""The canonical DDP loop — a plain `DataLoader` over a `DistributedSampler`, `sampler.set_epoch(epoch)`,
`enumerate(loader, start=mgr.first_batch(epoch))`, the loader in `objects` — resumes mid-epoch
bit-exactly on the same world size (real gloo processes, SIGKILL mid-epoch), and on another world
size each rank continues the epoch's global order from the saved global count: over the interrupted
epoch every sample is trained exactly once, and the next epoch too (client/torch/distributed.py)."""

from __future__ import annotations

import json
import os
import uuid

import pytest

from ckptstore import Position, Store
from ckptstore.client.torch.distributed import rest_of_epoch
from ckptstore.names import attempt_sort_key
from tests.job_runs import settled_verdict
from tests.test_torch import assert_bit_equal, final, ranks


def test_the_ddp_tutorial_loop_resumes_mid_epoch_bit_exactly(tmp_path, sqlite_service):
    common = ["--storage", f"{sqlite_service.storage}/ddp-{uuid.uuid4().hex[:6]}", "--loader", "ddp"]
    common += ["--service", sqlite_service.live.url]
    baseline = ranks(tmp_path, 2, *common, "--job", f"ddp-base-{uuid.uuid4().hex[:6]}")
    job = ["--job", f"ddp-loop-{uuid.uuid4().hex[:6]}"]
    ranks(tmp_path, 2, *common, *job, "--kill-epoch", "1", "--kill-batch", "4", killed_rank=0)
    resumed = ranks(tmp_path, 2, *common, *job)
    assert [r.splitlines()[0] for r in resumed] == ["RESUMED 1 3", "RESUMED 1 3"]
    assert all("resume audit: exact" in r for r in resumed), resumed[0][-2000:]
    for got, want in zip(resumed, baseline, strict=True):
        assert_bit_equal(final(got), final(want))


def test_a_plain_loader_over_another_sampler_is_still_refused_with_what_is_accepted():
    torch = pytest.importorskip("torch")
    from ckptstore.client.torch import CheckpointManager

    dataset = torch.utils.data.TensorDataset(torch.zeros(8, 1))
    with pytest.raises(TypeError, match="DistributedSampler"):  # a plain DataLoader shuffling on its own
        CheckpointManager(
            objects={"data": torch.utils.data.DataLoader(dataset, shuffle=True)}, storage="/tmp/x", job="j"
        )


def trained_in(tmp_path, run: str) -> list[dict]:
    return [json.loads(line) for path in sorted(tmp_path.glob(f"{run}-rank*.jsonl")) for line in path.open()]


def elastic_ranks(
    tmp_path, world: int, run: str, *args: str, killed: bool = False, module: str = "tests.elastic_job"
) -> list[str]:
    """A job that records what it trains (tests.elastic_job, hf_elastic_job, lightning_elastic_job) as
    `world` gloo ranks, each appending what it trains to <run>-rank<r>.jsonl."""
    outputs = ranks(tmp_path, world, *args, killed_rank=0 if killed else None, module=module)
    for rank, output in enumerate(outputs):
        written = output.rsplit("OUT ", 1)[1].strip()
        os.replace(written, tmp_path / f"{run}-rank{rank}.jsonl")
    return outputs


@pytest.mark.parametrize(
    ("before", "after", "kill_batch", "loader"),
    [(4, 2, 5, "plain"), (2, 3, 7, "plain"), (4, 2, 5, "stateful")],  # the newest save: 0.4 (128 of 480), 0.6 (96)
    ids=["4-to-2", "2-to-3", "4-to-2-stateful-2-workers"],
)
def test_a_restart_on_another_world_size_trains_every_sample_of_the_epoch_once(
    tmp_path, before, after, kill_batch, loader
):
    storage, job = str(tmp_path / "ckpt"), f"elastic-{uuid.uuid4().hex[:6]}"
    common = ["--storage", storage, "--job", job, "--loader", loader]
    elastic_ranks(
        tmp_path, before, "killed", *common, "--kill-epoch", "0", "--kill-batch", str(kill_batch), killed=True
    )
    outputs = elastic_ranks(tmp_path, after, "resumed", *common)
    resumed_at = kill_batch - 1
    assert {o.splitlines()[0] for o in outputs} == {f"RESUMED 0 {resumed_at}"}
    assert all(
        "resume audit: resharded" in o and f"saved by {before} process(es), restoring into {after}" in o
        for o in outputs
    )
    kept = [
        i for r in trained_in(tmp_path, "killed") if r["epoch"] == 0 and r["batch"] < resumed_at for i in r["indices"]
    ]
    rest = [i for r in trained_in(tmp_path, "resumed") if r["epoch"] == 0 for i in r["indices"]]
    assert sorted(kept + rest) == list(range(480)), "every sample of the interrupted epoch once"
    following = [i for r in trained_in(tmp_path, "resumed") if r["epoch"] == 1 for i in r["indices"]]
    assert sorted(following) == list(range(480)), "and of the next epoch, on the new world size"


def test_a_second_restart_counts_from_the_resharded_position(tmp_path):
    """4 ranks killed after the save at 0.4 (128 of 480 samples), 2 ranks resume and are killed after
    the save at 0.8 — 4 batches of 2 × 8 later: 192 — and 3 ranks finish: every sample of the epoch
    once (a save after a resharded resume counts from the resumed count, not batch × size × world)."""
    storage, job = str(tmp_path / "ckpt"), f"elastic-twice-{uuid.uuid4().hex[:6]}"
    common = ["--storage", storage, "--job", job]
    elastic_ranks(tmp_path, 4, "first", *common, "--kill-epoch", "0", "--kill-batch", "5", killed=True)
    second = ["--kill-epoch", "0", "--kill-batch", "9"]
    assert elastic_ranks(tmp_path, 2, "second", *common, *second, killed=True)[0].startswith("RESUMED 0 4")
    outputs = elastic_ranks(tmp_path, 3, "third", *common)
    assert {o.splitlines()[0] for o in outputs} == {"RESUMED 0 8"}
    trained = [
        i
        for run, before in (("first", 4), ("second", 8), ("third", None))
        for r in trained_in(tmp_path, run)
        if r["epoch"] == 0 and (before is None or r["batch"] < before)
        for i in r["indices"]
    ]
    assert sorted(trained) == list(range(480)), "every sample of the interrupted epoch once, over three worlds"


@pytest.mark.parametrize(
    ("framework", "before", "after", "every", "kill_at", "resumed", "padding"),
    [
        ("hf", 2, 2, 2, 5, 4, 0),  # every rank restores rank 0's copy: exact
        ("hf", 2, 1, 2, 5, 4, 0),  # 96 samples, batches of 8: the newest save 0.4, 64 samples
        ("hf", 1, 2, 2, 7, 6, 0),
        ("hf", 1, 2, 3, 4, 3, 8),  # 3 batches: a step of 2 ranks, and one skipped in the sampler
        ("lightning", 2, 2, 2, 5, 4, 0),
        ("lightning", 2, 1, 2, 5, 4, 0),
        ("lightning", 1, 2, 2, 7, 6, 0),
        ("lightning", 1, 2, 3, 4, 3, 0),  # 24 samples: 1 batch of 2 ranks, and 8 samples shared out
    ],
    ids=[
        "hf-2-to-2",
        "hf-2-to-1",
        "hf-1-to-2",
        "hf-1-to-2-uneven",
        "lightning-2-to-2",
        "lightning-2-to-1",
        "lightning-1-to-2",
        "lightning-1-to-2-uneven",
    ],
)
def test_a_trainer_restarted_on_another_world_size_trains_every_sample_once(
    tmp_path, framework, before, after, every, kill_at, resumed, padding
):
    """Under DDP every rank restores rank 0's copy (on the saved world size: exact). Hugging Face's
    `Trainer` and Lightning count batches per rank: on another world size the save's global count is
    resumed instead, and their counters set to it on the new world size. HF's 1 → 2 from an odd count
    of batches leaves 9 for 2 ranks, so accelerate pads the last rank's with a batch from the epoch's
    start (as its own runs do when the batches do not share evenly); Lightning's sampler shares samples."""
    pytest.importorskip("transformers" if framework == "hf" else "lightning", reason="the extra is not installed")
    module = f"tests.{framework}_elastic_job"
    storage, job = str(tmp_path / "ckpt"), f"{framework}-elastic-{uuid.uuid4().hex[:6]}"
    common = ["--storage", storage, "--job", job, "--every", str(every)]
    elastic_ranks(tmp_path, before, "killed", *common, "--kill-at", str(kill_at), killed=True, module=module)
    outputs = elastic_ranks(tmp_path, after, "resumed", *common, module=module)
    assert {o.split("\nSTDERR ")[0].splitlines()[-1] for o in outputs} == {f"RESUMED 0 {resumed}"}
    # Lightning's DistributedSampler loaders are watched; the HF Trainer's batches are not (its step is).
    said = "unverified" if framework == "hf" else "exact" if before == after else "resharded"
    assert all(settled_verdict(o) == said for o in outputs), outputs[0][-3000:]
    assert before == after or all(f"saved by {before} process(es), restoring into {after}" in o for o in outputs)
    kept = [i for r in trained_in(tmp_path, "killed") if r["epoch"] == 0 and r["batch"] < resumed for i in r["indices"]]
    rest = [i for r in trained_in(tmp_path, "resumed") if r["epoch"] == 0 for i in r["indices"]]
    assert set(kept + rest) == set(range(96)) and len(kept + rest) == 96 + padding, "every sample of the epoch once"
    following = [i for r in trained_in(tmp_path, "resumed") if r["epoch"] == 1 for i in r["indices"]]
    assert sorted(following) == list(range(96)), "and the next epoch on the new world size"
    keys = Store(storage).manifest_keys(job, "node-0")
    newest = max((key.attempt for key in keys), key=attempt_sort_key)
    after_resume = sorted(key.position for key in keys if key.attempt == newest)
    assert after_resume[0] > Position(0, resumed), "positions go on from the one resumed from"


def test_resharded_only_when_the_world_alone_changed_and_every_data_object_reshards():
    from ckptstore.fingerprint import verdict

    world = ["world size: saved by 4 process(es), restoring into 2"]
    resharding = {"data": {"data": {"type": "DataLoader", "reshards": True}}}
    assert verdict([], resharding) == "exact"
    assert verdict(world, resharding) == "resharded"
    assert (
        verdict(world + ["rank 3: RNG from rank 0 (the checkpoint holds the RNG of 2 rank(s))"], resharding)
        == "resharded"
    )
    assert verdict(world + ["data (data): batch size 8 → 16"], resharding) == "drift", "another change too"
    assert verdict(world, {"data": {"data": {"type": "StatefulDataLoader"}}}) == "drift", "a loader that cannot reshard"
    assert verdict(world, {"data": {}}) == "drift", "no data object: nothing says the order goes on"


def test_per_rank_state_saved_by_4_ranks_is_refused_on_2_naming_it(tmp_path):
    """Per-rank state without DCP cannot be resharded: the smaller restart refuses (exit 79), naming it."""
    storage, job = str(tmp_path / "ckpt"), f"per-rank-{uuid.uuid4().hex[:6]}"
    common = ["--storage", storage, "--job", job, "--per-rank"]
    ranks(tmp_path, 4, *common, "--kill-epoch", "1", "--kill-batch", "4", killed_rank=0)
    refused = ranks(tmp_path, 2, *common, killed_rank=0)  # rank 0's refusal ends the job: the others are stopped
    assert "ResumeRefusedError" in refused[0] and "saved by 4 rank(s); this run has 2 (rank 0)" in refused[0]


def test_a_lightning_copy_with_global_counts_is_refused_where_the_loader_has_no_distributed_sampler(tmp_path):
    """The counts cannot be carried over to a loader Lightning left without a DistributedSampler (a
    single-device strategy): refused, naming why, never resumed from the epoch's start; and the
    refusal is only that — a loader with one takes the count."""
    pytest.importorskip("lightning", reason="the [lightning] extra is not installed")
    import torch

    from ckptstore.client.lightning import BackupAndRestore
    from ckptstore.client.torch.distributed import DistributedLoaderPosition
    from ckptstore.errors import ResumeRefusedError

    dataset = torch.utils.data.TensorDataset(torch.arange(96))
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=2, rank=0, seed=0)
    distributed = torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler)
    state = DistributedLoaderPosition(distributed).state_dict() | {"consumed": 32, "batch": 2}
    callback = BackupAndRestore(storage=str(tmp_path / "ckpt"), job="refused")
    callback._loaders_ready([torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True)])
    with pytest.raises(ResumeRefusedError, match="DistributedSampler"):
        callback._go_on_from_counts([object()], [state], Position(0, 2), None)
    callback._loaders_ready([distributed])
    callback._go_on_from_counts([distributed], [state], Position(0, 2), None)
    sampler.set_epoch(state["epoch"])
    (first,) = next(iter(distributed))
    assert first.tolist() == rest_of_epoch(sampler, state["epoch"], 32)[:8], "the rest of the epoch from its count"


def test_a_lightning_copy_from_a_single_device_run_resumed_on_more_ranks_says_why_it_is_not_resharded(tmp_path):
    """Lightning's single-device strategy keeps the loader's RandomSampler: no global count is saved, so
    on 2 ranks the audit says drift and a warning names the cause and the remedy (strategy='ddp')."""
    pytest.importorskip("lightning", reason="the [lightning] extra is not installed")
    module = "tests.lightning_elastic_job"
    common = ["--storage", str(tmp_path / "ckpt"), "--job", f"single-{uuid.uuid4().hex[:6]}"]
    elastic_ranks(tmp_path, 1, "killed", *common, "--single-device", "--kill-at", "5", killed=True, module=module)
    outputs = elastic_ranks(tmp_path, 2, "resumed", *common, module=module)
    for output in outputs:
        assert "resume audit: DRIFT" in output and "saved by 1 process(es), restoring into 2" in output
        assert "whose loaders had no DistributedSampler" in output and "strategy='ddp'" in output, output[-2000:]


def test_a_trainer_whose_order_does_not_go_on_on_another_world_size_says_drift_and_why(tmp_path):
    """A sampler other than accelerate's seedable random one (here `train_sampling_strategy="sequential"`)
    draws no global order ckptstore can continue: on 1 rank after 2 the audit says drift and a warning
    names the sampler."""
    pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    module = "tests.hf_elastic_job"
    common = [
        "--storage",
        str(tmp_path / "ckpt"),
        "--job",
        f"hf-seq-{uuid.uuid4().hex[:6]}",
        "--sampling",
        "sequential",
    ]
    elastic_ranks(tmp_path, 2, "killed", *common, "--kill-at", "5", killed=True, module=module)
    (output,) = elastic_ranks(tmp_path, 1, "resumed", *common, module=module)
    assert "resume audit: DRIFT" in output and "saved by 2 process(es), restoring into 1" in output
    assert "train_sampling_strategy='sequential'" in output, output[-2000:]
