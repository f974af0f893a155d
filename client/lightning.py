"""`BackupAndRestore` for PyTorch Lightning: the Trainer's full checkpoint through ckptstore, and a
killed run resumed exactly by a plain `trainer.fit(model, loader)`.

trainer = L.Trainer(max_epochs=10, callbacks=[BackupAndRestore(storage="s3://…", job="lm", every_n_train_steps=100)])
trainer.fit(model, loader)

A save is the checkpoint `trainer.save_checkpoint` would write — weights, optimizers, schedulers,
loops' progress, callbacks', the data loader's state where it has one — plus the random number
generators, which Lightning's own checkpoints leave out (so dropout and an unseeded shuffle draw
anew after its own resume). On a restart the callback restores the newest intact copy as the
checkpoint Lightning loads (as if `ckpt_path=` named it) and the generators as they were at the
save: a mid-epoch position's just before the next training step, an epoch end's before the next
epoch's data iterator is made. A `ckpt_path=` given to `fit` wins.

Exact (tested): mid-epoch positions and epoch ends, with a resumable data loader (torchdata's
`StatefulDataLoader`, shuffling) or a plain `DataLoader`. A resumable loader's own state at an
epoch's end would replay the saved epoch's order, so at an epoch end the callback keeps its
generators instead (as of the save) and gives them back just before the next epoch's iterator is
made. A plain loader has no state: mid-epoch, its epoch is drawn again from the generators as the
epoch began (kept with the save) and the batches trained are skipped. A save due at an epoch's last
batch is taken at the epoch's end, right after.

Under DDP rank 0 writes and every rank restores rank 0's copy. Lightning draws each rank's batches
from a `DistributedSampler` it puts in the loader; each save keeps the epoch's global count of samples
trained, so a restart on another number of ranks goes on from that count (client/torch/distributed.py):
no sample twice, none skipped, Lightning's batch counter set to the new world's, positions counting on
from the one resumed from. A run on one process takes part with `strategy="ddp"` (Lightning injects its
sampler only under a distributed strategy).
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from ckptstore import Position
from ckptstore.client.audit.declared import audit_restored
from ckptstore.client.audit.late_record import LateRecord
from ckptstore.client.audit.proof import BATCH_BEFORE, PROOF_KEY, ResumeProof, recorded, start_proof
from ckptstore.client.engine.node import NodeCheckpointer
from ckptstore.client.engine.options import CheckpointOptions
from ckptstore.client.engine.restore import restore_in_one_pass
from ckptstore.client.torch.distributed import DistributedLoaderPosition, is_distributed_loader
from ckptstore.client.torch.fingerprint import fingerprint
from ckptstore.client.torch.loaders import (
    DrawnBatches,
    generator_states,
    is_loader,
    next_ids,
    record_batches,
    set_generator_states,
    watch_first_draws,
)
from ckptstore.client.torch.manager import ranks_node
from ckptstore.client.torch.state import flatten, rng_state, set_rng_state, unflatten
from ckptstore.copies import Restored
from ckptstore.errors import CkptStoreError, ResumeRefusedError
from ckptstore.fingerprint import FINGERPRINT_KEY
from ckptstore.wire.schema import ResumeAudit

__all__ = ["BackupAndRestore"]

log = logging.getLogger("ckptstore.client")
TREE_KEY = "lightning_checkpoint"  # manifest metadata: the checkpoint's tree (client/torch/state.py)
RNG = "ckptstore_rng"  # the generators, beside Lightning's own keys
LOADER_GENERATORS = "ckptstore_loader_generators"  # each training loader's generators as of the save
EPOCH_RNG = "ckptstore_epoch_rng"  # mid-epoch: the generators as the epoch's data iterator was made
GLOBAL_COUNTS = "ckptstore_global_counts"  # each training loader's DistributedSampler position (its global count)


class BackupAndRestore(pl.Callback):
    """Lightning's checkpoints through ckptstore (each epoch, or every `every_n_train_steps`), and an
    exact resume of a restarted `fit`. Options are `CheckpointOptions`' (storage, job, service,
    local_storage, max_to_keep, codec, …; the job defaults to CKPTSTORE_JOB, else "lightning")."""

    def __init__(
        self,
        *,
        every_n_train_steps: int | None = None,
        job: str | None = None,
        storage: str | None = None,
        service: str | list[str] | None = None,
        local_storage: str | None = None,
        **options: Any,
    ):
        if every_n_train_steps is not None and (isinstance(every_n_train_steps, bool) or every_n_train_steps < 1):
            raise ValueError(f"every_n_train_steps must be a positive integer or None, got {every_n_train_steps!r}")
        self.every_n_train_steps = every_n_train_steps
        self.options = CheckpointOptions.resolve(
            default_job="lightning", job=job, storage=storage, service=service, local_storage=local_storage, **options
        )
        self.checkpointer: NodeCheckpointer | None = None
        self.resume_position: Position | None = None  # the position this fit resumed from (None: fresh)
        self._pending_rng: dict[str, Any] | None = None  # the restored position's generators, to put back
        self._resumed_mid_epoch = False
        self._epoch_rng: dict[str, Any] | None = None  # the generators as this epoch's data iterator was made
        self._save_at_epoch_end = False  # a save due at an epoch's last batch: taken at the epoch's end
        self._counts: list[DistributedLoaderPosition | None] = []  # per training loader over a DistributedSampler
        self._renumbered: tuple[int, int] | None = None  # (epoch, positions' batch minus Lightning's) when resumed
        self.proof: ResumeProof | None = None  # the resume's proof (client/audit/proof.py), settled at the first step
        self._drawn: list[DrawnBatches] = []  # per training loader, the ids of the batches its iterator took
        self._before: dict[str, int] = {}  # plain loaders the proof checks: their batch before the position
        self._first: dict[str, int] = {}  # loaders the proof checks from an epoch's end: their first batch
        self._late: LateRecord | None = None  # what the loaders draw first after an epoch-end save

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        started = time.perf_counter()
        self.proof = None
        options, identity = ranks_node(self.options)
        self.checkpointer = NodeCheckpointer(options, identity=identity)
        found = restore_in_one_pass(self.checkpointer, lambda restored: self._read(trainer, pl_module, restored))
        if found is None:
            _when_loaders_ready(trainer, self._loaders_ready)
            return
        restored, (report, checkpoint) = found
        self._pending_rng = checkpoint.pop(RNG)
        position = self.resume_position = restored.copy.position
        self._resumed_mid_epoch = not position.is_end_of_epoch
        generators = checkpoint.pop(LOADER_GENERATORS, None)
        epoch_rng = checkpoint.pop(EPOCH_RNG, None)
        counts = checkpoint.pop(GLOBAL_COUNTS, None) if self._resumed_mid_epoch else None
        if counts:
            self._renumber(trainer, checkpoint, position, counts)
        elif self._resumed_mid_epoch:
            _say_when_the_world_changed(restored, trainer.world_size, position)
        loop_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        if not self._resumed_mid_epoch and loop_state.get("combined_loader") and generators is not None:
            del loop_state["combined_loader"]  # the loaders' own states would replay the saved epoch

        def loaders_ready(loaders: list[Any]) -> None:
            self._loaders_ready(loaders)
            if counts:
                self._go_on_from_counts(loaders, counts, position, epoch_rng)
            elif self._resumed_mid_epoch:
                _skip_trained_batches(loaders, position, epoch_rng, self._pending_rng)
            else:
                _next_epoch_from_generators(loaders, generators)
            if self.proof is None:  # the loaders' first set-up (a reload sets them up again)
                self._start_proof(trainer, restored, report)

        _when_loaders_ready(trainer, loaders_ready)
        _load_when_fit_resumes(trainer, checkpoint, f"ckptstore:{self.options.job}@{position}")
        pending = report is not None and report.verdict != "drift"
        self.checkpointer.resumed(restored, time.perf_counter() - started, report, pending=pending)

    def _start_proof(self, trainer: pl.Trainer, restored: Restored, report: ResumeAudit | None) -> None:
        """The resume's proof, once the training loaders are set up: the first step's counters, and the
        first ids each loader over a DistributedSampler hands out (what a plain loader draws is not seen)."""
        assert self.checkpointer is not None
        loaders = _training_loaders(trainer)
        watched = {f"loader{i}": count for i, count in enumerate(self._counts) if count is not None}
        self._before, self._first = {}, {}
        if not watched and self._resumed_mid_epoch:  # one device: a StatefulDataLoader reports its first ids,
            watched = {f"loader{i}": loader for i, loader in enumerate(loaders) if is_stateful(loader)}
            self._before = {f"loader{i}": i for i, loader in enumerate(loaders) if not is_stateful(loader)}
        elif not watched:  # a plain one the batch before; from an epoch's end, each its first batch
            self._first = {f"loader{i}": i for i in range(len(loaders))}
        self.proof = start_proof(
            report,
            restored.checkpoint.manifest.metadata,
            self.checkpointer,
            self.options.resume_check,
            mid_epoch=self._resumed_mid_epoch,
            world=(trainer.world_size, trainer.global_rank),
            watched=set(watched) | set(self._before) | set(self._first),
            counting=True,
            late=lambda: self.checkpointer.drawn_next(restored.copy) if self.checkpointer is not None else None,
        )
        proof = self.proof
        if proof is None or proof.settled:
            return
        if report is not None and report.verdict == "resharded":
            proof.counters.pop("batch", None)  # Lightning's batch numbers are the new world's
        for name, count in watched.items():
            watch_first_draws(count, functools.partial(proof.drawn, name))

    def _renumber(self, trainer: pl.Trainer, checkpoint: dict[str, Any], position: Position, counts: list[Any]) -> None:
        """Resuming mid-epoch from saved global counts: Lightning's batch counter in the checkpoint is
        set to the batches each rank of this world has trained of that count (Lightning ends the epoch
        by it), and this run's positions go on from the one resumed from."""
        state = next(count for count in counts if count is not None)
        per_batch = (state["batch_size"] or 1) * trainer.world_size
        batches = state["consumed"] // per_batch
        progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
        current = progress["current"]
        shift = batches - current["ready"]
        for counter in ("ready", "started", "processed", "completed"):
            current[counter] += shift
            progress["total"][counter] += shift
        self._renumbered = (position.epoch, (position.batch or 0) - batches)
        if state["world"] != trainer.world_size:
            print(
                f"ckptstore: saved by {state['world']} rank(s), resuming on {trainer.world_size}: epoch "
                f"{position.epoch} goes on after its first {state['consumed']} samples in the global order "
                f"(Lightning's batch {batches} of the epoch on this world size)",
                file=sys.stderr,
                flush=True,
            )

    def _go_on_from_counts(
        self, loaders: list[Any], counts: list[Any], position: Position, epoch_rng: dict[str, Any] | None
    ) -> None:
        """Each training loader over a DistributedSampler resumes the saved epoch from its global count;
        any other skips the batches this rank trained of it (`_skip_trained_batches`)."""
        if len(counts) != len(loaders) or any(
            (state is None) != (count is None) for state, count in zip(counts, self._counts, strict=True)
        ):
            raise ResumeRefusedError(
                "the copy's training loaders drew from DistributedSamplers by a global count, this run's do not "
                "(a run on one process takes part with strategy='ddp'): their position cannot be carried over"
            )
        for state, count in zip(counts, self._counts, strict=True):
            if state is not None and count is not None:
                count.load_state_dict(state)
        others = [loader for loader, count in zip(loaders, self._counts, strict=True) if count is None]
        if others and self._renumbered is not None:
            trained = Position(position.epoch, (position.batch or 0) - self._renumbered[1])  # Lightning's count
            _skip_trained_batches(others, trained, epoch_rng, self._pending_rng)

    def _loaders_ready(self, loaders: list[Any]) -> None:
        """Lightning has set up the training loaders (each fit, each reload): follow the global count of
        those over a DistributedSampler, and record the generators as each epoch's iterator is made."""
        self._counts = [
            DistributedLoaderPosition(loader) if is_distributed_loader(loader) else None for loader in loaders
        ]
        for count in self._counts:
            if count is not None:
                count.sets_epoch = True  # Lightning calls the sampler's set_epoch each epoch
        self._record_epoch_rng(loaders)

    def _record_epoch_rng(self, loaders: list[Any]) -> None:
        """Keep the generators as they are each time a training loader's iterator is made (each epoch):
        a mid-epoch save carries them, so a plain loader's epoch can be drawn again on a restart. And
        keep the ids of the batches each iterator takes (`_drawn`): the resume proof's evidence."""
        self._drawn = [DrawnBatches() for _ in loaders]
        for i, loader in enumerate(loaders):
            make_iterator = loader._get_iterator

            def recording(make_iterator: Any = make_iterator, i: int = i) -> Any:
                self._epoch_rng = rng_state()
                self._drawn[i] = DrawnBatches()  # this iterator's
                return record_batches(make_iterator, self._drawn[i])

            loader._get_iterator = recording

    def _read(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, restored: Restored
    ) -> tuple[ResumeAudit | None, dict[str, Any]]:
        """The restored copy's resume audit and Lightning checkpoint, every tensor read into new memory
        (checked as it is read: nothing is assigned here)."""
        assert self.checkpointer is not None
        metadata = restored.checkpoint.manifest.metadata
        if TREE_KEY not in metadata:
            raise ValueError("this checkpoint was not written by ckptstore.client.lightning.BackupAndRestore")
        check = self.options.resume_check
        checkpoint = unflatten(json.loads(metadata[TREE_KEY]), restored.checkpoint.arrays)
        counts = checkpoint.get(GLOBAL_COUNTS)  # every loader goes on from a global count: on any world size
        reshards = bool(counts) and all(state is not None for state in counts)
        report = audit_restored(
            restored, self.checkpointer, check, lambda: _fingerprint(trainer, pl_module, reshards=reshards)
        )
        return report, checkpoint

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending_rng is not None and not self._resumed_mid_epoch:
            set_rng_state(self._pending_rng)  # before the next epoch's data iterator is made: it draws from them
            self._pending_rng = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, index: int) -> None:
        if self.proof is not None and not self.proof.settled:
            for name, i in self._before.items():  # drawn again and skipped: the last of them
                before = self._drawn[i].batch(index - 1) if index > 0 else None
                if before is not None:
                    self.proof.drawn(name, before)
            for name, i in self._first.items():
                if (first := self._drawn[i].batch(index)) is not None:
                    self.proof.drawn(name, first)
            self.proof.step({"epoch": trainer.current_epoch, "batch": index, "global_step": trainer.global_step})
        if self._late is not None and not self._late.kept:  # the first batch after an epoch-end save
            for i, drawn in enumerate(self._drawn):
                if (first := drawn.batch(index)) is not None:
                    self._late.drew(f"loader{i}", first)
        if self._pending_rng is not None:
            set_rng_state(self._pending_rng)
            self._pending_rng = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, index: int
    ) -> None:
        every = self.every_n_train_steps
        due = every is not None and trainer.global_step % every == 0
        # A checkpoint request (`ckptstore checkpoint-now`) is taken at the next step.
        requested = self.checkpointer is not None and self.checkpointer.requested
        if not (due or requested):
            return
        if _last_batch(trainer, index):  # the epoch's end follows at once: saved there, as an epoch's end
            self._save_at_epoch_end = True
            return
        epoch, batch = trainer.current_epoch, index + 1
        if self._renumbered is not None and self._renumbered[0] == epoch:
            batch += self._renumbered[1]
        self._save(trainer, Position(epoch, batch), next_batch=index + 1)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.every_n_train_steps is None or self._save_at_epoch_end:
            self._save_at_epoch_end = False
            self._save(trainer, Position(trainer.current_epoch), next_batch=0)

    def _proof_record(
        self, trainer: pl.Trainer, position: Position, next_batch: int, checkpoint: dict[str, Any]
    ) -> dict[str, Any]:
        """What the proof of a resume from `position` checks: Lightning's counters for the next step
        (`next_batch`: its batch number there) and what each training loader leads to (`checkpoint`:
        the one being saved, its loaders' states in it)."""
        fit_loop = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        loader_states = fit_loop.get("combined_loader") or []
        upcoming: dict[str, Any] = {}
        for i, count in enumerate(self._counts):
            ids = None if count is None else next_ids(count, count.state_dict())
            if ids is not None:
                upcoming[f"loader{i}"] = ids
        if not upcoming and not position.is_end_of_epoch:
            upcoming = self._next_on_one_device(trainer, next_batch, loader_states)
        epoch = position.epoch + 1 if position.is_end_of_epoch else position.epoch
        counters = {"epoch": epoch, "batch": next_batch, "global_step": trainer.global_step}
        return recorded(counters=counters, next_ids=upcoming)

    def _next_on_one_device(self, trainer: pl.Trainer, next_batch: int, states: list[Any]) -> dict[str, Any]:
        """Mid-epoch, for loaders without a DistributedSampler: a StatefulDataLoader's next ids (from the
        state Lightning saves of it), a plain loader's batch trained last (its resume draws it again)."""
        upcoming: dict[str, Any] = {}
        for i, loader in enumerate(_training_loaders(trainer)):
            if is_stateful(loader) and i < len(states):
                ids = next_ids(loader, states[i])
                if ids is not None:
                    upcoming[f"loader{i}"] = ids
            elif i < len(self._drawn) and (before := self._drawn[i].batch(next_batch - 1)) is not None:
                upcoming[f"loader{i}"] = {BATCH_BEFORE: before}
        return upcoming

    def _save(self, trainer: pl.Trainer, position: Position, *, next_batch: int) -> None:
        assert self.checkpointer is not None, "setup runs first"
        if not self.checkpointer.writes:  # under DDP rank 0 writes the job's one copy
            return
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        checkpoint[RNG] = rng_state()
        checkpoint[LOADER_GENERATORS] = [generator_states(loader) for loader in _training_loaders(trainer)]
        if any(count is not None for count in self._counts):
            for count in self._counts:
                if count is not None:
                    count.position = position
            checkpoint[GLOBAL_COUNTS] = [None if count is None else count.state_dict() for count in self._counts]
        if not position.is_end_of_epoch and self._epoch_rng is not None:
            checkpoint[EPOCH_RNG] = self._epoch_rng
        arrays: dict[str, Any] = {}
        tree = flatten(checkpoint, "lightning", arrays)
        # Async saves write in the background: from copies, since training goes on changing the tensors.
        copies = {name: array.copy() for name, array in arrays.items()} if self.options.async_save else arrays
        described = _fingerprint(trainer, trainer.lightning_module)
        described[PROOF_KEY] = self._proof_record(trainer, position, next_batch, checkpoint)
        metadata = {TREE_KEY: json.dumps(tree), FINGERPRINT_KEY: described}
        saved = self.checkpointer.save(position, copies, step=trainer.global_step, metadata=metadata)
        # From an epoch's end the next order is drawn as the next iterator is made: recorded late.
        unforetold = [f"loader{i}" for i in range(len(self._drawn)) if f"loader{i}" not in described[PROOF_KEY]["next"]]
        if saved and position.is_end_of_epoch and unforetold:
            world = (trainer.world_size, trainer.global_rank)
            self._late = LateRecord(position, unforetold, world, self.checkpointer.record_drawn_next)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.checkpointer is not None:
            if self.proof is not None and not self.proof.settled:
                try:
                    self.proof.settle("no batch was drawn after the restore")
                except CkptStoreError as exc:  # raise: a fit that trained nothing has nothing to refuse
                    log.warning("%s", exc)
            self.checkpointer.wait()
            self.checkpointer.close()
            self.checkpointer = None


