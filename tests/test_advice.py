"""Operations advice: goodput and the Young/Daly interval from a job's own records — histories whose
answers are known (no failure yet, one, clustered ones, several nodes, a restart from scratch) written
into a real database and summed by it, then through the service (`GET /v1/jobs/{job}/advice`) from
what real clients report; what one request reads stays the same as the history grows."""

from __future__ import annotations

import math
import sqlite3

import pytest
from sqlalchemy import create_engine, func, insert, select
from sqlalchemy.orm import Session

from ckptstore.server.db.migrate import migrate
from ckptstore.server.db.models import Attempt, Checkpoint, Job, Stat
from ckptstore.server.records.advice import COST_SAMPLE, PLOT_POINTS, job_advice, job_goodput

BATCH_KEY_END = 10**10  # an epoch-end position's batch key


class CountingCursor(sqlite3.Cursor):
    """Counts the rows every query hands back from the database."""

    rows = 0

    def fetchone(self):
        row = super().fetchone()
        CountingCursor.rows += row is not None
        return row

    def fetchmany(self, *args, **kwargs):
        rows = super().fetchmany(*args, **kwargs)
        CountingCursor.rows += len(rows)
        return rows

    def fetchall(self):
        rows = super().fetchall()
        CountingCursor.rows += len(rows)
        return rows


class CountingConnection(sqlite3.Connection):
    def cursor(self, factory=CountingCursor):
        return super().cursor(factory)


class History:
    """One job's starts, commits and timings in a SQLite database, as the service records them."""

    def __init__(self, path):
        migrate(f"sqlite:///{path}/advice.sqlite")
        self.engine = create_engine(
            "sqlite://", creator=lambda: sqlite3.connect(f"{path}/advice.sqlite", factory=CountingConnection)
        )
        self.session = Session(self.engine)
        self.job = Job(name="j", storage_root="/s", retention={}, created_at=0.0, updated_at=0.0)
        self.session.add(self.job)
        self.session.flush()
        self.epochs = 0

    def commit(self, at: float, step: int | None = None, node: str = "n0") -> int:
        """A committed copy at a new epoch; its epoch."""
        self.epochs += 1
        self.session.add(
            Checkpoint(
                job_id=self.job.id, node=node, epoch=self.epochs, batch_key=BATCH_KEY_END, attempt="1",
                attempt_number=1, step=step, location="x", bytes=1, checksums={}, metrics={}, created_at=at,
            )
        )  # fmt: skip
        return self.epochs

    def start(self, node: str, number: int, at: float, resumed_copy_at: float | None = None) -> None:
        """A process start; `resumed_copy_at`: it resumed from a copy committed then."""
        epoch = None if resumed_copy_at is None else self.commit(resumed_copy_at)
        self.session.add(
            Attempt(
                job_id=self.job.id, node=node, number=number, started_at=at, skipped=[],
                resumed_epoch=epoch, resumed_batch_key=None if epoch is None else BATCH_KEY_END,
            )
        )  # fmt: skip

    def steady_progress(self, until: float) -> None:
        for at in (500.0, until):  # one step a second
            self.commit(at, step=int(at))

    def timing(self, node: str, action: str, seconds: float, at: float = 0.0) -> None:
        self.session.add(Stat(job_id=self.job.id, node=node, action=action, seconds=seconds, created_at=at))

    def advice(self):
        self.session.flush()
        return job_advice(self.session, self.job)


@pytest.fixture
def history(tmp_path):
    history = History(tmp_path)
    yield history
    history.session.close()
    history.engine.dispose()


def test_no_failure_yet_gives_goodput_and_no_interval(history):
    history.start("n0", 1, 0.0)
    history.steady_progress(1000.0)
    for _ in range(10):
        history.timing("n0", "blocked", 2.0)
    advice = history.advice()
    assert advice.wall_seconds == 1000 and advice.lost_seconds == 0 and advice.blocked_seconds == 20
    assert advice.goodput == pytest.approx(0.98)
    assert advice.failures == 0 and advice.mtbf_seconds is None and advice.interval_seconds is None
    assert advice.interval_steps is None and "no interval until" in advice.note


def test_one_failure_counts_the_work_redone_but_gives_no_interval(history):
    history.start("n0", 1, 0.0)
    history.start("n0", 2, 600.0, resumed_copy_at=500.0)
    history.steady_progress(1000.0)
    history.timing("n0", "blocked", 1.0)
    advice = history.advice()
    assert advice.lost_seconds == 100 and advice.failures == 1
    assert advice.goodput == pytest.approx((1000 - 100 - 1) / 1000)
    assert advice.mtbf_seconds is None and advice.interval_seconds is None


