"""`CheckpointManager` for custom training loops (TF 2 / Keras 3 objects).

mgr = CheckpointManager(service=..., storage=..., job="gan",
                        objects={"model": model, "optimizer": opt}, max_to_keep=3)
start = mgr.restore_or_initialize()          # next epoch to run (0 on a fresh job)
for epoch in range(start, EPOCHS):
    train_one_epoch()
    mgr.save(epoch)                           # async by default; mgr.wait() blocks
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from ckptstore import Position
from client.node import NodeCheckpointer, OnError
from client.preemption import PreemptionNotice
from client.state import (
    RestoreReport,
    collect_variables,
    describe,
    prepare_staging,
    restore_arrays,
    snapshot,
    staging_layout,
)

__all__ = ["CheckpointManager"]


def _build_optimizers(objects: Mapping[str, Any]) -> None:
    """Create optimizer slot variables before restore (Keras builds them lazily on the first step)."""
    models = [o for o in objects.values() if hasattr(o, "trainable_variables") and hasattr(o, "layers")]
    for obj in objects.values():
        if hasattr(obj, "build") and hasattr(obj, "iterations") and not getattr(obj, "built", True) and models:
            obj.build(models[0].trainable_variables)


class CheckpointManager:
    """Save and restore `objects` (models, optimizers, variables) every epoch, through ckptstore.

    `storage` defaults to CKPTSTORE_STORAGE and `service` to CKPTSTORE_URL (None: storage only).
    `strict=False` restores what matches and reports the rest in `restore_report`.
    """

    def __init__(
        self,
        *,
        job: str,
        objects: Mapping[str, Any],
        storage: str | None = None,
        service: str | None = None,
        node: str | None = None,
        max_to_keep: int | None = None,
        async_save: bool = True,
        on_error: OnError = "warn",
        strict: bool = True,
        storage_options: dict[str, Any] | None = None,
        token: str | None = None,
        preemption_budget_s: float = 30.0,
    ):
        storage = storage or os.environ.get("CKPTSTORE_STORAGE")
        if not storage:
            raise ValueError("no storage: pass storage= or set CKPTSTORE_STORAGE")
        self.objects = dict(objects)
        self.strict = strict
        self.checkpointer = NodeCheckpointer(
            job=job,
            storage=storage,
            service=service or os.environ.get("CKPTSTORE_URL"),
            node=node,
            storage_options=storage_options,
            token=token,
            on_error=on_error,
            async_save=async_save,
            keep_last=max_to_keep,
        )
        self.resume_position: Position | None = None
        self.restore_report: RestoreReport | None = None
        self.preemption = PreemptionNotice(preemption_budget_s)
        self._staging: dict[str, np.ndarray] = {}
        self._staging_warm_up: threading.Thread | None = None

    def restore_or_initialize(self) -> int:
        """Restore the last good position (if any) and return the next epoch to run (0 on a fresh job).

        After a mid-epoch position, `resume_position.batch` batches of that epoch are already trained.
        """
        self.preemption.install()
        self.resume_position = self.checkpointer.start()
        if self.resume_position is None:
            self._warm_up_staging()
            return 0
        _build_optimizers(self.objects)
        arrays = self.checkpointer.load(self.resume_position)
        saved = self.checkpointer.store.manifest(
            self.checkpointer.job, self.checkpointer.node, self.resume_position.epoch, batch=self.resume_position.batch
        ).metadata.get("variables")
        self.restore_report = restore_arrays(collect_variables(self.objects), arrays, strict=self.strict, saved=saved)
        self._warm_up_staging()
        position = self.resume_position
        return position.epoch + 1 if position.is_end_of_epoch else position.epoch

    def _warm_up_staging(self) -> None:
        """With async saves, allocate the staging buffers on a thread while the first epoch trains."""
        if not (self.checkpointer.async_save and self.checkpointer.writes):
            return
        layout = staging_layout(collect_variables(self.objects))
        self._staging_warm_up = threading.Thread(
            target=prepare_staging, args=(layout, self._staging), name="ckptstore-staging", daemon=True
        )
        self._staging_warm_up.start()

    def save(
        self,
        epoch: int,
        *,
        batch: int | None = None,
        step: int | None = None,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Checkpoint the objects at (epoch, batch); returns once they are copied to host memory."""
        if not self.checkpointer.writes:
            return
        self.checkpointer.wait()
        if self._staging_warm_up is not None:
            self._staging_warm_up.join()
            self._staging_warm_up = None
        variables = collect_variables(self.objects)
        arrays = snapshot(variables, self._staging)
        self.checkpointer.save(
            Position(epoch, batch),
            arrays,
            step=step,
            metrics=metrics,
            metadata={"variables": describe(variables), **(metadata or {})},
        )

    def checkpoint_if_preempted(self, epoch: int, batch: int) -> None:
        """Call between batches: after a SIGTERM, save (epoch, batch) and exit as SIGTERM would."""
        if not self.preemption.pending:
            return
        if self.preemption.within_budget:
            self.save(epoch, batch=batch)
            self.checkpointer.wait()
        self.close()
        self.preemption.exit()

    def wait(self) -> None:
        self.checkpointer.wait()

    def close(self) -> None:
        self.preemption.uninstall()
        self.checkpointer.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
