"""A short mixed load (the CI variant of bench/soak.py): 0 errors, and the service's memory is
sampled. The 60-second run with figures is in bench/RESULTS.md."""

from __future__ import annotations

import asyncio
import signal

from bench.service import populate, start_service
from bench.soak import soak
from server.migrate import migrate
from tests.servers import free_port


def test_mixed_load_for_a_few_seconds_answers_every_request(tmp_path):
    url, root = f"sqlite:///{tmp_path}/soak.db", str(tmp_path / "storage")
    migrate(url)
    populate(url, 50, 8, 20, root)
    port = free_port()
    process = start_service(url, port, 1, root)
    try:
        result = asyncio.run(soak(port, process.pid, rate=150, duration=12, jobs=50, root=root))
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    assert result["errors"] == {}, result["errors"]
    assert result["requests"] == 150 * 12
    assert min(result[k]["requests"] for k in ("last_good", "commit", "health")) > 0
    assert result["rss_mib"]["end"] > 0