def test_clustered_failures_give_the_young_daly_interval_in_seconds_and_steps(history):
    history.start("n0", 1, 0.0)
    history.start("n0", 2, 1000.0, resumed_copy_at=900.0)  # 100 s redone
    history.start("n0", 3, 1100.0, resumed_copy_at=1050.0)  # 50 s
    history.start("n0", 4, 1200.0)  # 150 s: it resumed from the same copy again
    history.session.query(Attempt).filter_by(number=4).update({"resumed_epoch": 2, "resumed_batch_key": BATCH_KEY_END})
    history.steady_progress(3000.0)
    for seconds in (2.0, 2.0, 4.0):
        history.timing("n0", "blocked", seconds)
    for _ in range(3):
        history.timing("n0", "restore", 1.0)
    advice = history.advice()
    assert advice.lost_seconds == 300 and advice.failures == 3 and advice.blocked_seconds == 8 + 3
    assert advice.mtbf_seconds == 1000 and advice.save_cost_seconds == 2
    assert advice.interval_seconds == pytest.approx(math.sqrt(2 * 2 * 1000))
    assert advice.interval_steps == 63, "one step a second"
    assert advice.goodput == pytest.approx((3000 - 300 - 11) / 3000)
    assert "rough estimate" in advice.note


def test_several_nodes_count_the_node_that_lost_and_waited_most_and_a_restart_from_scratch_loses_it_all(history):
    history.start("a", 1, 0.0)
    history.start("a", 2, 400.0, resumed_copy_at=350.0)
    history.start("b", 1, 10.0)
    history.start("b", 2, 400.0)  # b found nothing to resume from: everything since its start redone
    history.steady_progress(1000.0)
    history.timing("a", "blocked", 5.0)
    history.timing("b", "blocked", 1.0)
    history.timing("b", "restore", 2.0)
    advice = history.advice()
    assert advice.lost_seconds == 390 and advice.failures == 1 and advice.blocked_seconds == 5


def test_a_restart_counts_from_the_first_commit_of_its_position_on_any_node(history):
    history.start("a", 1, 0.0)
    epoch = history.commit(300.0, node="b")  # b committed the position first; a's copy came later
    history.session.add(
        Checkpoint(
            job_id=history.job.id, node="a", epoch=epoch, batch_key=BATCH_KEY_END, attempt="1", attempt_number=1,
            location="x", bytes=1, checksums={}, metrics={}, created_at=350.0,
        )
    )  # fmt: skip
    history.start("a", 2, 400.0)
    history.session.query(Attempt).filter_by(number=2).update(
        {"resumed_epoch": epoch, "resumed_batch_key": BATCH_KEY_END}
    )
    history.steady_progress(1000.0)
    assert history.advice().lost_seconds == 100


def test_save_timings_stand_in_for_blocked_ones_from_clients_that_report_none(history):
    for number in range(1, 4):
        history.start("n0", number, 100.0 * number, resumed_copy_at=None if number == 1 else 100.0 * number - 10)
    history.steady_progress(1000.0)
    history.timing("n0", "save", 3.0)
    advice = history.advice()
    assert advice.save_cost_seconds == 3 and advice.blocked_seconds == 3 and advice.interval_seconds is not None


def test_goodput_over_time_drops_at_each_failure_and_recovers_as_the_job_trains(history):
    history.start("n0", 1, 0.0)
    history.start("n0", 2, 500.0, resumed_copy_at=400.0)  # 100 s redone at 500 s
    history.steady_progress(1000.0)
    history.timing("n0", "blocked", 10.0, at=100.0)
    history.timing("n0", "blocked", 99.0, at=1001.0)  # after the latest record: outside the plot
    history.session.flush()
    advice, series = job_goodput(history.session, history.job, points=10)
    assert [round(at) for at, _ in series] == list(range(100, 1001, 100))
    goodput = dict(series)
    assert goodput[100.0] == pytest.approx(0.9), "10 s of the first 100 blocked"
    assert goodput[500.0] == pytest.approx((500 - 100 - 10) / 500), "the failure's redone work counts from its restart"
    assert goodput[400.0] == pytest.approx((400 - 10) / 400), "nothing redone before the restart"
    assert goodput[1000.0] == pytest.approx((1000 - 100 - 10) / 1000)
    assert advice.blocked_seconds == 109, "the headline counts every timing"


def test_a_job_that_never_started_says_so(history):
    advice = history.advice()
    assert advice.goodput is None and advice.failures == 0 and "no process" in advice.note
    assert job_goodput(history.session, history.job)[1] == []


def test_what_the_advice_reads_does_not_grow_with_the_history(history):
    """ADV-1: one token's thousands of starts and timings cost a request no more rows read — the
    database sums them (rows fetched from the database per advice and plot, at two history sizes)."""

    def rows_read_after_adding(size: int) -> int:
        known = history.session.query(Attempt).count()
        history.session.execute(
            insert(Attempt),
            [
                dict(job_id=history.job.id, node=f"n{i % 4}", number=known + i + 1, started_at=float(known + i),
                     skipped=[])
                for i in range(size)
            ],
        )  # fmt: skip
        history.session.execute(
            insert(Stat),
            [dict(job_id=history.job.id, node=f"n{i % 4}", action="blocked", seconds=0.1, created_at=float(i))
             for i in range(size)],
        )  # fmt: skip
        history.session.flush()
        before = CountingCursor.rows
        job_advice(history.session, history.job)
        job_goodput(history.session, history.job)
        return CountingCursor.rows - before

    small = rows_read_after_adding(40)
    sampled = rows_read_after_adding(2 * COST_SAMPLE)  # the save cost's sample is full from here on
    larger = rows_read_after_adding(20 * COST_SAMPLE)
    nodes = 4  # at most a row per node and moment, for starts and for timings, whatever the history
    assert 0 < small < sampled and larger <= sampled + 2 * nodes * PLOT_POINTS, (small, sampled, larger)


