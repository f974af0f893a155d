"""Retention planning: a pure function; the last good epoch, resume position and newer never go."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore.copykey import CopyKey
from ckptstore.position import Position
from ckptstore.retention import Candidate, RetentionPolicy, good_positions, plan_deletions, protected

NODES = ("n0", "n1", "n2")
NOW = 1_000_000.0
OLD = NOW - 10_000


def candidate(node, position, attempt, committed, modified, metric=None):
    return Candidate(CopyKey("job", node, position, attempt), committed, modified, metric)


def committed(epochs, nodes=NODES, batch=None, attempt="1", metric=None):
    return [candidate(n, Position(e, batch), attempt, True, OLD, metric) for e in epochs for n in nodes]


def deleted_positions(plan):
    return sorted({d.key.position for d in plan if d.reason == "retention"})


def test_good_needs_every_expected_node():
    candidates = committed(range(3)) + committed([3], nodes=("n0", "n1"))
    assert good_positions(candidates, NODES) == {Position(0), Position(1), Position(2)}
    assert good_positions(candidates, ()) == set()


def test_keep_last_keeps_the_newest_good_positions_and_everything_from_the_last_good_epoch_on():
    candidates = committed(range(10)) + committed([10], nodes=("n0",))
    good = good_positions(candidates, NODES)
    plan = plan_deletions(candidates, good=good, policy=RetentionPolicy(keep_last=3), now=NOW)
    assert deleted_positions(plan) == [Position(e) for e in range(7)]
    assert all(d.key.position.epoch < 7 for d in plan)
    by_position = {}
    for d in plan:
        by_position.setdefault(d.key.position, set()).add(d.key.node)
    assert all(nodes == set(NODES) for nodes in by_position.values()), "a position goes with every node's part"


def test_the_last_good_epoch_and_the_resume_position_are_protected_and_mid_epoch_positions_count():
    candidates = committed(range(4)) + committed([4], batch=100) + committed([4], batch=50)
    candidates += committed([4], batch=150, nodes=("n0",))  # newer than the resume position: being written
    good = good_positions(candidates, NODES)
    assert protected(good) == (Position(3), Position(4, 100))
    plan = plan_deletions(candidates, good=good, policy=RetentionPolicy(keep_last=1), now=NOW)
    assert deleted_positions(plan) == [Position(0), Position(1), Position(2), Position(4, 50)]


def test_saving_every_few_batches_keeps_storage_bounded():
    candidates = []
    for epoch in range(6):
        for batch in (5, 10, 15, 20, 25, 30, 35, 40):
            candidates += committed([epoch], batch=batch)
        candidates += committed([epoch])
    good = good_positions(candidates, NODES)
    plan = plan_deletions(candidates, good=good, policy=RetentionPolicy(keep_last=3), now=NOW)
    kept = sorted(good - set(deleted_positions(plan)))
    assert kept == [Position(5, 35), Position(5, 40), Position(5)], "the 3 newest positions (the last epoch among them)"
    mid = candidates + committed([6], batch=5) + committed([6], batch=10)
    good = good_positions(mid, NODES)
    plan = plan_deletions(mid, good=good, policy=RetentionPolicy(keep_last=3), now=NOW)
    assert sorted(good - set(deleted_positions(plan))) == [Position(5), Position(6, 5), Position(6, 10)]


def test_only_mid_epoch_good_protects_from_the_resume_position():
    candidates = committed([0], batch=10) + committed([0], batch=20)
    good = good_positions(candidates, NODES)
    plan = plan_deletions(candidates, good=good, policy=RetentionPolicy(keep_last=1), now=NOW)
    assert deleted_positions(plan) == [Position(0, 10)]


def test_keep_every_and_keep_best():
    candidates = []
    for epoch in range(12):
        candidates += committed([epoch], metric=float(abs(epoch - 4)))
    good = good_positions(candidates, NODES)
    plan = plan_deletions(
        candidates,
        good=good,
        policy=RetentionPolicy(keep_last=2, keep_every=5, keep_best=2, best_metric="loss"),
        now=NOW,
    )
    kept = set(range(12)) - {p.epoch for p in deleted_positions(plan)}
    assert kept == {0, 5, 10, 11} | {4, 3}, "every 5th, the 2 newest, the 2 best (lowest metric)"


def test_no_policy_keeps_every_committed_position():
    candidates = committed(range(5))
    assert plan_deletions(candidates, good=good_positions(candidates, NODES), policy=RetentionPolicy(), now=NOW) == []


def test_nothing_good_means_nothing_is_deleted_by_retention():
    candidates = committed(range(5), nodes=("n0",))
    plan = plan_deletions(candidates, good=set(), policy=RetentionPolicy(keep_last=1), now=NOW)
    assert plan == []


def test_superseded_attempts_and_leftovers_go_only_after_the_grace_period():
    candidates = committed([5]) + [
        candidate("n0", Position(5), "2", True, OLD),
        candidate("n1", Position(5), "3", True, NOW - 10),
        candidate("n1", Position(6), "4", False, OLD),
        candidate("n2", Position(6), "4", False, NOW - 10),
    ]
    plan = plan_deletions(candidates, good=good_positions(candidates, NODES), policy=RetentionPolicy(), now=NOW)
    assert {(d.key.node, d.key.position.epoch, d.key.attempt, d.reason) for d in plan} == {
        ("n0", 5, "1", "superseded"),
        ("n1", 6, "4", "uncommitted"),
    }, "n1's attempt 1 is superseded by a fresh attempt 3 but younger than grace: kept"


def test_policy_is_validated():
    for bad in (
        dict(keep_last=0),
        dict(keep_every=-1),
        dict(keep_best=2),
        dict(best_metric="x"),
        dict(grace_seconds=-1),
    ):
        with pytest.raises(ValueError):
            RetentionPolicy(**bad)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 8), st.sampled_from([None, 10, 20]), st.sampled_from(NODES)), max_size=40),
    st.integers(1, 4),
    st.one_of(st.none(), st.integers(1, 3)),
)
def test_never_deletes_the_protected_range_or_part_of_a_kept_position(entries, keep_last, keep_every):
    candidates = [candidate(n, Position(e, b), "1", True, OLD) for e, b, n in set(entries)]
    good = good_positions(candidates, NODES)
    plan = plan_deletions(
        candidates, good=good, policy=RetentionPolicy(keep_last=keep_last, keep_every=keep_every), now=NOW
    )
    last_epoch, resume = protected(good)
    doomed = {d.key.position for d in plan}
    for d in plan:
        assert resume is not None and d.key.position < resume and d.key.position != last_epoch
    for c in candidates:
        if c.key.position in doomed:
            assert any(d.key.node == c.key.node and d.key.position == c.key.position for d in plan), (
                "whole positions only"
            )
    kept_good = sorted(good - doomed)
    assert kept_good[-min(keep_last, len(good)) :] == sorted(good)[-min(keep_last, len(good)) :]
