"""A short mixed load (the CI variant of bench/soak.py): 0 errors, and the service's memory is
sampled. The 60-second run with figures is in bench/RESULTS.md."""

from __future__ import annotations

import asyncio

from bench.service import populate, running_service
from bench.soak import soak
from ckptstore.server.db.migrate import migrate


def test_mixed_load_for_a_few_seconds_answers_every_request(tmp_path):
    url, root = f"sqlite:///{tmp_path}/soak.db", str(tmp_path / "storage")
    migrate(url)
    populate(url, 50, 8, 20, root)
    with running_service(url, 1, root) as (port, process):
        result = asyncio.run(soak(port, process.pid, rate=150, duration=12, jobs=50, root=root))
    assert result["errors"] == {}, result["errors"]
    assert result["requests"] == 150 * 12
    assert min(result[k]["requests"] for k in ("last_good", "commit", "health")) > 0
    assert result["rss_mib"]["end"] > 0
