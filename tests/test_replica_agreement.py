"""Replica agreement under DDP (real gloo processes): one flipped bit in rank 1's optimizer momentum
makes every later save not good, named (`replicas disagree: rank 1, tensor …`), evented and warned
on every rank, and the rerun resumes from the last save before the flip — bit-equal to a run that
never flipped; a control without the flip resumes from the newest save with nothing said; with 3
ranks the minority is named; the comparison itself (ckptstore/agreement.py) on known hashes. DCP:
HSDP's replica groups (4 ranks, 2 × 2) compared within each group, a flipped shard named and its save
never loaded."""

from __future__ import annotations

import uuid

import numpy as np

from ckptstore import Position, Store
from ckptstore.agreement import disagreement, disagreement_of, groups_disagreement, hashes, replica_groups
from ckptstore.client import ServiceClient
from tests.test_torch import assert_bit_equal, final, ranks

FLIP = ["--flip-rank", "1", "--flip-epoch", "0", "--flip-batch", "4"]  # after the save at 0.3
KILL = ["--kill-epoch", "1", "--kill-batch", "2"]
MOMENTUM = "optimizer['state'][0]['exp_avg']"  # the tensor flipped


def test_the_comparison_names_the_minority_or_the_rank_that_is_not_the_writer():
    same = {"model/00000": "00000001", "optimizer/00000": "00000002"}
    names = {"model/00000": "model['w']"}
    assert disagreement([same, same, same]) is None
    changed = same | {"optimizer/00000": "00000003"}
    assert disagreement([same, changed]) == "replicas disagree: rank 1, tensor optimizer/00000"
    assert (
        disagreement([same | {"model/00000": "9"}, same, same], names) == "replicas disagree: rank 0, tensor model['w']"
    )
    assert disagreement([same, changed, changed]) == "replicas disagree: rank 0, tensor optimizer/00000"
    assert disagreement([same, {"model/00000": "00000001"}]) == "replicas disagree: rank 1, tensor optimizer/00000"
    many = [dict.fromkeys("abcde", "0"), dict.fromkeys("abcde", "1")]
    assert disagreement(many) == "replicas disagree: rank 1, tensor a, b, c and 2 more"
    arrays = {"x": np.arange(4, dtype=np.float32)}
    flipped = {"x": arrays["x"].copy()}
    flipped["x"].view(np.int32)[0] ^= 1
    assert hashes(arrays) != hashes(flipped), "one bit is seen"


def test_a_flipped_bit_on_rank_1_is_caught_and_the_rerun_resumes_from_before_it(tmp_path, sqlite_service):
    storage, url = f"{sqlite_service.storage}/agree-{uuid.uuid4().hex[:6]}", sqlite_service.live.url
    common = ["--storage", storage, "--service", url]
    baseline = ranks(tmp_path, 2, *common, "--job", f"agree-base-{uuid.uuid4().hex[:6]}")
    job = f"agree-{uuid.uuid4().hex[:6]}"
    killed = ranks(tmp_path, 2, *common, "--job", job, *FLIP, *KILL, killed_rank=0)
    assert all("replicas disagree: rank 1, tensor" in out and MOMENTUM in out for out in killed), "said on every rank"
    with ServiceClient(url) as client:
        answer = client.last_good_epoch(job)
    with sqlite_service.client() as http:
        page = http.get("/v1/events", params={"job": job, "types": "replicas.disagreed", "format": "json", "after": 0})
    events = page.json()["events"]
    assert (answer.resume.epoch, answer.resume.batch) == (0, 3), "the newest position where the replicas agreed"
    reasons = [g.reasons.get("node-0", "") for g in answer.not_good]
    assert reasons and all(r.startswith("replicas disagree: rank 1, tensor") and MOMENTUM in r for r in reasons), answer
    assert events and events[0]["data"]["cause"] == "agreement" and "rank 1" in events[0]["data"]["reason"]
    resumed = ranks(tmp_path, 2, *common, "--job", job)
    assert [r.splitlines()[0] for r in resumed] == ["RESUMED 0 3", "RESUMED 0 3"]
    for got, want in zip(resumed, baseline, strict=True):
        assert_bit_equal(final(got), final(want))
    assert Store(storage).list_nodes(job) == ["node-0"]