def _fingerprint(trainer: pl.Trainer, module: pl.LightningModule, *, reshards: bool = False) -> dict[str, Any]:
    """The run as the resume audit compares it: the module's arrays, the world, the seed, and the data
    loader's kind, batch size and dataset length (once Lightning has set it up; `reshards`: its data
    goes on from the saved global counts on any world size)."""
    world = (trainer.world_size, trainer.global_rank)
    record = fingerprint(
        {"model": module}, {"model": module.state_dict()}, world=world, seed=torch.initial_seed(), rank_seeds=None
    )
    record["framework"]["versions"]["lightning"] = pl.__version__
    loader = trainer.train_dataloader
    if loader is not None and hasattr(loader, "batch_size") and hasattr(loader, "dataset"):
        length = len(loader.dataset) if hasattr(loader.dataset, "__len__") else None
        record["data"]["loader"] = {"type": type(loader).__name__, "batch_size": loader.batch_size, "length": length}
    if reshards:
        record["data"].setdefault("loader", {})["reshards"] = True
    return record


def _say_when_the_world_changed(restored: Restored, world: int, position: Position) -> None:
    """A mid-epoch copy without global counts (its loaders had no DistributedSampler: a single-device
    strategy) resumed on another number of ranks: the audit says drift; this says why and what to do."""
    described = restored.checkpoint.manifest.metadata.get(FINGERPRINT_KEY)
    saved = described.get("world", {}).get("size") if isinstance(described, dict) else None
    if isinstance(saved, int) and saved != world:
        log.warning(
            "ckptstore: %s was saved by %d process(es) whose loaders had no DistributedSampler (a single-device "
            "strategy?): its data position cannot be carried over to %d ranks, so the rest of the epoch is not the "
            "saved run's; train with strategy='ddp' (on one process too) for copies that reshard",
            position,
            saved,
            world,
        )


