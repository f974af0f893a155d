"""`CheckpointManager` for custom training loops (TF 2 / Keras 3 objects).

mgr = CheckpointManager(service=..., storage=..., job="gan",
                        objects={"model": model, "optimizer": opt}, max_to_keep=3)
start = mgr.restore_or_initialize()          # next epoch to run (0 on a fresh job)
for epoch in range(start, EPOCHS):
    train_one_epoch()
    mgr.save(epoch)                           # async by default; mgr.wait() blocks
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from client.manager import LoopManager
from client.options import CheckpointOptions
from client.state import (
    RestoreReport,
    collect_variables,
    describe,
    host_views,
    prepare_staging,
    restore_arrays,
    staging_layout,
)

__all__ = ["CheckpointManager"]


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
    """

    def __init__(self, *, objects: Mapping[str, Any], options: CheckpointOptions | None = None, **settings: Any):
        super().__init__(options=options, **settings)
        self.objects = dict(objects)
        self.restore_report: RestoreReport | None = None
        self._staging_warm_up: threading.Thread | None = None

    def _apply(self, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, Any]) -> None:
        with _strategy_scope(self.objects):
            _build_optimizers(self.objects)
            self.restore_report = restore_arrays(
                collect_variables(self.objects), arrays, strict=self.options.strict, saved=metadata.get("variables")
            )

    def _started(self) -> None:
        """With async saves, allocate the staging buffers on a thread while the first epoch trains."""
        if not (self.checkpointer.async_save and self.checkpointer.writes):
            return
        layout = staging_layout(collect_variables(self.objects))
        self._staging_warm_up = threading.Thread(
            target=prepare_staging, args=(layout, self._staging), name="ckptstore-staging", daemon=True
        )
        self._staging_warm_up.start()

    def _capture(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        if self._staging_warm_up is not None:
            self._staging_warm_up.join()
            self._staging_warm_up = None
        variables = collect_variables(self.objects)
        return host_views(variables), {"variables": describe(variables)}

    def __enter__(self) -> CheckpointManager:
        return self
