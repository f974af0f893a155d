"""What the loop managers share — TensorFlow's (client/tensorflow/manager.py) and PyTorch's (client/torch/):
start and restore through the node checkpointer, save at (epoch, batch), checkpoint on SIGTERM,
wait and close. A framework manager says only how its objects become named host arrays
(`_capture`) and how arrays go back into them (`_apply`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from ckptstore import Position, tracing
from ckptstore.client.audit.batch_hash import batch_hash
from ckptstore.client.audit.declared import audit, judged
from ckptstore.client.audit.late_record import LateRecord
from ckptstore.client.audit.proof import FIRST_BATCH, ResumeProof, start_proof
from ckptstore.client.engine.cadence import SaveCadence, SaveEvery
from ckptstore.client.engine.identity import NodeIdentity
from ckptstore.client.engine.node import NodeCheckpointer
from ckptstore.client.engine.options import CheckpointOptions
from ckptstore.client.engine.preemption import PreemptionNotice
from ckptstore.client.engine.restore import Restorer, restore_in_one_pass
from ckptstore.client.engine.staging import snapshot_arrays
from ckptstore.copies import Restored
from ckptstore.errors import CkptStoreError
from ckptstore.wire.schema import ResumeAudit

__all__ = ["LoopManager", "LOOP"]

LOOP = "loop"  # the data a custom loop shows the resume proof, batch by batch (`LoopManager.observe_batch`)

log = logging.getLogger("ckptstore.client")


class LoopManager:
    """Save and restore a training loop's state every epoch (or batch), through ckptstore.

    Options are `CheckpointOptions`' (storage, service, job, node, max_to_keep, async_save,
    on_error, strict, …), each defaulting to its CKPTSTORE_* variable where it has one.
    `save_every` / `save_every_seconds`: when a `save()` call saves (client/engine/cadence.py; by default,
    every call does).
    """

    def __init__(
        self,
        *,
        options: CheckpointOptions | None = None,
        identity: NodeIdentity | None = None,
        save_every: SaveEvery = None,
        save_every_seconds: float | None = None,
        **settings: Any,
    ):
        self.cadence = SaveCadence(save_every, save_every_seconds)
        self.options = options if options is not None else CheckpointOptions.resolve(**settings)
        self.checkpointer = NodeCheckpointer(self.options, identity=identity)
        if self.cadence.every == "auto" and self.checkpointer.client is None:
            log.warning("save_every='auto' follows the service's advice and there is no service: it saves each epoch")
        self.resume_position: Position | None = None
        self._declared: ResumeAudit | None = None  # the last restore's declared audit
        self.proof: ResumeProof | None = None  # its proof (client/audit/proof.py), settled at the first step
        # Whether a framework adapter tells the proof when the first step begins (Keras' callback): then
        # the loop's between-batch calls do not settle it.
        self.steps_reported = False
        # The data objects whose next draws the save being made cannot tell (set as it captures), and what
        # the run draws first after its last such epoch-end save (client/audit/late_record.py).
        self.unforetold: set[str] = set()
        self.late: LateRecord | None = None
        self.observing = False  # the loop shows the proof its batches (`observe_batch`)
        self.preemption = PreemptionNotice(self.options.preemption_budget_s)
        self._staging: dict[str, np.ndarray] = {}  # host buffers an async save writes from, reused
        self._between_batches = 0  # checkpoint_if_preempted calls, the same count on every process

    # -- what a framework manager provides ------------------------------------------------------

    def _capture(self, position: Position) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The state at `position` (what data objects record of it) as named host arrays — views of the
        live values where the framework allows — and the manifest metadata that describes them."""
        raise NotImplementedError

    def _apply(self, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, Any]) -> None:
        """Put a verified checkpoint's arrays back into the state."""
        raise NotImplementedError

    def _live_fingerprint(self, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, Any]) -> dict[str, Any]:
        """The live run's fingerprint (ckptstore.fingerprint), to audit a restore of the checkpoint with
        `arrays` and `metadata` against, before anything is assigned."""
        raise NotImplementedError

    def _watch(self, proof: ResumeProof) -> None:
        """After a restore, before training: make the data objects the proof expects report what they
        hand out first (`proof.drawn`)."""

    def _watchable(self) -> set[str]:
        """The data objects whose first draws `_watch` can report."""
        return set()

    def _unobservable(self) -> str | None:
        """Why the loop's data cannot be observed at all (None: its data objects are watched)."""
        return None

    def _proof_hint(self) -> str | None:
        """What the proof adds where the saved run recorded nothing after its save: how a custom loop shows more."""
        if LOOP not in self._watchable():
            return None
        return "a custom loop shows the proof its batches with manager.observe_batch(batch) before each step"

    def _custom_loop_batches(self) -> None:
        """A custom loop's save (TensorFlow, JAX): what it trains first after it is recorded late, once
        the loop shows its batches (`observe_batch`)."""
        self.unforetold = {LOOP} if self.observing else set()

    def _watch_after_save(self, late: LateRecord) -> None:
        """After an epoch-end save: make the data objects in `late.names` report their first draw to it
        (`late.drew`); an adapter that sees the batches itself reports them (Keras' callback)."""

    def _gather(self, *, collective: bool) -> None:
        """Called on every process as a save begins, writer or not (`collective`: the processes are all
        saving now, so a collective may run)."""

    def _compare_replicas(self, *, captured: bool) -> dict[str, Any]:
        """Called on every process after the writer captured its state (`captured`: it did, and saves it):
        what the copy's metadata keeps of the replicas' agreement (ckptstore/agreement.py)."""
        return {}

    def _started(self) -> None:
        """Called once the start is over (restored or fresh)."""

    @property
    def _request_agreed_every(self) -> int:
        """Between-batch calls per agreement on a checkpoint request: 1, unless agreeing is a collective."""
        return 1

    def _agree(self, due: bool) -> bool:
        """Whether the processes that save together save now, from this one's `due` (a timed cadence
        may decide differently on each; the one that writes decides)."""
        return due

    # -- the loop's calls ------------------------------------------------------------------------

    def restore_or_initialize(self) -> int:
        """Restore the last good position (if any) and return the next epoch to run (0 on a fresh job).

        After a mid-epoch position, `resume_position.batch` batches of that epoch are already trained
        (`first_batch(epoch)` says where to start).
        """
        self.preemption.install()
        started = time.perf_counter()
        found = restore_in_one_pass(self.checkpointer, self._assign)
        restored = None if found is None else found[0]
        if restored is not None:
            pending = self.proof is not None and not self.proof.settled
            self.checkpointer.resumed(restored, time.perf_counter() - started, self.audit, pending=pending)
        self.resume_position = None if restored is None else restored.copy.position
        self._started()
        self.cadence.restart(self.resume_position)
        self._follow_advice()
        position = self.resume_position
        if position is None:
            return 0
        return position.epoch + 1 if position.is_end_of_epoch else position.epoch

    def _assign(self, restored: Restored) -> None:
        """Audit the restored copy, then assign every array (tensors read into place, each checked there)."""
        checkpoint = restored.checkpoint
        self._audit(restored)  # reads the small tensors it compares, checked as they land
        where = self._where(restored.copy.position)
        with tracing.span("ckptstore.restore.assign", **where, bytes=checkpoint.manifest.total_bytes):
            self._apply(checkpoint.arrays, checkpoint.manifest.metadata)
        if self.proof is not None and not self.proof.settled:
            self._watch(self.proof)

    @property
    def audit(self) -> ResumeAudit | None:
        """The last restore's resume audit: its proof's verdict once settled (at the first step), the
        declared one until then (None: nothing restored, or resume_check="off")."""
        if self.proof is not None and self.proof.result is not None:
            return self.proof.result
        return self._declared

    def _audit(self, restored: Restored) -> None:
        """The restore's resume audit (client/audit/declared.py) and its proof (client/audit/proof.py);
        under resume_check="raise" a drift, or a mid-epoch resume nothing can verify, refuses here,
        before anything is assigned."""
        self.proof = self._declared = None
        check = self.options.resume_check
        if check == "off":
            return
        declared = self._audit_of(restored)
        mid_epoch = restored.copy.position.batch is not None
        self._declared = declared
        if declared.verdict == "drift":
            judged(declared, self.checkpointer, check)
            return
        self.proof = start_proof(
            declared,
            restored.checkpoint.manifest.metadata,
            self.checkpointer,
            check,
            mid_epoch=mid_epoch,
            world=self._proof_world(),
            watched=self._watchable(),
            counting=True,
            unobservable=self._unobservable(),
            late=lambda: self.checkpointer.drawn_next(restored.copy),
            hint=self._proof_hint(),
        )

    def _proof_world(self) -> tuple[int, int]:
        """(size, rank) of the live run, for a data object's share of a global order."""
        return (1, 0)

    def _audit_of(self, restored: Restored) -> ResumeAudit:
        checkpoint, position = restored.checkpoint, restored.copy.position
        live = self._live_fingerprint(checkpoint.arrays, checkpoint.manifest.metadata)
        return audit(position, checkpoint.manifest.metadata, live)

    def _first_step_over(self, why: str) -> None:
        """The loop came back to ckptstore after the restore (a between-batch call, a save, close):
        whatever the data objects did not report by now is unverified."""
        if self.proof is not None and not self.proof.settled and not self.steps_reported:
            self.proof.settle(why)

    def check_restore(self) -> ResumeAudit | None:
        """The declared audit of the restore a start would make now — the same copy, verified, against
        the live objects — changing nothing: no attempt is registered, nothing is marked or assigned.
        A dry run trains nothing, so nothing is proven: where nothing declared differs it is
        `unverified` (the resume's own proof is made at its first step), never `exact`. None when
        there is nothing to resume from."""
        node = self.checkpointer
        restorer = Restorer(
            job=node.job, node=node.node, tiers=node.tiers, client=node.client, attempt=None, timeout_s=0
        )
        restored = restorer.preview()
        if restored is None:
            return None
        declared = self._audit_of(restored)
        if declared.verdict == "drift":
            return declared
        unproven = "a dry run: what the resumed run draws and counts is checked at its first step, not here"
        return declared.model_copy(update={"verdict": "unverified", "differences": [*declared.differences, unproven]})

    def first_batch(self, epoch: int) -> int:
        """How many batches of `epoch` the restored state has already trained (0 unless resumed mid-epoch)."""
        position = self.resume_position
        if position is None or position.is_end_of_epoch or position.epoch != epoch:
            return 0
        return position.batch or 0

    def save(
        self,
        epoch: int,
        *,
        batch: int | None = None,
        step: int | None = None,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> bool:
        """Checkpoint the state at (epoch, batch: batches of `epoch` trained; None: the epoch is over)
        when the cadence says a save is due (`save_every`; by default every call saves); returns once
        the state is copied to host memory (async saves) or committed. Returns whether it saved: not
        when no save is due, nor in a process that does not write, nor when the save would wait behind
        one still retrying a failing storage (then it is skipped, counted and said; training goes on)."""
        self._first_step_over("drew nothing before the loop's first save")
        position = Position(epoch, batch)
        if not self.due(epoch, batch=batch):
            return False
        self.cadence.saved(position)
        saved = self._save(position, step=step, metrics=metrics, metadata=metadata)
        self._follow_advice()
        return saved

    def due(self, epoch: int, *, batch: int | None = None) -> bool:
        """Whether a `save(epoch, batch=batch)` now would save (its cadence, or a checkpoint request; not
        whether storage takes it)."""
        due = self.cadence.due(Position(epoch, batch), writing=self.checkpointer.writing) or self.checkpointer.requested
        return self._agree(due) if self._decided_apart else due

    @property
    def _decided_apart(self) -> bool:
        """Whether processes saving together may decide differently (a clock, the writer, or a checkpoint
        request that reaches the writing process): then they follow its decision."""
        return self.cadence.timed or self.checkpointer.client is not None

    def _save(
        self,
        position: Position,
        *,
        step: int | None = None,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> bool:
        began = time.perf_counter()
        self._gather(collective=not self.preemption.pending)
        # The staging buffers are free once the previous write is done: `ready` waits for it, or skips.
        if not self.checkpointer.writes or not self.checkpointer.ready(position):
            self._compare_replicas(captured=False)
            return False
        with tracing.span("ckptstore.snapshot", **self._where(position)) as span:
            views, described = self._capture(position)
            # An async save writes while training goes on: from a copy. A synchronous one is written
            # before training can change anything: straight from the views (a copy of the state saved).
            arrays = snapshot_arrays(views, self._staging) if self.checkpointer.options.async_save else views
            if span is not None:  # tracing on: the sum costs a pass over every array otherwise
                tracing.set_attributes(span, bytes=sum(a.nbytes for a in arrays.values()))
        described |= self._compare_replicas(captured=True)
        saved = self.checkpointer.save(
            position, arrays, step=step, metrics=metrics, metadata={**described, **(metadata or {})}
        )
        if saved:  # what training waited for this save: the service's advice weighs it (server/records/advice.py)
            self.checkpointer.reports.stats("blocked", time.perf_counter() - began, 0)
        if saved and self.unforetold:
            self.late = LateRecord(position, self.unforetold, self._proof_world(), self.checkpointer.record_drawn_next)
            self._watch_after_save(self.late)
        return saved

    def _follow_advice(self) -> None:
        """save_every="auto": keep the service's recommended interval for the job fresh (in the background)."""
        client = self.checkpointer.client
        if client is not None and self.checkpointer.writes:
            job, node = self.checkpointer.job, self.checkpointer.node
            self.cadence.refresh(lambda: client.advice(job), where=f"{job}/{node}")

    def _where(self, position: Position) -> dict[str, str]:
        """A span's attributes that say which checkpoint it is about."""
        return {"job": self.checkpointer.job, "node": self.checkpointer.node, "position": str(position)}

    def checkpoint_if_preempted(self, epoch: int, batch: int, *, requests: bool = True) -> None:
        """Call between batches: after a SIGTERM, save (epoch, batch) and exit as SIGTERM would; after a
        checkpoint request (`ckptstore checkpoint-now`, a drain announced ahead), save it and go on
        (`requests=False`: not here — at an epoch's last batch, whose end-of-epoch save follows)."""
        self._first_step_over("drew nothing before the first batch ended")
        requested = requests and self.checkpointer.requested
        if self._decided_apart:  # every process asks, whatever it heard: the writer's answer is everyone's
            self._between_batches += 1
            agreeing = self._between_batches % self._request_agreed_every == 0
            requested = self._agree(requested) if agreeing else False
        if self.preemption.pending:
            if self.preemption.within_budget:
                self._save(Position(epoch, batch))
                self.checkpointer.wait(held=False)  # the budget is short: a peer pulls it while it runs
            self.close()
            self.preemption.exit()
        elif requested:
            position = Position(epoch, batch)
            self.cadence.saved(position)
            self._save(position)

    def observe_batch(self, batch: Any) -> None:
        """Show the resume proof the batch a custom loop (TensorFlow, JAX) is about to train — any nest of
        arrays. The first after a restore is checked against the one the saved run trained first after its
        save, which is recorded beside each copy (client/audit/late_record.py): without it a resume is
        `unverified`. Call it each step: a batch is hashed only when one of them waits for it."""
        self.observing = True
        proof, late = self.proof, self.late
        proving = proof is not None and not proof.settled and LOOP in proof.awaiting_first_batch
        recording = late is not None and not late.kept
        if not (proving or recording):
            return
        digest = batch_hash(batch)
        if proving:
            assert proof is not None
            proof.drawn(LOOP, [digest])
        if recording:
            assert late is not None
            late.drew(LOOP, {FIRST_BATCH: digest})

    def wait(self) -> None:
        """Block until the save in flight is committed."""
        self.checkpointer.wait()

    def close(self) -> None:
        if self.proof is not None and not self.proof.settled:
            try:
                self.proof.settle("no batch was drawn after the restore")
            except CkptStoreError as exc:  # raise: a run that trained nothing has nothing to refuse
                log.warning("%s", exc)
        self.preemption.uninstall()
        self.checkpointer.close()

    def __enter__(self) -> LoopManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
