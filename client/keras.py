"""`BackupAndRestore`: a drop-in for `keras.callbacks.BackupAndRestore`, backed by ckptstore.

Same arguments and defaults where they apply (`backup_dir`, `save_freq`, `delete_checkpoint`),
plus `service=`, `storage=`, `job=`, `node=`. It saves model variables (including dropout RNG
state), optimizer variables, the position and the process-wide RNGs (client/tensorflow/global_rng.py: the
torch and JAX backends shuffle `fit`'s arrays with them), never overwriting a checkpoint in place.

Exact mid-epoch resume with `save_freq=<int>`: `fit` reads `model._initial_epoch` right after
`on_train_begin` and looks `model.train_function` up for every call, so for the first resumed epoch
the callback installs a function that only advances the data iterator over the batches already
trained, then puts the original back — the RNGs as the epoch began first, so the epoch's order is
drawn again, and as saved once the batches are skipped. This is exact for in-memory arrays (shuffled
or not, on every backend) and for seeded `tf.data` pipelines, reshuffling ones included: a save keeps
how many iterators fit had made of its dataset, and a resume makes them again before the resumed
epoch's (`_DataIterations`; TensorFlow backend), so the pipeline draws the saved run's order.
"""

from __future__ import annotations

import logging
import sys
from types import FrameType
from typing import Any

import keras
import numpy as np

from ckptstore import Position
from ckptstore.client.audit.batch_hash import FitBatches
from ckptstore.client.audit.proof import BATCH_BEFORE, FIRST_BATCH
from ckptstore.client.engine.node import NodeCheckpointer
from ckptstore.client.engine.options import CheckpointOptions
from ckptstore.client.tensorflow import global_rng
from ckptstore.client.tensorflow.manager import CheckpointManager
from ckptstore.errors import CkptStoreError

__all__ = ["BackupAndRestore"]

log = logging.getLogger("ckptstore.client")


