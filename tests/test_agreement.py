"""The resume agreement asked with a wait: answered once the last node reports, or at the deadline;
the waiters of a job share the service's computations (`ckptstore.server.records.agreement`)."""

from __future__ import annotations

import asyncio
import threading
import time

from ckptstore import Position, Store
from ckptstore.client import ServiceClient
from ckptstore.server.records.agreement import AgreementWaiters
from ckptstore.wire.schema import ResumeAgreement


def committed_job(client: ServiceClient, root: str, job: str, nodes: list[str]) -> dict[str, str]:
    """`job` with epoch 0 good on every node, then every node restarted: their new attempts."""
    client.put_job(job, nodes, storage_root=root)
    for node in nodes:
        attempt = client.start_attempt(job, node)
        client.commit(Store(root).save(job, node, 0, {"w": [1.0]}, attempt=attempt))
    return {node: client.start_attempt(job, node) for node in nodes}


def test_a_waiting_request_is_answered_as_soon_as_the_last_node_reports(sqlite_service, job_name):
    with ServiceClient(sqlite_service.live.url) as client:
        attempts = committed_job(client, sqlite_service.storage, job_name, ["n0", "n1"])
        client.report_resume(job_name, "n0", attempts["n0"], resumed_from=Position(0), skipped=[])
        answers: list[tuple[ResumeAgreement, float]] = []

        def wait() -> None:
            with ServiceClient(sqlite_service.live.url) as waiter:
                asked = time.monotonic()
                answers.append((waiter.resume_agreement(job_name, wait_s=30), time.monotonic() - asked))

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(1.0)
        assert not answers, "held while n1 has not reported"
        reported = time.monotonic()
        client.report_resume(job_name, "n1", attempts["n1"], resumed_from=Position(0), skipped=[])
        thread.join(timeout=35)
        agreement, _ = answers[0]
        assert agreement.agreed and agreement.waiting_count == 0, agreement
        assert time.monotonic() - reported < 5, "answered within a round of the report, not at the deadline"


def test_a_wait_that_sees_no_agreement_ends_at_its_deadline_naming_the_first_100_waited_for(sqlite_service, job_name):
    nodes = [f"n{i:03d}" for i in range(150)]
    with ServiceClient(sqlite_service.live.url) as client:
        committed_job(client, sqlite_service.storage, job_name, nodes)
        asked = time.monotonic()
        agreement = client.resume_agreement(job_name, wait_s=1.5)
        waited = time.monotonic() - asked
    assert not agreement.agreed and agreement.resume is not None
    assert agreement.waiting_count == 150 and agreement.waiting == nodes[:100], agreement.waiting_count
    assert 1.4 <= waited < 10, waited


def test_the_waiters_of_a_job_share_one_computation_per_round():
    computed: list[str] = []
    agreed_after = time.monotonic() + 1.0

    def compute(job: str) -> ResumeAgreement:
        computed.append(job)
        agreed = time.monotonic() > agreed_after
        return ResumeAgreement(job=job, resume=None, agreed=agreed, waiting=[], waiting_count=0 if agreed else 1)

    async def storm() -> list[ResumeAgreement]:
        waiters = AgreementWaiters(compute, interval_s=0.1)
        return await asyncio.gather(*(waiters.wait("j", 10) for _ in range(200)))

    answers = asyncio.run(storm())
    assert all(answer.agreed for answer in answers), "every waiter got the agreement"
    assert len(computed) <= 15, f"{len(computed)} computations for 200 waiters over 1 s: one per round of 0.1 s"
