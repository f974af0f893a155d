"""Operations advice: goodput and the Young/Daly interval from a job's own records — computed from
histories whose answers are known (no failure yet, one, clustered ones, several nodes, a restart
from scratch), then through the service (`GET /v1/jobs/{job}/advice`) from what real clients report."""

from __future__ import annotations

import math

import pytest

from ckptstore.server.records.advice import Progress, Start, Timing, advise, goodput_over_time, usage_of


def steady_progress(until: float) -> list[Progress]:
    return [Progress(at, int(at)) for at in (500.0, until)]  # one step a second


def test_no_failure_yet_gives_goodput_and_no_interval():
    advice = advise(
        "j", [Start("n0", 1, 0.0, None)], steady_progress(1000.0), usage_of([Timing("n0", "blocked", 2.0, 0.0)] * 10)
    )
    assert advice.wall_seconds == 1000 and advice.lost_seconds == 0 and advice.blocked_seconds == 20
    assert advice.goodput == pytest.approx(0.98)
    assert advice.failures == 0 and advice.mtbf_seconds is None and advice.interval_seconds is None
    assert advice.interval_steps is None and "no interval until" in advice.note


def test_one_failure_counts_the_work_redone_but_gives_no_interval():
    starts = [Start("n0", 1, 0.0, None), Start("n0", 2, 600.0, 500.0)]
    advice = advise("j", starts, steady_progress(1000.0), usage_of([Timing("n0", "blocked", 1.0, 0.0)]))
    assert advice.lost_seconds == 100 and advice.failures == 1
    assert advice.goodput == pytest.approx((1000 - 100 - 1) / 1000)
    assert advice.mtbf_seconds is None and advice.interval_seconds is None


def test_clustered_failures_give_the_young_daly_interval_in_seconds_and_steps():
    starts = [
        Start("n0", 1, 0.0, None),
        Start("n0", 2, 1000.0, 900.0),  # 100 s redone
        Start("n0", 3, 1100.0, 1050.0),  # 50 s
        Start("n0", 4, 1200.0, 1050.0),  # 150 s: it resumed from the same copy again
    ]
    timings = [Timing("n0", "blocked", s, 0.0) for s in (2.0, 2.0, 4.0)] + [Timing("n0", "restore", 1.0, 0.0)] * 3
    advice = advise("j", starts, steady_progress(3000.0), usage_of(timings))
    assert advice.lost_seconds == 300 and advice.failures == 3 and advice.blocked_seconds == 8 + 3
    assert advice.mtbf_seconds == 1000 and advice.save_cost_seconds == 2
    assert advice.interval_seconds == pytest.approx(math.sqrt(2 * 2 * 1000))
    assert advice.interval_steps == 63, "one step a second"
    assert advice.goodput == pytest.approx((3000 - 300 - 11) / 3000)
    assert "rough estimate" in advice.note


def test_several_nodes_count_the_node_that_lost_and_waited_most_and_a_restart_from_scratch_loses_it_all():
    starts = [Start("a", 1, 0.0, None), Start("a", 2, 400.0, 350.0), Start("b", 1, 10.0, None)]
    starts += [Start("b", 2, 400.0, None)]  # b found nothing to resume from: everything since its start redone
    timings = [Timing("a", "blocked", 5.0, 0.0), Timing("b", "blocked", 1.0, 0.0), Timing("b", "restore", 2.0, 0.0)]
    advice = advise("j", starts, steady_progress(1000.0), usage_of(timings))
    assert advice.lost_seconds == 390 and advice.failures == 1 and advice.blocked_seconds == 5


def test_save_timings_stand_in_for_blocked_ones_from_clients_that_report_none():
    starts = [Start("n0", n, 100.0 * n, 100.0 * n - 10) for n in range(1, 4)]
    advice = advise("j", starts, steady_progress(1000.0), usage_of([Timing("n0", "save", 3.0, 0.0)]))
    assert advice.save_cost_seconds == 3 and advice.blocked_seconds == 3 and advice.interval_seconds is not None


def test_goodput_over_time_drops_at_each_failure_and_recovers_as_the_job_trains():
    starts = [Start("n0", 1, 0.0, None), Start("n0", 2, 500.0, 400.0)]  # 100 s redone at 500 s
    series = goodput_over_time("j", starts, steady_progress(1000.0), [Timing("n0", "blocked", 10.0, 100.0)], points=10)
    assert [round(at) for at, _ in series] == list(range(100, 1001, 100))
    goodput = dict(series)
    assert goodput[100.0] == pytest.approx(0.9), "10 s of the first 100 blocked"
    assert goodput[500.0] == pytest.approx((500 - 100 - 10) / 500), "the failure's redone work counts from its restart"
    assert goodput[1000.0] == pytest.approx((1000 - 100 - 10) / 1000)
    assert goodput_over_time("j", [], [], []) == []


def test_a_job_that_never_started_says_so():
    advice = advise("j", [], [], usage_of([]))
    assert advice.goodput is None and advice.failures == 0 and "no process" in advice.note


def test_the_service_answers_advice_from_what_clients_reported(tmp_path, sqlite_service):
    import uuid

    from ckptstore import Position
    from ckptstore.client import ServiceClient
    from ckptstore.client.engine.node import NodeCheckpointer
    from tests.builders import arrays_for

    job, url = f"advised-{uuid.uuid4().hex[:6]}", sqlite_service.live.url
    storage = f"{sqlite_service.storage}/{job}"
    for run in range(3):  # three starts: two failures, each resuming from the previous run's copy
        node = NodeCheckpointer(job=job, storage=storage, service=url, node="n0", async_save=False)
        node.start()
        node.save(Position(run), arrays_for(run), step=100 * (run + 1))
        node.reports.stats("blocked", 0.5, 0)
        node.close()
    with ServiceClient(url) as client:
        advice = client.advice(job)
    assert advice.failures == 2 and advice.save_cost_seconds == 0.5
    assert advice.mtbf_seconds == pytest.approx(advice.wall_seconds / 2)
    assert advice.interval_seconds == pytest.approx(math.sqrt(2 * 0.5 * advice.mtbf_seconds))
    assert 0 <= advice.goodput <= 1 and advice.lost_seconds >= 0
    with sqlite_service.client() as http:
        scraped = http.get("/metrics").text
    gauges = dict(
        line.rsplit(" ", 1) for line in scraped.splitlines() if line.startswith("ckptstore_job_") and job in line
    )
    assert float(gauges[f'ckptstore_job_goodput_ratio{{job="{job}"}}']) == pytest.approx(advice.goodput, abs=0.01)
    assert float(gauges[f'ckptstore_job_failures{{job="{job}"}}']) == 2
    interval = float(gauges[f'ckptstore_job_recommended_interval_seconds{{job="{job}"}}'])
    assert interval == pytest.approx(advice.interval_seconds, rel=0.05)
