"""Waiting for a job's resume agreement without polling the database once per node.

Every node of a restarting job waits until all of them verified the resume position. Polled by each
node, that is thousands of requests a second for a large job, each an aggregate over the job's
attempts (bench/storm.py). A node may instead ask once and wait (`?wait_s=`): the waiters of a job
in this process share its computations (rounds, in the thread pool, at most one every `interval_s`),
and each is answered by the first round that says agreed, or with the newest answer at its deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from starlette.concurrency import run_in_threadpool

from ckptstore.wire.schema import ResumeAgreement

__all__ = ["AgreementWaiters", "WAIT_LIMIT_S"]

WAIT_LIMIT_S = 60.0  # the longest a request may wait: under any proxy's read timeout


class AgreementWaiters:
    """The waiters of each job's resume agreement in this process, and their shared computations."""

    def __init__(self, compute: Callable[[str], ResumeAgreement], *, interval_s: float = 0.25):
        self._compute = compute
        self._interval_s = interval_s
        self._rounds: dict[str, asyncio.Future[ResumeAgreement]] = {}
        self._started: dict[str, float] = {}  # when each job's newest round started
        self._tasks: set[asyncio.Task[None]] = set()  # the loop keeps only weak references to tasks

    async def wait(self, job: str, wait_s: float) -> ResumeAgreement:
        """The job's agreement once agreed or once the resume position moved, or as it stands after
        `wait_s` seconds (0: computed for this request alone, at once)."""
        if wait_s <= 0:
            return await run_in_threadpool(self._compute, job)
        deadline = time.monotonic() + min(wait_s, WAIT_LIMIT_S)
        answer = first = await asyncio.shield(self._round(job))
        while not answer.agreed and answer.resume == first.resume:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                answer = await asyncio.wait_for(asyncio.shield(self._round(job)), left)
            except TimeoutError:
                break
        return answer

    def _round(self, job: str) -> asyncio.Future[ResumeAgreement]:
        """The job's pending computation, or a new one, started `interval_s` after the previous one
        started (at once if that is past)."""
        pending = self._rounds.get(job)
        if pending is None:
            loop = asyncio.get_running_loop()
            pending = self._rounds[job] = loop.create_future()
            delay = self._started.get(job, 0.0) + self._interval_s - time.monotonic()
            task = loop.create_task(self._run_round(job, pending, max(0.0, delay)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return pending

    async def _run_round(self, job: str, pending: asyncio.Future[ResumeAgreement], delay: float) -> None:
        await asyncio.sleep(delay)
        started = self._started[job] = time.monotonic()
        asyncio.get_running_loop().call_later(self._interval_s, self._forget, job, started)
        try:
            answer = await run_in_threadpool(self._compute, job)
        except Exception as exc:  # a deleted job, a database away: every waiter gets the error
            pending.set_exception(exc)
            pending.exception()  # retrieved here: a round no waiter is left for logs nothing
        else:
            pending.set_result(answer)
        finally:
            del self._rounds[job]

    def _forget(self, job: str, started: float) -> None:
        """A round's start matters for one interval only (the dictionary keeps the jobs being waited on)."""
        if self._started.get(job) == started:
            del self._started[job]
