"""One node's checkpoints of one job: attempt, restore (or a fork's start), save on its tiers,
replication, reports to the service and retention; shared by the Keras callback, the loop managers and
the DCP writer and reader.

Failure behaviour (README, "Training with ckptstore", its failure table):
- storage failing → the save is skipped with a warning, a health report and a counter; training goes on
  (unless on_error="raise");
- the local tier failing → the save goes straight to the durable tier;
- the durable tier away → local saves go on and replication retries with backoff;
- the service away → checkpoints still go to storage, every report to the service waits in a background
  queue (training never waits for it) and is re-posted when it answers, and restore finds the newest
  intact copy on storage;
- fenced (a newer attempt of this node exists) → FencedError, whatever on_error says.

Who calls whom: the node drives the writer, the replicator, the retention thread and the reports queue;
the retention thread and the node both send through the reports queue, and the replicator hands each
durable copy back here (`_replicated`), so nothing below calls the node's methods except through the
callbacks it was given.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import numpy as np

from ckptstore import AccessReport, CheckpointRef, CopyKey, Position, Store, tracing
from ckptstore.agreement import disagreement_of
from ckptstore.client.audit.declared import said
from ckptstore.client.engine.background import RetryingQueue
from ckptstore.client.engine.exit_codes import install_exit_codes
from ckptstore.client.engine.fork import restore_fork
from ckptstore.client.engine.fresh_start import (
    check_resume,
    copies_unseen,
    fresh_anyway,
    start_without_durable,
)
from ckptstore.client.engine.identity import NodeIdentity, resolve_identity
from ckptstore.client.engine.options import CheckpointOptions
from ckptstore.client.engine.replication import Replicator
from ckptstore.client.engine.reports import Reports
from ckptstore.client.engine.requests import CheckpointRequests
from ckptstore.client.engine.restore import NothingToRestoreError, Restorer
from ckptstore.client.engine.retention import Retention, delete_copy, local_tier_surplus
from ckptstore.client.engine.startup import (
    check_job,
    declare_first,
    highest_attempt_on_storage,
    probe_tiers,
    register_start,
    wait_for_tier,
)
from ckptstore.client.engine.tiers import durable_tier, local_tier
from ckptstore.client.engine.writer import SYNC_RETRY_S, BackgroundWriter, SaveCounts, write_retrying
from ckptstore.client.peers.replicas import PeerReplicas
from ckptstore.client.peers.tier import WithPeerTier
from ckptstore.client.service.rest import ServiceClient
from ckptstore.client.service.wire import Commit, recordable
from ckptstore.copies import Restored
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    ConfigurationError,
    CorruptCheckpointError,
    FencedError,
    ServiceUnavailableError,
    StorageUnavailableError,
)
from ckptstore.names import Tier, new_offline_attempt
from ckptstore.wire.schema import JobInfo, LastGood, MarkCause, MarkState, ResumeAudit

__all__ = ["NodeCheckpointer"]

log = logging.getLogger("ckptstore.client")
RETRYING_GRACE_S = 10.0  # how long the end of a run waits for a save still retrying
DRAWN_NEXT_WAIT_S = 10.0  # how long `wait` waits for late records (best effort: unwritten, a resume is unverified)


class NodeCheckpointer:
    """Saves and restores this node's part of a job's checkpoints (see module docstring)."""

    def __init__(
        self, options: CheckpointOptions | None = None, /, *, identity: NodeIdentity | None = None, **settings: Any
    ):
        """`options` (resolved), or the same options as keyword arguments (`CheckpointOptions`)."""
        install_exit_codes()  # a refusal that ends the process says which with its exit code
        self.options = options if options is not None else CheckpointOptions.resolve(**settings)
        self.identity = identity or resolve_identity(self.options.node)
        self.node = self.identity.checkpoint_node
        self.writes = self.identity.is_chief
        self.job = self.options.job
        self.client = ServiceClient(self.options.service, token=self.options.token) if self.options.service else None
        self.attempt: str | None = None
        self.store = durable_tier(self.options, self.client, self.node, lambda: self.attempt)
        self.local_store = local_tier(self.options, self.identity)
        self.fenced = False
        self.saves = SaveCounts()
        self.declared: JobInfo | None = None  # the job as the service has it, once known
        self._answered: LastGood | None = None  # the last-good answer a one-request start brought
        self._restorer: Restorer | None = None
        self._writer = BackgroundWriter() if self.options.async_save else None
        self.reports = Reports(self.client, self.job, self.node)
        self._retention = (
            None
            if self.client is None
            else Retention(self.client, self.job, self.node, self.tiers, self.reports, on_delete=self._deleting)
        )
        self._replicator: Replicator | None = None
        self.requests: CheckpointRequests | None = None  # checkpoint-now, followed once registered
        self._durable_away = False  # the durable tier did not answer at start: the start reads without it
        self._disagreement: str | None = None  # replicas disagreed at a save: not told to the other ranks yet
        self._drawn_next: RetryingQueue[tuple[CopyKey, Mapping[str, Any]]] = RetryingQueue(
            "ckptstore-drawn-next",
            self._write_drawn_next,
            transient=(StorageUnavailableError,),
            on_dropped=self._drawn_next_lost,
        )
        if self.local_store is not None:
            self._replicator = Replicator(
                self.local_store,
                self.store,
                self.job,
                self.node,
                on_replicated=self._replicated,
                on_lost=self._lost_locally,
            )
        self.peers: PeerReplicas | None = None
        if self.local_store is not None and self.client is not None and self.options.peer_replicas:
            self.peers = PeerReplicas(
                local=self.local_store,
                client=self.client,
                job=self.job,
                node=self.node,
                replicas=self.options.peer_replicas,
                keep=self.options.local_max_to_keep,
                commit=self.reports.commit,
                mark=lambda copy, state, cause, reason: self.reports.mark(copy, state, cause=cause, reason=reason),
            )
        if self.writes and self.client is not None:
            self._check_declared_job(self.client)

    @property
    def skipped_saves(self) -> int:
        return self.saves.skipped

    def _check_declared_job(self, client: ServiceClient) -> None:
        """Refuse at once a process that cannot take part in the job as declared (`startup.check_job`);
        with the service away it is checked again at start."""
        try:
            self.declared = client.get_job(self.job)
        except CheckpointNotFoundError:
            return  # declared at start, as this process says
        except ServiceUnavailableError as exc:
            log.warning("service unreachable (%s): the job is checked at start", exc)
            return
        nodes = self.options.expected_nodes(self.node) if self.options.nodes is not None else self.declared.nodes
        check_job(self.declared, identity=self.identity, nodes=nodes, storage=self.store.url)

    @property
    def tiers(self) -> dict[Tier, Store]:
        """The tiers this process reads, nearest first."""
        return {"local": self.local_store, "durable": self.store} if self.local_store else {"durable": self.store}

    @property
    def start_tiers(self) -> dict[Tier, Store]:
        """The tiers this start reads: all of them, or all but a durable tier that did not answer at
        start (once `start_without_durable` let the start go on), so it is not asked again and again."""
        return {t: s for t, s in self.tiers.items() if not (t == "durable" and self._durable_away)}

    # -- start and restore ---------------------------------------------------------------------

    def register(self) -> None:
        """Probe the tiers (a misconfiguration fails here), declare or check the job, record the copies the
        service does not know, then register this attempt (fencing older ones) — in one request when nothing
        has to change; offline (service away or none), number it from storage. Processes that do not
        write register nothing (`ckptstore.client.engine.startup`)."""
        if not self.writes or self.attempt is not None:
            return
        local_root = None if self.local_store is None else self.local_store.url
        if self.options.presigned and self.client is not None and self.declared is None:
            self.declared = declare_first(self.client, self.options, self.identity, self.store.url, local_root)
        silent = probe_tiers(self.tiers)
        if "durable" in silent:
            if start_without_durable(self, silent["durable"]):
                self._durable_away = True
            else:  # its copies are needed: wait for the tier (bounded), then refuse
                wait_s = self.options.storage_wait_s
                still = wait_for_tier(self.store, self.job, self.node, wait_s=wait_s, error=silent["durable"])
                if still is not None:
                    raise copies_unseen(self, still, wait_s)
        if self.client is not None:
            try:
                self.declared, self.attempt, self._answered = register_start(
                    self.client,
                    self.options,
                    self.identity,
                    self.declared,
                    self.store.url,
                    self.start_tiers,
                    local_root,
                )
            except ServiceUnavailableError as exc:
                log.warning("service unreachable (%s): continuing with an offline attempt", exc)
        if self.attempt is None:
            self.attempt = new_offline_attempt(highest_attempt_on_storage(self.start_tiers, self.job, self.node))
        elif self.peers is not None:
            self.peers.serve()
        if self.client is not None and self.requests is None:  # on a client of its own: a stream held open
            own = ServiceClient(self.options.service, token=self.options.token)
            self.requests = CheckpointRequests(own, self.job, self.node)

    def start(self, *, one_pass: bool = False) -> Restored | None:
        """Register, then find the newest intact copy to resume from, verified (None on a fresh job). Nothing is
        assigned here: the caller applies the arrays, then calls `resumed`. `one_pass`: the caller reads them
        into place and calls `fall_back` when a tensor fails its check there (taken where a fallback copy
        overwrites every target and no other node waits: a strict restore of the job's only node)."""
        self.register()
        alone = self.client is None or (self.declared is not None and self.declared.nodes == [self.node])
        tiers: Mapping[Tier, Store] = self.start_tiers
        if self.peers is not None and self.declared is not None and "-" not in (self.attempt or "-"):
            peers, nodes, answered = self.peers, self.declared.nodes, self._answered
            tiers = WithPeerTier(tiers, lambda: peers.tier(nodes, answered))
        self._restorer = restorer = Restorer(
            job=self.job,
            node=self.node,
            tiers=tiers,
            client=self.client,
            attempt=self.attempt if self.writes else None,
            timeout_s=self.options.restore_timeout_s,
            answered=self._answered,
            one_pass=one_pass and self.options.strict and alone,
        )
        with tracing.span("ckptstore.restore.read", job=self.job, node=self.node) as span:
            try:
                restored = restorer.restore()
            except NothingToRestoreError as exc:
                if not self.options.fresh_start:
                    raise
                fresh_anyway(self.job, self.node, str(exc))
                restored = None
            if restored is None and self.options.parent is not None:
                restored = restore_fork(self.tiers, self.job, self.node, self.options.parent)
            if restored is not None:
                nbytes = restored.checkpoint.manifest.total_bytes
                tracing.set_attributes(
                    span, position=str(restored.copy.position), tier=restored.copy.tier, bytes=nbytes
                )
        check_resume(self, restored)
        if self._replicator is not None:
            self._replicator.resume()
        if self.peers is not None and self.declared is not None:
            self.peers.follow(self.declared.nodes)
        return restored

    def fall_back(self, failed: Restored, error: CorruptCheckpointError) -> Restored:
        """The next copy after `failed` was found damaged while read into place (`Restorer.fall_back`)."""
        assert self._restorer is not None, "start() restores first"
        return self._restorer.fall_back(failed, error)

    def resumed(
        self, restored: Restored, seconds: float, audit: ResumeAudit | None = None, *, pending: bool = False
    ) -> None:
        """The restored state is in place: report the restore's time and say where it resumed from, and
        the resume audit's verdict — one line a user sees by default (not a log record at a level they
        may have hidden), a drift's differences each on a line under it (`pending`: the declared state
        matches and the proof is said at the first step)."""
        self.reports.stats("restore", seconds, restored.checkpoint.manifest.total_bytes)
        copy, skipped = restored.copy, "; ".join(str(s) for s in restored.skipped)
        print(
            f"ckptstore: {self.job}/{self.node} resumed from {copy.position} ({copy.tier} copy, attempt "
            f"{copy.attempt}){'; skipped ' + skipped if skipped else ''}{'' if audit is None else said(audit, pending=pending)}",
            file=sys.stderr,
            flush=True,
        )

    def report_audit(self, audit: ResumeAudit) -> None:
        """Keep the restore's resume audit with this attempt on the service (in the background)."""
        if self.attempt is not None and self.writes:
            self.reports.audit(self.attempt, audit)

    # -- save ----------------------------------------------------------------------------------

    def ready(self, position: Position) -> bool:
        """Whether a save at `position` can start now (`BackgroundWriter.admit`): never waiting behind a
        save that retries a failing storage or ran past its patience — then it is skipped and counted."""
        return self._writer is None or self._writer.admit(position, self.saves)

    def save(
        self,
        position: Position,
        arrays: Mapping[str, np.ndarray],
        *,
        step: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> bool:
        """Save `arrays` at `position` (in the background when async); the arrays must stay unchanged until
        then. Returns whether the save started: not when a process is not the chief (under
        MultiWorkerMirroredStrategy the chief writes), nor when `ready` skips it."""
        self.raise_if_fenced()
        if self.writes and self.attempt is None:
            raise ConfigurationError("save() before restore_or_initialize(), which finds the copies to resume from")
        if not self.writes or not self.ready(position):
            return False
        self.saves.requested += 1
        if self.requests is not None:
            self.requests.done()
        finite = recordable(metrics or {})
        caller = tracing.capture()  # the write's span continues the caller's trace on the writer thread

        def write() -> None:
            with tracing.attached(caller):
                self._write(position, arrays, step, dict(metadata or {}), finite)

        if self._writer is None:
            self._guarded(write)
            self.wait(held=False)
        else:
            self._writer.submit(position, lambda: self._guarded(write))
        return True

    def record_drawn_next(self, position: Position, record: Mapping[str, Any]) -> None:
        """Keep beside this node's copy at `position` what the run drew right after it (the resume proof's
        late record, client/audit/late_record.py) — queued, written once the copy is committed on each
        tier that holds it (replication carries it to a tier the copy reaches later), off the training
        path; `wait` waits for it a little. A record that cannot be written is said and lost: a resume
        from that copy is then unverified."""
        if self.writes and self.attempt is not None:
            self._drawn_next.put((self.store.key(self.job, self.node, position, self.attempt), record))

    def _write_drawn_next(self, item: tuple[CopyKey, Mapping[str, Any]]) -> None:
        copy, record = item
        if self._writer is not None:
            self._writer.join_current()  # the copy's own save, if it is still being written
        for store in self.tiers.values():
            try:
                store.record_drawn_next(copy.on(store.tier), record)
            except CheckpointNotFoundError:
                continue  # not committed there (yet: replication carries the record along)

    def _drawn_next_lost(self, item: tuple[CopyKey, Mapping[str, Any]], error: Exception) -> None:
        log.warning("what the run drew after %s could not be kept (%s): a resume from it is unverified", item[0], error)

    def drawn_next(self, copy: CopyKey) -> Mapping[str, Any] | None:
        """What the run of `copy` drew first after it (`record_drawn_next`): from the tier the copy was
        read from, else another that holds it; None where none has it (or none answers)."""
        tiers = self.tiers
        for tier in sorted(tiers, key=lambda tier: tier != copy.tier):
            try:
                record = tiers[tier].drawn_next(copy.on(tier))
            except (CkptStoreError, OSError) as exc:
                log.info("what the run drew after %s could not be read from the %s tier (%s)", copy, tier, exc)
                continue
            if record is not None:
                return record
        return None

    def wait_for_drawn_next(self) -> None:
        """Until the late records queued (`record_drawn_next`) are written — DRAWN_NEXT_WAIT_S at most, and
        not at all while a save is in flight (still retrying: they follow it in the background)."""
        if self._writer is None or not self._writer.busy:
            self._drawn_next.drain(DRAWN_NEXT_WAIT_S)

    @property
    def requested(self) -> bool:
        """Whether a checkpoint request (`ckptstore checkpoint-now`) waits for this node's next save."""
        return self.requests is not None and self.requests.pending

    @property
    def writing(self) -> bool:
        """Whether a save is in flight: started and not yet committed on its first tier."""
        return self._writer is not None and self._writer.busy

    def wait_for_write(self, *, grace: float = 0.0) -> None:
        """Block until the save in flight is committed on its first tier (or skipped) — or found retrying a
        failing storage: then `grace` seconds more at most, and it is counted skipped, said, and goes on
        retrying in the background (committed after all, it counts as committed)."""
        writer = self._writer
        while writer is not None and not writer.wait(timeout=0.1):
            flight = writer.in_flight
            if flight is None or flight.failure is None:
                continue
            if not flight.abandoned and not writer.wait(timeout=grace):
                flight.abandoned = True
                self.saves.skip(f"the save at {flight.position} is {flight.state()}")
                log.warning(
                    "checkpoint save skipped: the save at %s is %s; it goes on retrying in the background",
                    flight.position,
                    flight.state(),
                )
            break
        self.raise_if_fenced()

    def wait(self, *, held: bool = True) -> None:
        """Block until the save in flight is written and replicated and the service has its records —
        or until the durable tier or the service is found away (they keep retrying in the background);
        with peer replicas and `held`, until a peer recorded the newest local copy too (bounded: `PeerReplicas`)."""
        self.wait_for_write()
        self.wait_for_drawn_next()
        if self._replicator is not None and not self._replicator.wait():
            log.warning("the durable tier is away: %d local copies wait for replication", self._replicator.pending)
        if self._retention is not None and not self._retention.wait():
            log.warning("service unreachable: retention waits for it")
        if not self.reports.drain():
            log.warning("service unreachable: %d commit(s) will be re-posted", self.reports.pending_commits)
        elif held and self.peers is not None:
            self.peers.wait_until_held()
        self.raise_if_fenced()

    def raise_if_fenced(self) -> None:
        if self.reports.fenced is not None:
            self.fenced = True
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
            self.saves.skip(str(exc))
            log.warning("checkpoint save skipped (%s); training continues", exc)
            self.reports.health(self.store.accessible(timeout=5))

    def _failing(self, exc: StorageUnavailableError) -> None:
        """A save's first try failed (it retries): cp_accessible is false now, said at once."""
        self.reports.health(AccessReport(False, None, str(exc)[:2000], exc.failure))

    def _write(
        self,
        position: Position,
        arrays: Mapping[str, np.ndarray],
        step: int | None,
        metadata: dict[str, Any],
        metrics: dict[str, float],
    ) -> None:
        assert self.attempt is not None, "register() numbers the attempt before any save"
        started = time.perf_counter()
        # A value known only after the capture (the replicas' hashes) is waited for here, off the training path.
        metadata = {key: value.result() if isinstance(value, Future) else value for key, value in metadata.items()}
        metadata |= {"metrics": metrics}
        copy = self.store.key(self.job, self.node, position, self.attempt)
        with tracing.span("ckptstore.write", job=self.job, node=self.node, position=str(position)) as span:
            ref = None
            if self.local_store is not None:
                try:
                    ref = self.local_store.write(copy.on("local"), arrays, step=step, metadata=metadata)
                except StorageUnavailableError as exc:
                    log.warning("the local tier failed (%s): saving %s straight to the durable tier", exc, position)
            if ref is None:  # a synchronous save holds training: it retries SYNC_RETRY_S at most
                flight, timeout = None if self._writer is None else self._writer.in_flight, self.options.save_timeout_s
                ref = write_retrying(
                    self.store,
                    copy,
                    arrays,
                    step=step,
                    metadata=metadata,
                    timeout_s=timeout if self._writer is not None else min(timeout, SYNC_RETRY_S),
                    flight=flight,
                    on_first_failure=self._failing,
                )
            tracing.set_attributes(span, bytes=ref.bytes, tier=ref.key.tier)
        self.saves.committed += 1
        flight = None if self._writer is None else self._writer.in_flight
        if flight is not None and flight.abandoned:
            self.saves.skipped -= 1  # counted skipped when a wait gave up on it; it committed after all
        self.reports.saved()
        self.reports.stats("save", time.perf_counter() - started, ref.bytes)
        self.reports.commit(Commit(ref, metrics))
        disagree = disagreement_of(ref.manifest)
        if disagree is not None:  # kept for inspection, never resumed from, never replicated
            self.reports.mark(ref.key, "corrupt", cause="agreement", reason=disagree)
            log.warning("%s: the save at %s is kept but not good", disagree, position)
            self._disagreement = disagree
        elif ref.key.tier == "durable":
            self._retain()
        elif self._replicator is not None:
            self._replicator.submit(ref.key)

    # -- replication and retention -------------------------------------------------------------

    def _replicated(self, ref: CheckpointRef) -> None:
        self.reports.commit(Commit.of(ref))
        self._retain()
        assert self.local_store is not None
        for copy in local_tier_surplus(
            self.local_store, self.store, self.job, self.node, self.options.local_max_to_keep
        ):
            self.delete(copy, cause="retention", reason="local tier retention")

    def _retain(self) -> None:
        if self._retention is not None:
            self._retention.request()

    def _lost_locally(self, copy: CopyKey, error: Exception) -> None:
        missing = isinstance(error, CheckpointNotFoundError) or getattr(error, "missing", False)
        state: MarkState = "missing" if missing else "corrupt"
        self.reports.mark(copy, state, cause="replication", reason=f"replication: {error}")

    def delete(self, copy: CopyKey, *, cause: MarkCause, reason: str) -> None:
        """Delete a copy of this node, then mark it deleted — in the background, like every report: a
        fit ending while the service is down does not wait."""
        store = self.tiers.get(copy.tier)
        assert store is not None, f"this process has no {copy.tier} tier"
        self._deleting(copy)
        delete_copy(store, copy)
        self.reports.mark(copy, "deleted", cause=cause, reason=reason)

    def take_disagreement(self) -> str | None:
        """The newest replica disagreement a save of this process found since the last call (the other
        ranks are told at the next save)."""
        disagree, self._disagreement = self._disagreement, None
        return disagree

    def _deleting(self, copy: CopyKey) -> None:
        """A copy of this node is deleted on purpose: a local one waiting for replication need not be."""
        if self._replicator is not None and copy.tier == "local":
            self._replicator.forget(copy)

    def delete_all(self, *, cause: MarkCause, reason: str) -> None:
        """Delete every copy of this node on every tier (Keras semantics when a fit finishes)."""
        for store in self.tiers.values():
            for position in store.list_positions(self.job, self.node):
                for copy in store.copies(self.job, self.node, position):
                    self.delete(copy, cause=cause, reason=reason)

    def close(self) -> None:
        """Wait for what is in flight, end the background threads, and — when saves were skipped — say
        how many of the run's saves were committed (one line, on stderr)."""
        try:
            self.wait_for_write(grace=RETRYING_GRACE_S)
            self.wait()
        finally:
            summaries = [self.saves.summary(), None if self._replicator is None else self._replicator.summary()]
            summaries.append(None if self.peers is None else self.peers.summary())
            for summary in summaries:
                if summary is not None:
                    print(f"ckptstore: {self.job}/{self.node}: {summary}", file=sys.stderr, flush=True)
            for worker in (
                self._replicator,
                self.peers,
                self._retention,
                self.reports,
                self.requests,
                self._drawn_next,
            ):
                if worker is not None:
                    worker.close()
            if self.client is not None:
                self.client.close()
