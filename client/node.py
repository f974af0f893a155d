"""One node's checkpoints of one job: attempt, restore, save on its tiers, replication, reports to
the service, retention.

Shared by the Keras callback and the custom-loop manager. Failure behaviour (README, "Failure
behaviour"): storage failing → the save is skipped with a warning, a health report and a counter,
training goes on (unless on_error="raise"); the local tier failing → the save goes straight to the
durable tier; the durable tier away → local saves go on and replication retries with backoff;
service away → checkpoints still go to storage, every report to the service waits in a background
queue (training never waits for it) and is re-posted when it answers, and restore finds the newest
intact copy on storage; fenced (a newer attempt of this node exists) → FencedError, whatever
on_error says.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ckptstore import CheckpointRef, Position, Store, tracing
from ckptstore.copies import Restored
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    FencedError,
    ServiceUnavailableError,
    StorageUnavailableError,
)
from ckptstore.names import Tier, new_offline_attempt
from ckptstore.schema import MarkState
from client.identity import NodeIdentity, resolve_identity
from client.options import CheckpointOptions
from client.replication import LocalCopy, Replicator
from client.reports import Reports
from client.restore import Restorer
from client.retention import delete_checkpoint
from client.service import ServiceClient
from client.writer import BackgroundWriter

__all__ = ["NodeCheckpointer"]

log = logging.getLogger("ckptstore.client")


def _finite(metrics: Mapping[str, float]) -> dict[str, float]:
    """The metrics that can be recorded: JSON has no NaN or infinity, so those are left out, said once."""
    kept = {}
    for name, value in metrics.items():
        if math.isfinite(value):
            kept[name] = float(value)
        else:
            log.warning("metric %r is %s: not recorded (JSON has no such number); the checkpoint is saved", name, value)
    return kept


class NodeCheckpointer:
    """Saves and restores this node's part of a job's checkpoints (see module docstring)."""

    def __init__(
        self, options: CheckpointOptions | None = None, /, *, identity: NodeIdentity | None = None, **settings: Any
    ):
        """`options` (resolved), or the same options as keyword arguments (`CheckpointOptions`)."""
        self.options = options if options is not None else CheckpointOptions.resolve(**settings)
        self.identity = identity or resolve_identity(self.options.node)
        self.node = self.identity.checkpoint_node
        self.writes = self.identity.is_chief
        self.job = self.options.job
        self.store = Store(self.options.storage, storage_options=self.options.storage_options)
        self.local_store = self._local_tier()
        self.client = ServiceClient(self.options.service, token=self.options.token) if self.options.service else None
        self.attempt: str | None = None
        self.restored: Restored | None = None
        self.fenced = False
        self.skipped_saves = 0
        self.saved: list[Position] = []
        self._writer = BackgroundWriter() if self.options.async_save else None
        self.reports = Reports(self.client, self.job, self.node, on_fenced=self._fence, retention=self._apply_retention)
        self._replicator = (
            None
            if self.local_store is None
            else Replicator(
                self.local_store,
                self.store,
                self.job,
                self.node,
                on_replicated=self._replicated,
                on_lost=self._lost_locally,
            )
        )

    def _local_tier(self) -> Store | None:
        if self.options.local_storage is None or not self.writes:
            return None
        if self.identity.shared_restore:
            log.warning(
                "local_storage is not used under a multi-worker TF_CONFIG: every worker restores the chief's "
                "checkpoints, so they go straight to the durable tier"
            )
            return None
        return Store(self.options.local_storage)

    @property
    def tiers(self) -> dict[Tier, Store]:
        """The tiers this process reads, nearest first."""
        return {"local": self.local_store, "durable": self.store} if self.local_store else {"durable": self.store}

    # -- start and restore ---------------------------------------------------------------------

    def start(self) -> Position | None:
        """Declare the job if needed, register this attempt, restore the newest intact copy (kept in
        `restored`, every byte verified) and return its position (None on a fresh job)."""
        if self.writes and self.client is not None:
            try:
                self._declare_job(self.client)
                self.attempt = self.client.start_attempt(self.job, self.node)
            except ServiceUnavailableError as exc:
                log.warning("service unreachable (%s): continuing with an offline attempt", exc)
        if self.writes and self.attempt is None:
            self.attempt = new_offline_attempt(self._highest_attempt_on_storage())
        started = time.perf_counter()
        restorer = Restorer(
            job=self.job,
            node=self.node,
            tiers=self.tiers,
            client=self.client,
            attempt=self.attempt if self.writes else None,
            timeout_s=self.options.restore_timeout_s,
        )
        with tracing.span("ckptstore.restore.read", job=self.job, node=self.node) as span:
            self.restored = restorer.restore()
            if self.restored is not None:
                copy = self.restored.copy
                nbytes = self.restored.checkpoint.manifest.total_bytes
                tracing.set_attributes(span, position=str(copy.position), tier=copy.tier, bytes=nbytes)
        if self.restored is not None:
            nbytes = self.restored.checkpoint.manifest.total_bytes
            self.reports.stats("restore", time.perf_counter() - started, nbytes)
            copy, skipped = self.restored.copy, "; ".join(str(s) for s in self.restored.skipped)
            # One line a user sees by default (not a log record at a level they may have hidden).
            print(
                f"ckptstore: {self.job}/{self.node} resumed from {copy.position} ({copy.tier} copy, attempt "
                f"{copy.attempt}){'; skipped ' + skipped if skipped else ''}",
                file=sys.stderr,
                flush=True,
            )
        if self._replicator is not None:
            self._replicator.resume()
        return None if self.restored is None else self.restored.copy.position

    def _highest_attempt_on_storage(self) -> int:
        """The highest attempt number on the tiers that answer (an offline id's random suffix keeps it unique)."""
        highest = []
        for tier, store in self.tiers.items():
            try:
                highest.append(store.highest_attempt(self.job, self.node))
            except StorageUnavailableError as exc:
                log.warning("the %s tier is away (%s): numbering this offline attempt without it", tier, exc)
        return max(highest, default=0)

    def _declare_job(self, client: ServiceClient) -> None:
        """Declare the job on its first start (its expected nodes, retention, tiers); bring a job
        declared by hand in line with this process's options: its max_to_keep, its local tier, its
        node among the expected ones."""
        local_root = None if self.local_store is None else self.local_store.url
        expected = self.options.expected_nodes(self.node)
        keep_last = self.options.max_to_keep
        try:
            info = client.get_job(self.job)
        except CheckpointNotFoundError:
            retention = {"keep_last": keep_last} if keep_last else None
            client.put_job(self.job, expected, storage_root=self.store.url, local_root=local_root, retention=retention)
            return
        retention = info.retention.model_dump()
        nodes = info.nodes + [n for n in expected if n not in info.nodes and self.node in expected]
        wanted = (nodes, local_root or info.local_root, keep_last or retention["keep_last"])
        if wanted != (info.nodes, info.local_root, retention["keep_last"]):
            client.put_job(
                self.job,
                nodes,
                storage_root=info.storage_root,
                local_root=wanted[1],
                retention=retention | {"keep_last": wanted[2]},
            )

    def resume_position(self) -> Position | None:
        """The position a restore starts from: the service's resume position, or (service away) the
        newest committed position on any tier. Unverified: `start` verifies."""
        if self.client is not None:
            try:
                resume = self.client.last_good_epoch(self.job).resume
                return None if resume is None else resume.to_position()
            except CheckpointNotFoundError:
                return None
            except ServiceUnavailableError as exc:
                log.warning("service unreachable (%s): finding the resume position on storage", exc)
        positions = [p for store in self.tiers.values() for p in store.list_positions(self.job, self.node)]
        return max(positions, default=None)

    def load(self, position: Position) -> dict[str, np.ndarray]:
        """This node's checkpoint at `position` from the durable tier, verified."""
        return self.store.load(self.job, self.node, position.epoch, batch=position.batch)

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
        finite = _finite(metrics or {})
        caller = tracing.capture()  # the write's span continues the caller's trace on the writer thread

        def write() -> None:
            with tracing.attached(caller):
                self._write(position, arrays, step, dict(metadata or {}), finite)

        if self._writer is None:
            self._guarded(write)
            self.wait()
        else:
            self._writer.submit(lambda: self._guarded(write))

    @property
    def async_save(self) -> bool:
        return self._writer is not None

    def wait_for_write(self) -> None:
        """Block until the save in flight is committed on its first tier (or skipped)."""
        if self._writer is not None:
            self._writer.wait()
        self.raise_if_fenced()

    def wait(self) -> None:
        """Block until the save in flight is written and replicated and the service has its records —
        or until the durable tier or the service is found away (they keep retrying in the background)."""
        self.wait_for_write()
        if self._replicator is not None and not self._replicator.wait():
            log.warning("the durable tier is away: %d local copies wait for replication", self._replicator.pending)
        if not self.reports.drain():
            log.warning("service unreachable: %d commit(s) will be re-posted", self.pending_commits)
        self.raise_if_fenced()

    def raise_if_fenced(self) -> None:
        if self.fenced:
            raise FencedError(f"{self.job}/{self.node} attempt {self.attempt} is fenced: a newer attempt has started")

    def _guarded(self, write: Callable[[], None]) -> None:
        try:
            write()
        except FencedError:
            self.fenced = True
            raise
        except CkptStoreError as exc:
            if self.options.on_error == "raise":
                raise
            self.skipped_saves += 1
            log.warning("checkpoint save skipped (%s); training continues", exc)
            self.reports.health(self.store.accessible(timeout=5))

    def _write(
        self,
        position: Position,
        arrays: Mapping[str, np.ndarray],
        step: int | None,
        metadata: dict[str, Any],
        metrics: dict[str, float],
    ) -> None:
        started = time.perf_counter()
        tier, store = self._first_tier()
        with tracing.span("ckptstore.write", job=self.job, node=self.node, position=str(position)) as span:
            try:
                ref = self._save_to(store, position, arrays, step, metadata | {"metrics": metrics})
            except StorageUnavailableError as exc:
                if tier != "local":
                    raise
                log.warning("the local tier failed (%s): saving %s straight to the durable tier", exc, position)
                tier, store = "durable", self.store
                ref = self._save_to(store, position, arrays, step, metadata | {"metrics": metrics})
            tracing.set_attributes(span, bytes=ref.bytes, tier=tier)
        self.saved.append(position)
        self.reports.saved()
        self.reports.stats("save", time.perf_counter() - started, ref.bytes)
        self.reports.commit(ref, tier, metrics)
        if tier == "local" and self._replicator is not None:
            self._replicator.submit(position, ref.attempt)

    def _first_tier(self) -> tuple[Tier, Store]:
        return ("local", self.local_store) if self.local_store is not None else ("durable", self.store)

    def _save_to(
        self,
        store: Store,
        position: Position,
        arrays: Mapping[str, np.ndarray],
        step: int | None,
        metadata: dict[str, Any],
    ) -> CheckpointRef:
        return store.save(
            self.job,
            self.node,
            position.epoch,
            arrays,
            attempt=self.attempt,
            batch=position.batch,
            step=step,
            metadata=metadata,
        )

    # -- replication ---------------------------------------------------------------------------

    def _replicated(self, ref: CheckpointRef) -> None:
        metrics = ref.manifest.metadata.get("metrics", {})
        self.reports.commit(ref, "durable", metrics if isinstance(metrics, dict) else {})
        self._prune_local_tier()

    def _lost_locally(self, copy: LocalCopy, error: Exception) -> None:
        missing = isinstance(error, CheckpointNotFoundError) or getattr(error, "missing", False)
        state: MarkState = "missing" if missing else "corrupt"
        self.reports.mark(
            copy.position, state, attempt=copy.attempt, tier="local", reason=f"replication: {error}"[:1000]
        )

    def _prune_local_tier(self) -> None:
        """Keep `local_max_to_keep` positions on the local tier; older copies go once they are durable."""
        assert self.local_store is not None
        local = [i for i in self.local_store.list_checkpoints(self.job, self.node) if i.committed]
        keep = set(sorted({i.position for i in local})[-self.options.local_max_to_keep :])
        durable = {(i.position, i.attempt) for i in self.store.list_checkpoints(self.job, self.node) if i.committed}
        for info in local:
            if info.position not in keep and (info.position, info.attempt) in durable:
                self.delete(info.position, attempt=info.attempt, reason="local tier retention", tier="local")

    def _fence(self) -> None:
        self.fenced = True

    @property
    def pending_commits(self) -> int:
        return self.reports.pending_commits

    # -- retention -----------------------------------------------------------------------------

    def _apply_retention(self) -> None:
        """Execute this node's part of the service's retention plan, on each tier it has."""
        assert self.client is not None
        for deletion in self.client.retention_plan(self.job).deletions:
            if deletion.node == self.node and (deletion.tier == "durable" or self.local_store is not None):
                position = Position(deletion.epoch, deletion.batch)
                self.delete(
                    position, attempt=deletion.attempt, reason=f"retention: {deletion.reason}", tier=deletion.tier
                )

    def delete(self, position: Position, *, attempt: str | None = None, reason: str, tier: Tier = "durable") -> None:
        """Delete this node's copy at `position` on `tier` (one attempt, or all), then mark it deleted —
        in the background, like every report: a fit ending while the service is down does not wait."""
        store = self.local_store if tier == "local" else self.store
        assert store is not None
        delete_checkpoint(store, None, self.job, self.node, position, attempt=attempt, reason=reason, tier=tier)
        self.reports.mark(position, "deleted", attempt=attempt, tier=tier, reason=reason)

    def delete_all(self, *, reason: str) -> None:
        """Delete every checkpoint of this node on every tier (Keras semantics when a fit finishes)."""
        for tier, store in self.tiers.items():
            for position in store.list_positions(self.job, self.node):
                self.delete(position, reason=reason, tier=tier)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._replicator is not None:
                self._replicator.close()
            self.reports.close()
            if self.client is not None:
                self.client.close()