def _training_loaders(trainer: pl.Trainer) -> list[Any]:
    """The training data loaders Lightning iterates, flattened (its combined loader's)."""
    combined = trainer.fit_loop._combined_loader
    return [] if combined is None else [loader for loader in combined.flattened if is_loader(loader)]


def is_stateful(loader: Any) -> bool:
    """A loader with a state of its own that Lightning saves and loads (torchdata's StatefulDataLoader)."""
    return hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")


def _when_loaders_ready(trainer: pl.Trainer, ready: Callable[[list[Any]], None]) -> None:
    """Call `ready` with the training loaders each time Lightning has set them up and loaded their
    states, just before it makes their iterators (its fit loop's `_load_combined_loader_states`:
    Lightning has no public hook there)."""
    fit_loop = trainer.fit_loop
    original = fit_loop._load_combined_loader_states

    def loaded() -> None:
        original()
        ready(_training_loaders(trainer))

    fit_loop._load_combined_loader_states = loaded  # type: ignore[method-assign]


def _next_epoch_from_generators(loaders: list[Any], generators: list[Any] | None) -> None:
    """Resuming at an epoch's end: the resumable loaders' own states would replay the saved epoch, so
    they were not loaded; their generators are set to the save's just before the next epoch's
    iterator is made, which then draws what the uninterrupted run drew. Without saved generators (a
    checkpoint older than this), the states were loaded as Lightning would, and that is said."""
    if generators is None:
        if any(is_stateful(loader) for loader in loaders):
            log.warning(
                "ckptstore: resuming at an epoch's end from a checkpoint without the loaders' generators: a "
                "resumable loader (torchdata's StatefulDataLoader) replays the saved epoch's order"
            )
        return
    same = len(loaders) == len(generators)
    if not (same and all(set_generator_states(d, states) for d, states in zip(loaders, generators, strict=True))):
        log.warning("ckptstore: the training loaders changed since the save: their generators start anew")


