"""One node's checkpoints of one job: attempt, resume position, save, commit, health, retention.

Shared by the Keras callback and the custom-loop manager. Failure behaviour (DESIGN.md):
storage failing → the save is skipped with a warning, a health report and a counter, training
goes on (unless on_error="raise"); service down → checkpoints still go to storage, commits are
re-posted when it answers again, and the resume position comes from the manifests on storage;
fenced (a newer attempt of this node exists) → FencedError, whatever on_error says.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np

from ckptstore import CheckpointRef, Position, Store
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    FencedError,
    ServiceError,
    ServiceUnavailableError,
    StorageUnavailableError,
)
from ckptstore.retention import Candidate, good_positions
from client.identity import NodeIdentity, resolve_identity
from client.service import ServiceClient
from client.writer import BackgroundWriter

__all__ = ["NodeCheckpointer"]

log = logging.getLogger("ckptstore.client")
OnError = Literal["warn", "raise"]


class NodeCheckpointer:
    """Saves and restores this node's part of a job's checkpoints (see module docstring)."""

    def __init__(
        self,
        *,
        job: str,
        storage: str,
        service: str | None = None,
        node: str | None = None,
        storage_options: dict[str, Any] | None = None,
        token: str | None = None,
        on_error: OnError = "warn",
        async_save: bool = True,
        gc: bool = True,
        keep_last: int | None = None,
        identity: NodeIdentity | None = None,
    ):
        if on_error not in ("warn", "raise"):
            raise ValueError("on_error must be 'warn' or 'raise'")
        self.identity = identity or resolve_identity(node)
        self.node = self.identity.checkpoint_node
        self.writes = self.identity.is_chief
        self.job = job
        self.store = Store(storage, storage_options=storage_options)
        self.client = ServiceClient(service, token=token) if service else None
        self.on_error = on_error
        self.gc = gc
        self.keep_last = keep_last
        self.attempt: str | None = None
        self.fenced = False
        self.skipped_saves = 0
        self.saved: list[Position] = []
        self._pending: deque[tuple[CheckpointRef, dict[str, float]]] = deque()
        self._writer = BackgroundWriter() if async_save else None

    # -- start and restore ---------------------------------------------------------------------

    def start(self) -> Position | None:
        """Declare the job if needed, register this attempt, and return the position to resume from."""
        resume = self.resume_position()
        if not self.writes:
            return resume
        if self.client is not None:
            try:
                self._declare_job()
                self.attempt = str(self.client.start_attempt(self.job, self.node, resumed_from=resume))
            except ServiceUnavailableError as exc:
                log.warning("service unreachable (%s): continuing with an offline attempt", exc)
        if self.attempt is None:
            self.attempt = self.store.next_attempt(self.job, self.node)
        return resume

    def _declare_job(self) -> None:
        try:
            self.client.get_job(self.job)
        except CheckpointNotFoundError:
            retention = {"keep_last": self.keep_last} if self.keep_last else None
            self.client.put_job(self.job, [self.node], storage_root=self.store.url, retention=retention)

    def resume_position(self) -> Position | None:
        """The highest good position: from the service, or from storage manifests when it is down."""
        if self.client is not None:
            try:
                answer = self.client.last_good_epoch(self.job)
                return None if answer.resume is None else answer.resume.to_position()
            except CheckpointNotFoundError:
                return None
            except ServiceUnavailableError as exc:
                log.warning("service unreachable (%s): finding the resume position on storage", exc)
        infos = self.store.list_checkpoints(self.job, self.node)
        candidates = [Candidate(self.node, i.position, i.attempt, i.committed) for i in infos]
        good = good_positions(candidates, [self.node])
        return max(good) if good else None

    def load(self, position: Position) -> dict[str, np.ndarray]:
        started = time.perf_counter()
        arrays = self.store.load(self.job, self.node, position.epoch, batch=position.batch)
        self._report_stats("restore", time.perf_counter() - started, sum(a.nbytes for a in arrays.values()))
        return arrays

    # -- save ----------------------------------------------------------------------------------

    def save(
        self,
        position: Position,
        arrays: Mapping[str, np.ndarray],
        *,
        step: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> None:
        """Save `arrays` at `position` (in the background when async); the arrays must stay unchanged until then.

        A process that is not the chief saves nothing (under MultiWorkerMirroredStrategy the chief writes).
        """
        self.raise_if_fenced()
        if not self.writes:
            return
        job = lambda: self._write(position, arrays, step, dict(metadata or {}), dict(metrics or {}))  # noqa: E731
        if self._writer is None:
            self._guarded(job)
        else:
            self._writer.submit(lambda: self._guarded(job))

    @property
    def async_save(self) -> bool:
        return self._writer is not None

    def wait(self) -> None:
        """Block until the save in flight is committed (or skipped); raise a background error if on_error='raise'."""
        if self._writer is not None:
            self._writer.wait()
        self.raise_if_fenced()

    def raise_if_fenced(self) -> None:
        if self.fenced:
            raise FencedError(f"{self.job}/{self.node} attempt {self.attempt} is fenced: a newer attempt has started")

    def _guarded(self, job: Callable[[], None]) -> None:
        try:
            job()
        except FencedError:
            self.fenced = True
            raise
        except (CkptStoreError, OSError) as exc:
            if self.on_error == "raise":
                raise
            self.skipped_saves += 1
            log.warning("checkpoint save skipped (%s); training continues", exc)
            self._report_health()

    def _write(
        self,
        position: Position,
        arrays: Mapping[str, np.ndarray],
        step: int | None,
        metadata: dict[str, Any],
        metrics: dict[str, float],
    ) -> None:
        started = time.perf_counter()
        try:
            ref = self.store.save(
                self.job,
                self.node,
                position.epoch,
                arrays,
                attempt=self.attempt,
                batch=position.batch,
                step=step,
                metadata=metadata | {"metrics": metrics},
            )
        except (CkptStoreError, OSError):
            raise
        except Exception as exc:  # backend errors (botocore, aiohttp…) mean: storage not usable now
            raise StorageUnavailableError(f"storage write failed: {type(exc).__name__}: {exc}") from exc
        self.saved.append(position)
        self._report_stats("save", time.perf_counter() - started, ref.bytes)
        if self.client is not None:
            self._pending.append((ref, metrics))
            self._flush_commits()
            if self.gc:
                self._collect_garbage()

    def _flush_commits(self) -> None:
        """Post every commit not yet acknowledged (oldest first); keep them if the service is down."""
        while self._pending:
            ref, metrics = self._pending[0]
            try:
                self.client.commit(ref, metrics=metrics)
            except ServiceUnavailableError as exc:
                log.warning("service unreachable (%s): %d commit(s) will be re-posted", exc, len(self._pending))
                return
            except FencedError:
                self.fenced = True
                raise
            self._pending.popleft()

    @property
    def pending_commits(self) -> int:
        return len(self._pending)

    def _collect_garbage(self) -> None:
        """Execute this node's part of the service's retention plan (manifest first, then the record)."""
        try:
            plan = self.client.gc_plan(self.job)
        except ServiceError as exc:
            log.info("no retention plan now: %s", exc)
            return
        for deletion in plan.deletions:
            if deletion.node != self.node:
                continue
            position = Position(deletion.epoch, deletion.batch)
            try:
                self.store.delete(self.job, self.node, deletion.epoch, batch=deletion.batch, attempt=deletion.attempt)
            except CheckpointNotFoundError:
                pass
            try:
                self.client.mark(
                    self.job,
                    self.node,
                    position,
                    "deleted",
                    attempt=deletion.attempt,
                    reason=f"retention: {deletion.reason}",
                )
            except ServiceError as exc:
                log.info("could not mark %s deleted: %s", position, exc)

    # -- reports -------------------------------------------------------------------------------

    def _report_stats(self, action: str, seconds: float, nbytes: int) -> None:
        if self.client is None:
            return
        try:
            self.client.report_stats(self.job, self.node, action, seconds, nbytes=nbytes)
        except ServiceError as exc:
            log.debug("stats not reported: %s", exc)

    def _report_health(self) -> None:
        report = self.store.accessible(timeout=5)
        if self.client is None:
            return
        try:
            self.client.report_health(self.job, self.node, report)
        except ServiceError as exc:
            log.debug("health not reported: %s", exc)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self.client is not None:
                try:
                    self._flush_commits()
                except ServiceError:
                    pass
                self.client.close()