def _fit_epoch_iterator(model: keras.Model) -> Any:
    """The epoch iterator of the `fit` of `model` calling this callback: Keras gives callbacks no
    handle on the data, so the caller's frames are searched (None if not found)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_locals.get("self") is model and "epoch_iterator" in frame.f_locals:
            return frame.f_locals["epoch_iterator"]
        frame = frame.f_back
    return None


class _DataIterations:
    """Counts the iterators `fit` makes of its dataset. A `tf.data` pipeline that reshuffles each
    iteration (`shuffle()`'s default) draws its N-th iterator's order from its seed and N, and a
    restarted process starts again from N = 0; so each save keeps the count, and a resume makes the
    iterators the saved run had made before the resumed epoch's — on the TensorFlow backend, where
    making one reads no element — and the resumed epoch draws the saved run's order."""

    def __init__(self, epoch_iterator: Any):
        self.epoch_iterator, self.made = epoch_iterator, 0
        make = epoch_iterator._get_iterator

        def counted() -> Any:
            self.made += 1
            return make()

        epoch_iterator._get_iterator = counted

    def catch_up(self, saved: int) -> int:
        """Make the iterators the saved run had made by now; how many were made."""
        adapter = getattr(self.epoch_iterator, "data_adapter", None)
        behind = saved - self.made
        if behind <= 0 or type(adapter).__name__ != "TFDatasetAdapter":
            return 0
        if keras.backend.backend() != "tensorflow":
            log.warning(
                "ckptstore: fit's tf.data pipeline was iterated %d time(s) before the saved position; on the %s "
                "backend they cannot be made again without reading it: a pipeline that reshuffles each iteration "
                "draws another order than the saved run's",
                saved,
                keras.backend.backend(),
            )
            return 0
        for _ in range(behind):
            iter(self.epoch_iterator._get_iterator())
        return behind


def _fit_data(model: keras.Model, epoch_iterator: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The fit's data as the resume audit compares it: steps per epoch and, where fit's data adapter
    says, the batch size, the number of samples and the seed `keras.utils.set_random_seed` set (a
    pipeline's shuffling draws from it) — a change to any of them changes the batches, even where
    the steps per epoch stay the same."""
    part: dict[str, Any] = {"type": "keras fit", "steps": params.get("steps")}
    adapter: Any = getattr(epoch_iterator, "data_adapter", None)
    try:
        batch_size, batches = adapter.batch_size, adapter.num_batches
        partial = adapter.partial_batch_size if adapter.has_partial_batch else None
    except (AttributeError, TypeError, ValueError):
        batch_size = batches = partial = None
    if isinstance(batch_size, int) and batch_size > 0:
        part["batch_size"] = batch_size
        if isinstance(batches, int) and batches > 0:
            part["length"] = (batches - 1) * batch_size + (partial or batch_size)
    try:
        from keras.src.utils.rng_utils import get_random_seed
    except ImportError:
        return part
    seed = get_random_seed()
    if seed is not None:
        part["seed"] = seed
    return part


class BackupAndRestore(keras.callbacks.Callback):
    """Back up the training state every epoch (or every `save_freq` batches) and restore it on restart.

    `backup_dir` is the storage root when `storage` is not given (so `BackupAndRestore("/tmp/b")`
    works as Keras' does). `job` defaults to CKPTSTORE_JOB, else "keras"; `storage`, `service` and
    `local_storage` to their CKPTSTORE_* variables. The other options are `CheckpointOptions`' (`node=`,
    `token=`, `max_to_keep=`, `on_error=`, `resume_check=`, `fresh_start=`, …).
    With an int `save_freq` an end-of-epoch checkpoint is taken too, so a last good epoch exists.
    `save_freq="auto"` follows the interval the service recommends for the job (client/engine/cadence.py:
    every epoch end, and within epochs once the job has failed twice), `"continuous"` saves as soon as the previous save is
    committed; `save_every_seconds=S` saves once S seconds have passed (beside `save_freq`; with
    "auto", its upper bound).
    """

    def __init__(
        self,
        backup_dir: str | None = None,
        save_freq: str | int = "epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
        save_every_seconds: float | None = None,
        *,
        job: str | None = None,
        storage: str | None = None,
        service: str | list[str] | None = None,
        local_storage: str | None = None,
        **options: Any,
    ):
        super().__init__()
        self.save_freq = save_freq
        self.double_checkpoint = double_checkpoint  # every position is kept until retention removes it
        self.delete_checkpoint = delete_checkpoint
        # Objects are known only once fit() sets the model: filled in at on_train_begin.
        self.manager = CheckpointManager(
            objects={},
            options=CheckpointOptions.resolve(
                default_job="keras",
                job=job,
                storage=storage or backup_dir,
                service=service,
                local_storage=local_storage,
                **options,
            ),
            save_every=save_freq,  # checked by the cadence
            save_every_seconds=save_every_seconds,
        )
        self.manager.custom_loop = False  # fit's batches are seen by the callback, not shown by a loop
        self._epoch = 0
        self._skip_batches = 0
        self._rng_after_skip: dict[str, Any] | None = None
        self._iterations: _DataIterations | None = None
        self._skipping = False  # the batches trained before the restart are being skipped
        # What the proof sees of fit's batches: client/tensorflow/batch_digest.py's BatchDigests, or
        # client/audit/batch_hash.py's FitBatches on the torch and JAX backends, where fit's step allows.
        self._digests: Any = None
        self.manager.steps_reported = True  # on_train_batch_begin tells the resume proof

    # -- restore -------------------------------------------------------------------------------

    def _objects(self) -> dict[str, Any]:
        objects: dict[str, Any] = {"model": self.model}
        if self.model.optimizer is not None:
            objects["optimizer"] = self.model.optimizer
        return objects

    @property
    def checkpointer(self) -> NodeCheckpointer:
        return self.manager.checkpointer

    @property
    def resume_position(self) -> Position | None:
        return self.manager.resume_position

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self.model.built:
            raise ValueError("BackupAndRestore needs a built model: call it on a batch (or build it) before fit()")
        self.manager.objects = self._objects()
        epoch_iterator = _fit_epoch_iterator(self.model)
        self.manager.data = {"fit": _fit_data(self.model, epoch_iterator, self.params)}
        self._digests = None
        backend = keras.backend.backend()
        if epoch_iterator is not None and backend == "tensorflow":
            from ckptstore.client.tensorflow.batch_digest import BatchDigests

            if BatchDigests.available(self.model):
                self._digests = BatchDigests(self.model)
        elif epoch_iterator is not None and FitBatches.available(self.model, backend):
            self._digests = FitBatches(self.model, backend)
        if self._digests is not None:
            self._digests.install()
        self.manager.watched_data = {"fit"} if self._digests is not None else set()
        self._iterations = None if epoch_iterator is None else _DataIterations(epoch_iterator)
        self.model._initial_epoch = self.manager.restore_or_initialize()
        position = self.resume_position
        self._rng_after_skip = None
        if position is not None and position.batch is not None:
            self._skip_batches = position.batch
            if self.manager.restored_epoch_rng is not None:
                # The epoch's data order is drawn again from the RNGs as it began; the saved ones come
                # back once the batches already trained are skipped.
                self._rng_after_skip = global_rng.capture()
                global_rng.restore(self.manager.restored_epoch_rng)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        saved = self.manager.restored_data_iterations
        if self._iterations is not None and epoch == self.model._initial_epoch and saved is not None:
            made = self._iterations.catch_up(saved)
            if made:
                print(
                    f"ckptstore: fit's tf.data pipeline iterated {made} time(s), as the saved run had before this "
                    "epoch: its reshuffling order is the saved run's",
                    file=sys.stderr,
                    flush=True,
                )
        if self._iterations is not None:
            self.manager.data_iterations = self._iterations.made
        self.manager.epoch_rng = global_rng.capture()
        if self._skip_batches and self.resume_position is not None and epoch == self.resume_position.epoch:
            self._install_skipper(self._skip_batches)
        self._skip_batches = 0

    def _install_skipper(self, batches: int) -> None:
        """Make the next calls of train_function only advance the iterator over `batches` batches."""
        model = self.model
        per_call = int(getattr(model, "steps_per_execution", 1) or 1)
        calls, remainder = divmod(batches, per_call)
        if remainder:
            log.warning(
                "resume position %d is not a multiple of steps_per_execution=%d: the last %d batch(es) "
                "before it are trained again",
                batches,
                per_call,
                remainder,
            )
        if calls == 0:
            self._skipped()
            return
        print(
            f"ckptstore: epoch {self._epoch} (Keras' {self._epoch + 1}): its first {calls * per_call} batches were "
            "trained before the restart and are skipped (the progress bar counts them; the epoch's loss and "
            "metrics cover the batches after them)",
            file=sys.stderr,
            flush=True,
        )
        original = model.train_function
        left = [calls]
        self._skipping = True

        def skip(*args: Any) -> Any:
            """Each backend's train_function, doing nothing but advance the data: TensorFlow's takes
            the iterator, JAX's (state, iterator) and returns (logs, state), PyTorch's takes the
            batch its fit loop already drew."""
            *state, data = args
            drawn = None
            if hasattr(data, "get_next") or hasattr(data, "__next__"):
                for _ in range(per_call):
                    drawn = data.get_next() if hasattr(data, "get_next") else next(data)
            elif isinstance(data, (list, tuple)) and data:
                drawn = data[-1]  # torch's: the batches its loop drew for this call
            left[0] -= 1
            if left[0] == 0:
                model.train_function = original
                self._skipped()
                if not remainder:  # else the last batch drawn is not the one before the position
                    self._drawn_before_position(drawn)
            return ({}, state[0]) if state else {}

        model.train_function = skip

    def _drawn_before_position(self, batch: Any) -> None:
        """The last batch skipped — the one trained last before the save — to the resume proof."""
        proof = self.manager.proof
        if proof is not None and batch is not None and self._digests is not None:
            proof.drawn("fit", [self._digests.of(batch)])

    def _skipped(self) -> None:
        """The batches trained before the restart are skipped: the RNGs as saved come back."""
        self._skipping = False
        if self._rng_after_skip is not None:
            global_rng.restore(self._rng_after_skip)
            self._rng_after_skip = None

    # -- save ----------------------------------------------------------------------------------

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        proof = self.manager.proof
        if proof is None or proof.settled or self._skipping:
            return  # nothing to prove, or a batch trained before the restart being skipped
        proof.step({"epoch": self._epoch, "batch": batch, "iterations": self._iterations_done()})

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._digests is not None:
            self._first_batch_trained()
        done = batch + 1
        self.manager.checkpoint_if_preempted(self._epoch, done, requests=done != self.params.get("steps"))
        if self.save_freq == "epoch" and self.manager.cadence.every_seconds is None:
            return
        # At the epoch's last batch the end-of-epoch checkpoint follows right away.
        if done != self.params.get("steps") and self.manager.due(self._epoch, batch=done):
            self._save(Position(self._epoch, done), logs)

    def _first_batch_trained(self) -> None:
        """The first batch after an epoch-end save, or after a restore from one (its digest, kept by the
        step as it trained): recorded late for that save, or checked by the resume proof."""
        proof, late = self.manager.proof, self.manager.late
        if proof is not None and not proof.settled and "fit" in proof.awaiting_first_batch:
            proof.drawn("fit", [int(self._digests.last)])
        if late is not None and not late.kept:
            late.drew("fit", {FIRST_BATCH: int(self._digests.last)})

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self._iterations is not None:  # the next epoch's iterator comes after these
            self.manager.data_iterations = self._iterations.made
        if self.manager.due(epoch):
            self._save(Position(epoch, None), logs)

    def _save(self, position: Position, logs: dict | None) -> None:
        metrics = {k: float(v) for k, v in (logs or {}).items() if np.ndim(v) == 0 and np.isfinite(float(v))}
        step = self._iterations_done()
        after = Position(position.epoch + 1, 0) if position.batch is None else position
        self.manager.next_counters = {"epoch": after.epoch, "batch": after.batch, "iterations": step}
        mid_epoch = position.batch is not None and self._digests is not None
        self.manager.next_data = {"fit": {BATCH_BEFORE: self._digests.last}} if mid_epoch else {}
        # From an epoch's end the next order is drawn as the next iterator is made: recorded late.
        self.manager.unforetold = {"fit"} if position.batch is None and self._digests is not None else set()
        self.manager.save(position.epoch, batch=position.batch, step=step, metrics=metrics)

    def _iterations_done(self) -> int | None:
        """The optimizer's step count (Keras' `iterations`): the training steps taken."""
        optimizer = self.model.optimizer
        return int(keras.ops.convert_to_numpy(optimizer.iterations)) if optimizer is not None else None

    def on_train_end(self, logs: dict | None = None) -> None:
        self.manager.wait()
        if self.delete_checkpoint and self.checkpointer.writes:
            # Keras semantics: a finished fit removes its backup, so the next fit starts afresh. Cleanup
            # never fails a finished training: what cannot be deleted now stays, and is said.
            try:
                self.checkpointer.delete_all(cause="fit_finished", reason="fit finished")
            except (CkptStoreError, OSError) as exc:
                log.warning(
                    "the job's checkpoints could not all be deleted after fit (%s): they stay on storage "
                    "(`ckptstore gc` removes what retention allows); training's result is unaffected",
                    exc,
                )
        self.manager.close()