def _skip_trained_batches(
    loaders: list[Any], position: Position, epoch_rng: dict[str, Any] | None, saved_rng: dict[str, Any] | None
) -> None:
    """Resuming mid-epoch: a loader with a state of its own (torchdata's StatefulDataLoader) goes on
    from it. A plain DataLoader has none — Lightning would start the epoch's data over — so its epoch
    is drawn again from the generators as it began (saved with the copy) and the batches trained
    before the save are drawn and skipped; then the generators are put back as saved."""
    plain = [loader for loader in loaders if not is_stateful(loader)]
    if not plain:
        return
    if epoch_rng is None:
        log.warning(
            "ckptstore: resuming mid-epoch (%s) with a plain DataLoader from a copy without the epoch's generators: "
            "the epoch's data starts over (not an exact resume); use torchdata's StatefulDataLoader",
            position,
        )
        return
    batches = position.batch or 0
    print(
        f"ckptstore: the plain DataLoader has no state of its own: epoch {position.epoch}'s first {batches} batches "
        "are drawn again and skipped (Lightning's warning that the loader is not resumable does not apply)",
        file=sys.stderr,
        flush=True,
    )
    set_rng_state(epoch_rng)
    for loader in plain:
        make_iterator = loader._get_iterator

        def skipping(loader: Any = loader, make_iterator: Any = make_iterator) -> Any:
            loader._get_iterator = make_iterator  # one iterator: the loader's own (or the recorder) after it
            iterator = make_iterator()
            for _ in range(batches):
                next(iterator)
            if saved_rng is not None:
                set_rng_state(saved_rng)
            return iterator

        loader._get_iterator = skipping


def _load_when_fit_resumes(trainer: pl.Trainer, checkpoint: dict[str, Any], where: str) -> None:
    """Have this `fit` load `checkpoint` where it would load the file `ckpt_path=` names — unless a
    `ckpt_path` was given, which wins. Lightning has no public hook for a checkpoint already in memory,
    so its connector's `resume_start` is wrapped for the one call."""
    connector = trainer._checkpoint_connector
    original = connector.resume_start

    def resume_start(checkpoint_path: Any = None, weights_only: Any = None) -> None:
        connector.resume_start = original  # type: ignore[method-assign]
        if checkpoint_path:
            original(checkpoint_path, weights_only=weights_only)
            return
        connector._ckpt_path = where
        connector._loaded_checkpoint = checkpoint

    connector.resume_start = resume_start  # type: ignore[method-assign]


def _last_batch(trainer: pl.Trainer, index: int) -> bool:
    """Whether batch `index` is the epoch's last (Lightning knows how many an epoch has, when it can)."""
    total = trainer.num_training_batches
    return isinstance(total, int) and index + 1 >= total