def _fill(history, size: int, begin: float) -> None:
    """`size` starts (each resuming the copy committed a second before), timings and commits over 4
    nodes, one a second from `begin` on, written in bulk as the service would have."""
    nodes = 4
    numbered = history.session.scalar(select(func.max(Attempt.number))) or 0
    history.session.execute(
        insert(Checkpoint),
        [
            dict(job_id=history.job.id, node=f"n{i % nodes}", epoch=10**6 + int(begin) + i, batch_key=BATCH_KEY_END,
                 attempt="1", attempt_number=1, step=int(begin) + i, location="x", bytes=1, checksums={},
                 metrics={}, created_at=begin + i - 1)
            for i in range(size)
        ],
    )  # fmt: skip
    history.session.execute(
        insert(Attempt),
        [
            dict(job_id=history.job.id, node=f"n{i % nodes}", number=numbered + i // nodes + 1,
                 started_at=begin + i, skipped=[], resumed_epoch=10**6 + int(begin) + i, resumed_batch_key=BATCH_KEY_END)
            for i in range(size)
        ],
    )  # fmt: skip
    history.session.execute(
        insert(Stat),
        [dict(job_id=history.job.id, node=f"n{i % nodes}", action="blocked", seconds=0.1, created_at=begin + i)
         for i in range(size)],
    )  # fmt: skip
    history.session.flush()


def _instructions(history, window: int) -> int:
    """The SQLite virtual machine's instructions (in hundreds) one advice and one plot cost: the
    database's own work, rows it passes over included."""
    counted = [0]

    def count() -> int:
        counted[0] += 1
        return 0

    raw = history.session.connection().connection.dbapi_connection
    raw.set_progress_handler(count, 100)
    try:
        job_advice(history.session, history.job, window=window)
        job_goodput(history.session, history.job, window=window)
    finally:
        raw.set_progress_handler(None, 0)
    return counted[0]


def test_the_database_work_of_one_advice_stays_within_the_window_as_the_history_grows(history):
    """ADV-1: the database's own pass (not only the rows it hands back) reads the job's newest records,
    so 10× the history costs the same; the control — a window holding the whole history — grows with
    it, so the measure can tell."""
    window = 200
    _fill(history, 1000, 0.0)
    within, whole = _instructions(history, window), _instructions(history, 10**9)
    _fill(history, 9000, 1000.0)
    within_later, whole_later = _instructions(history, window), _instructions(history, 10**9)
    assert within_later <= 1.3 * within, (within, within_later)
    assert whole_later >= 5 * whole, (whole, whole_later)


def test_a_history_longer_than_the_window_is_advised_on_its_newest_records_and_says_since_when(history):
    history.start("n0", 1, 0.0)
    for number in range(2, 12):  # ten early failures, far outside the window
        history.start("n0", number, 10.0 * number, resumed_copy_at=10.0 * number - 5)
    _fill(history, 400, 1000.0)  # four nodes, each restarted about every 4 s, 1 s redone each time
    advice = job_advice(history.session, history.job, window=100)
    assert "since 1970-01-01T00:21:40+00:00" in advice.note and "older history is not read" in advice.note
    assert advice.wall_seconds == pytest.approx(1399 - 1300)
    assert advice.failures == 25 and advice.lost_seconds == pytest.approx(25.0)
    assert advice.blocked_seconds == pytest.approx(2.5)
    whole = job_advice(history.session, history.job, window=10**6)
    assert whole.failures == 110 and "since" not in (whole.note or ""), "the control reads it all"


def test_the_service_answers_advice_from_what_clients_reported(tmp_path, service):
    import uuid

    from ckptstore import Position
    from ckptstore.client import ServiceClient
    from ckptstore.client.engine.node import NodeCheckpointer
    from tests.builders import arrays_for

    job, url = f"advised-{uuid.uuid4().hex[:6]}", service.live.url
    storage = f"{service.storage}/{job}"
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
    with service.client() as http:
        scraped = http.get("/metrics").text
    gauges = dict(
        line.rsplit(" ", 1) for line in scraped.splitlines() if line.startswith("ckptstore_job_") and job in line
    )
    assert float(gauges[f'ckptstore_job_goodput_ratio{{job="{job}"}}']) == pytest.approx(advice.goodput, abs=0.01)
    assert float(gauges[f'ckptstore_job_failures{{job="{job}"}}']) == 2
    interval = float(gauges[f'ckptstore_job_recommended_interval_seconds{{job="{job}"}}'])
    assert interval == pytest.approx(advice.interval_seconds, rel=0.05)