def test_without_a_service_the_copy_itself_says_its_replicas_disagreed(tmp_path):
    """No service to mark it: restore reads the disagreement from the copy's manifest and passes over it."""
    storage, job = str(tmp_path / "ckpt"), f"agree-solo-{uuid.uuid4().hex[:6]}"
    baseline = ranks(tmp_path, 2, "--storage", str(tmp_path / "base"), "--job", job)
    ranks(tmp_path, 2, "--storage", storage, "--job", job, *FLIP, *KILL, killed_rank=0)
    resumed = ranks(tmp_path, 2, "--storage", storage, "--job", job)
    assert [r.splitlines()[0] for r in resumed] == ["RESUMED 0 3", "RESUMED 0 3"]
    assert "replicas disagree: rank 1" in resumed[0], "the skipped copies are said"
    for got, want in zip(resumed, baseline, strict=True):
        assert_bit_equal(final(got), final(want))


def test_agreeing_replicas_resume_from_the_newest_save_and_nothing_is_said(tmp_path, sqlite_service):
    storage, url = f"{sqlite_service.storage}/agree-{uuid.uuid4().hex[:6]}", sqlite_service.live.url
    job = f"agree-ok-{uuid.uuid4().hex[:6]}"
    killed = ranks(tmp_path, 2, "--storage", storage, "--service", url, "--job", job, *KILL, killed_rank=0)
    assert not any("replicas disagree" in out for out in killed)
    with ServiceClient(url) as client:
        answer = client.last_good_epoch(job)
    assert (answer.resume.epoch, answer.resume.batch) == (0, None) and answer.not_good == [], answer
    (copy,) = Store(storage).copies(job, "node-0", Position(0))
    manifest = Store(storage).manifest(copy)
    agreement = manifest.metadata["replica_agreement"]
    assert agreement["checked"] is True, agreement  # an unchecked copy says why
    assert agreement["differing"] == {} and disagreement_of(manifest) is None
    assert len(agreement["replicas"]) == len(agreement["names"]) > 0, "every tensor compared, named"


def test_with_three_replicas_the_minority_is_named(tmp_path, sqlite_service):
    storage, url = f"{sqlite_service.storage}/agree-{uuid.uuid4().hex[:6]}", sqlite_service.live.url
    job = f"agree-3-{uuid.uuid4().hex[:6]}"
    ranks(tmp_path, 3, "--storage", storage, "--service", url, "--job", job, *FLIP)
    with ServiceClient(url) as client:
        records = [r for r in client.list_checkpoints(job) if r.state == "corrupt"]
    assert records and all(r.reason.startswith("replicas disagree: rank 1, tensor ") for r in records)


def test_a_preemption_save_compares_nothing_and_its_copy_says_so(tmp_path, monkeypatch):
    """A SIGTERM'd rank saves alone: a collective would wait for ranks that are not saving (here none
    exists — torch.distributed is not initialised — so any collective tried would raise)."""
    from tests.test_resume_audit import run

    manager, *_ = run(str(tmp_path / "ckpt"), "preempted")
    monkeypatch.setattr(manager, "_world", lambda: (2, 0))
    manager._gather(collective=False)
    agreement = manager._compare_replicas(captured=True)["replica_agreement"]
    assert agreement["checked"] is False and agreement["why"].startswith("a preemption's save"), agreement
    manager.close()


