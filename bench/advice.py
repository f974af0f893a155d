"""What the operations advice costs as a job's history grows (issue 48, ADV-1).

    python bench/advice.py [--sizes 2000 20000 200000]

For each size N, a SQLite database with one job of 4 nodes holding N starts (each resuming from a
copy), N save timings and N commits, filled directly; then the best of 3 of `job_advice` (GET
/advice, and each /metrics scrape per active job) and `job_goodput` (the dashboard's job page: the
advice and its plot), in this process. Run it in another tree (`git archive REF`) for a baseline.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sqlalchemy import create_engine, insert  # noqa: E402
from sqlalchemy.orm import Session  # noqa: E402

from ckptstore.server.db.migrate import migrate  # noqa: E402
from ckptstore.server.db.models import Attempt, Checkpoint, Job, Stat  # noqa: E402
from ckptstore.server.records.advice import job_advice, job_goodput  # noqa: E402

END = 10**10  # an epoch end's batch key


def measure(folder: str, size: int) -> dict[str, float]:
    url = f"sqlite:///{folder}/advice-{size}.sqlite"
    migrate(url)
    with Session(create_engine(url)) as session:
        job = Job(name="j", storage_root="/s", retention={}, created_at=0.0, updated_at=0.0)
        session.add(job)
        session.flush()
        resumed = [dict(resumed_epoch=i // 4, resumed_batch_key=END) if i >= 4 else {} for i in range(size)]
        session.execute(
            insert(Attempt),
            [
                dict(job_id=job.id, node=f"n{i % 4}", number=i // 4 + 1, skipped=[], started_at=float(i), **resumed[i])
                for i in range(size)
            ],
        )
        session.execute(
            insert(Stat),
            [
                dict(job_id=job.id, node=f"n{i % 4}", action="blocked", seconds=0.1, created_at=float(i))
                for i in range(size)
            ],
        )
        session.execute(
            insert(Checkpoint),
            [
                dict(job_id=job.id, node=f"n{i % 4}", epoch=i // 4, batch_key=END, attempt="1", attempt_number=1,
                     step=i, location="x", bytes=1, checksums={}, metrics={}, created_at=float(i))
                for i in range(size)
            ],
        )  # fmt: skip
        session.commit()
        best = {}
        for name, call in (("advice", job_advice), ("job page", job_goodput)):
            times = []
            for _ in range(3):
                started = time.perf_counter()
                call(session, job)
                times.append(time.perf_counter() - started)
            best[name] = min(times)
        return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 20000, 200000])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        print("| starts, timings, commits | advice | job page (advice + plot) |")
        print("| ---: | ---: | ---: |")
        for size in args.sizes:
            best = measure(folder, size)
            print(f"| {size:,} | {best['advice'] * 1000:.1f} ms | {best['job page'] * 1000:.1f} ms |")


if __name__ == "__main__":
    main()
