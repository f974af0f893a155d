"""`CheckpointManager` for custom training loops (TF 2 / Keras 3 objects).

batches = iter(dataset.repeat())             # one iterator for the whole run: its state is saved
mgr = CheckpointManager(service=..., storage=..., job="gan",
                        objects={"model": model, "optimizer": opt, "data": batches}, max_to_keep=3)
start = mgr.restore_or_initialize()          # next epoch to run (0 on a fresh job)
for epoch in range(start, EPOCHS):
    train_one_epoch(batches)                  # draws steps_per_epoch batches with next(batches)
    mgr.save(epoch)                           # async by default; mgr.wait() blocks

A tf.data iterator in `objects` is saved with its position, shuffle buffer and reshuffling seeds
(client/tensorflow/data.py), so a reshuffling pipeline resumes on the batches the uninterrupted run draws.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from ckptstore import Position
from ckptstore.client.audit.declared import declared_data
from ckptstore.client.audit.proof import PROOF_KEY, recorded
from ckptstore.client.engine.manager import LOOP, LoopManager
from ckptstore.client.engine.options import CheckpointOptions
from ckptstore.client.engine.staging import prepare_staging
from ckptstore.client.tensorflow import global_rng
from ckptstore.client.tensorflow.data import is_iterator, iterator_fingerprint, iterator_state, restore_iterator
from ckptstore.client.tensorflow.fingerprint import fingerprint
from ckptstore.client.tensorflow.state import (
    RestoreReport,
    StateMismatchError,
    collect_variables,
    describe,
    host_views,
    restore_arrays,
    staging_layout,
)
from ckptstore.fingerprint import FINGERPRINT_KEY

__all__ = ["CheckpointManager"]

ITERATOR = "iterator"  # the array a tf.data iterator's state is saved as (`<name>/iterator`)
RNG, EPOCH_RNG = (
    "rng",
    "rng_epoch_start",
)  # the global RNGs (client/tensorflow/global_rng.py) now, and as the epoch began
DATA_ITERATIONS = "data_iterations"  # the iterators Keras' fit had made of its dataset (client/keras.py)


def _build_optimizers(objects: Mapping[str, Any]) -> None:
    """Create optimizer slot variables before restore (Keras builds them lazily on the first step)."""
    models = [o for o in objects.values() if hasattr(o, "trainable_variables") and hasattr(o, "layers")]
    for obj in objects.values():
        if hasattr(obj, "build") and hasattr(obj, "iterations") and not getattr(obj, "built", True) and models:
            obj.build(models[0].trainable_variables)


def _strategy_scope(objects: Mapping[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """The distribution strategy scope the objects were made in (building optimizer slots and
    assigning need it under MultiWorkerMirroredStrategy), or a no-op where there is none or it is on."""
    for obj in objects.values():
        strategy = getattr(obj, "distribute_strategy", None)
        if strategy is not None and hasattr(strategy, "scope"):
            tf = sys.modules.get("tensorflow")
            if tf is not None and tf.distribute.has_strategy():
                return contextlib.nullcontext()
            return strategy.scope()
    return contextlib.nullcontext()


class CheckpointManager(LoopManager):
    """Save and restore `objects` (models, optimizers, variables) every epoch, through ckptstore.

    Options are `CheckpointOptions`' (storage, service, job, node, max_to_keep, async_save,
    on_error, strict, …), each defaulting to its CKPTSTORE_* variable where it has one.
    `strict=False` restores what matches and reports the rest in `restore_report`.
    `data`: for a loop that picks its batches from (epoch, batch) — TF's MultiWorkerMirroredStrategy
    tutorial loop, a dataset indexed by step — how it does (`seed`, `batch_size`, `length`, `shuffle`):
    recorded with every save and compared at every resume, as a tf.data iterator in `objects` is.
    A loop shows the resume proof its batches with `observe_batch(batch)`: a resume is `exact` only
    once its first batch is the one the saved run trained after the save; without them it is
    `unverified`, never `exact` (client/audit/proof.py).
    """

    def __init__(
        self,
        *,
        objects: Mapping[str, Any],
        options: CheckpointOptions | None = None,
        data: Mapping[str, Any] | None = None,
        job: str | None = None,
        storage: str | None = None,
        service: str | list[str] | None = None,
        local_storage: str | None = None,
        **settings: Any,
    ):
        super().__init__(
            options=options, job=job, storage=storage, service=service, local_storage=local_storage, **settings
        )
        self.objects = dict(objects)
        self._declared_data = declared_data("tf loop", data)
        self.data: dict[str, dict[str, Any]] = {}  # data positions a wrapper describes (the Keras fit's steps)
        self.epoch_rng: dict[str, Any] | None = None  # the global RNGs as the epoch began (set by the Keras callback)
        self.restored_epoch_rng: dict[str, Any] | None = None  # the same, of the checkpoint restored
        self.data_iterations: int | None = None  # iterators of fit's dataset made before the data saved (Keras)
        self.restored_data_iterations: int | None = None  # the same, of the checkpoint restored
        self.restore_report: RestoreReport | None = None
        # What the next save records for the resume proof (client/audit/proof.py): the next step's counters
        # and what the data objects in `watched_data` lead to (Keras' callback sets them).
        self.next_counters: dict[str, int | None] = {}
        self.next_data: dict[str, Any] = {}
        self.watched_data: set[str] = set()
        self.custom_loop = True  # a loop of the user's (Keras' callback: False), which shows its batches itself
        self._staging_warm_up: threading.Thread | None = None

    @property
    def _holders(self) -> dict[str, Any]:
        """The objects that hold variables (every one but the tf.data iterators)."""
        return {name: obj for name, obj in self.objects.items() if not is_iterator(obj)}

    @property
    def _iterators(self) -> dict[str, Any]:
        return {name: obj for name, obj in self.objects.items() if is_iterator(obj)}

    def _apply(self, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, Any]) -> None:
        iterators = self._iterators
        missing = [name for name in iterators if f"{name}/{ITERATOR}" not in arrays]
        if missing and self.options.strict:
            raise StateMismatchError(f"the checkpoint has no state for the tf.data iterator(s) {missing}")
        with _strategy_scope(self.objects):
            _build_optimizers(self._holders)
            variables = arrays
            if iterators:  # their states are not variables (a verified local copy is then read, not adopted)
                variables = {key: value for key, value in arrays.items() if not key.endswith(f"/{ITERATOR}")}
            self.restore_report = restore_arrays(
                collect_variables(self._holders), variables, strict=self.options.strict, saved=metadata.get("variables")
            )
        for name, iterator in iterators.items():
            if name not in missing:
                restore_iterator(iterator, arrays[f"{name}/{ITERATOR}"])
        if RNG in metadata:
            global_rng.restore(metadata[RNG])
        self.restored_epoch_rng = metadata.get(EPOCH_RNG)
        self.restored_data_iterations = metadata.get(DATA_ITERATIONS)

    def _watchable(self) -> set[str]:
        return {LOOP} if self.custom_loop else set(self.watched_data)

    def _unobservable(self) -> str | None:
        if self.custom_loop or self.watched_data:
            return None
        return (
            "ckptstore does not see the batches Keras' fit trains under a tf.distribute strategy, or on JAX "
            "with steps_per_execution > 1"
        )

    def _live_fingerprint(self, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, Any]) -> dict[str, Any]:
        with _strategy_scope(self.objects):
            _build_optimizers(self._holders)
        return self._fingerprint(describe(collect_variables(self._holders)))

    def _fingerprint(self, described: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        data = {name: iterator_fingerprint(iterator) for name, iterator in self._iterators.items()} | self.data
        return fingerprint(self._holders, described, data | self._declared_data)

    def _started(self) -> None:
        """With async saves, allocate the staging buffers on a thread while the first epoch trains."""
        if not (self.checkpointer.options.async_save and self.checkpointer.writes):
            return
        layout = staging_layout(collect_variables(self._holders))
        self._staging_warm_up = threading.Thread(
            target=prepare_staging, args=(layout, self._staging), name="ckptstore-staging", daemon=True
        )
        self._staging_warm_up.start()

    def _capture(self, position: Position) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        if self._staging_warm_up is not None:
            self._staging_warm_up.join()
            self._staging_warm_up = None
        variables = collect_variables(self._holders)
        views = host_views(variables)
        for name, iterator in self._iterators.items():
            views[f"{name}/{ITERATOR}"] = iterator_state(iterator)
        described = describe(variables)
        if self.custom_loop:
            self._custom_loop_batches()
        metadata: dict[str, Any] = {
            "variables": described,
            FINGERPRINT_KEY: self._fingerprint(described)
            | {PROOF_KEY: recorded(counters=self.next_counters, next_ids=self.next_data)},
            RNG: global_rng.capture(),
        }
        if self.epoch_rng is not None:
            metadata[EPOCH_RNG] = self.epoch_rng
        if self.data_iterations is not None:
            metadata[DATA_ITERATIONS] = self.data_iterations
        return views, metadata

    def __enter__(self) -> CheckpointManager:
        return self