def test_sharded_replica_groups_name_their_minority_or_both_members_of_a_pair():
    agreeing = {"model.w": "1", "model.w[5, 0]": "2", "bias": "3"}
    assert groups_disagreement(replica_groups([agreeing] * 4)) is None
    assert replica_groups([agreeing] * 4)["replica_agreement"]["compared"] == 3
    alone = [{"model.w": "1"}, {"model.w[5, 0]": "2"}]  # FSDP: every shard one rank's own
    assert (
        replica_groups(alone)["replica_agreement"]["compared"] == 0
        and groups_disagreement(replica_groups(alone)) is None
    )
    three = [{"model.w": "1"}, {"model.w": "1"}, {"model.w": "9"}]  # HSDP, three replicas of one shard
    assert groups_disagreement(replica_groups(three)) == "replicas disagree: rank 2, tensor model.w"
    pair = [{"model.w[5, 0]": "2"}, {"model.w[5, 0]": "7"}]  # two replicas: neither can be told right
    assert groups_disagreement(replica_groups(pair)) == "replicas disagree: ranks 0, 1, tensor model.w[5, 0]"
    assert replica_groups([agreeing, None])["replica_agreement"] == {
        "ranks": 2,
        "checked": False,
        "why": "rank(s) 1 could not hash their state",
    }


def test_an_hsdp_replica_that_differs_is_named_its_save_is_not_good_and_loads_go_to_the_save_before(
    tmp_path, sqlite_service
):
    """4 gloo ranks in HSDP's layout (2 replica groups × 2 shards): a save whose replicas agree is
    good; one bit flipped in rank 1's shard (its replica is rank 3's) at the next save → every rank
    says so, the position is not good, and a load — through the service or from storage alone —
    reads the save before, bit-equal."""
    from tests.test_torch import dcp_expected

    job = f"hsdp-{uuid.uuid4().hex[:6]}"
    storage, url = f"{sqlite_service.storage}/{job}", sqlite_service.live.url
    common = ["--storage", storage, "--job", job, "--replicas", "2"]
    agreed = ranks(tmp_path, 4, "save", *common, "--service", url, module="tests.dcp_job")
    assert not any("disagree" in out for out in agreed)
    flipped = ranks(
        tmp_path, 4, "save", *common, "--service", url, "--epoch", "1", "--shift", "1", "--flip", "1",
        module="tests.dcp_job",
    )  # fmt: skip
    reason = "replicas disagree: ranks 1, 3, tensor model.w[5, 0]"
    assert all(reason in out for out in flipped), flipped[0][-1500:]
    store = Store(storage)
    coordinator = [store.manifest(copy) for epoch in (0, 1) for copy in store.copies(job, "node-0", Position(epoch))]
    assert [disagreement_of(manifest) for manifest in coordinator] == [None, reason]
    assert coordinator[0].metadata["replica_agreement"]["compared"] > 0, "the agreeing save was compared"
    with ServiceClient(url) as client:
        answer = client.last_good_epoch(job)
        marked = [r for r in client.list_checkpoints(job, epoch=1) if r.state == "corrupt"]
    assert answer.resume.to_position() == Position(0, None) and [r.reason for r in marked] == [reason]
    for service in (["--service", url], []):
        loaded = final(ranks(tmp_path, 4, "load", *common, *service, module="tests.dcp_job")[0])
        assert_bit_equal(loaded, dcp_expected())  # epoch 0's values: epoch 1 saved them shifted by 1


def test_the_step_after_a_save_waits_until_the_state_saved_is_hashed():
    """Ranks other than the writer hash parameters and optimizer state in the background: the next
    optimizer step (the only thing that changes them) is held until then — and only then."""
    import threading

    import torch

    from ckptstore.client.torch.replicas import StepGuard, _step_owned

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    owned = _step_owned({"model": model, "optimizer": optimizer})
    assert {p.data_ptr() for p in model.parameters()} <= owned
    assert optimizer.state[model.weight]["exp_avg"].data_ptr() in owned
    guard = StepGuard({"model": model, "optimizer": optimizer})
    before = model.weight.detach().clone()
    guard.hold()
    stepping = threading.Thread(target=optimizer.step)
    stepping.start()
    stepping.join(0.5)
    assert stepping.is_alive() and torch.equal(model.weight, before), "held: the hashed state is unchanged"
    guard.release()
    stepping.join(5)
    assert not stepping.is_alive() and not torch.equal(model.weight, before)
    unheld = threading.Thread(target=optimizer.step)
    unheld.start()
    unheld.join(5)
    assert not unheld.is_alive(), "nothing held: the step runs at once"
