"""Replica agreement off the training path (DDP, replicated state): what each rank hashes, when, and
how the writer gets the hashes (the comparison itself: ckptstore/agreement.py).

Model parameters and optimizer state change only in `optimizer.step()`. So at a save every rank but
the writer hashes the few tensors outside them (buffers, a scheduler's) at once, and the parameters
and optimizer state in the background — once the writer has captured its copy (it says so: reading
a gigabyte while the writer copies one slows its copy, which training waits for), while the next
step's forward and backward run; that next `optimizer.step()` waits for the hashing (a step
pre-hook), so what is hashed is the state as saved.
The hashes go to the writer over a process group of their own — DDP's collectives on the default
group never interleave with them — in the background on every rank; the writer's copy waits for
them before its manifest is written (a metadata value that is a Future), training does not.
Parameters or optimizer state changed outside `optimizer.step()` between a save and the next step
(by hand) would be hashed as changed: a false disagreement, never a missed one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from ckptstore.agreement import AGREEMENT_KEY, agreement_metadata, hashes, unchecked_metadata
from ckptstore.client.torch.fingerprint import is_data
from ckptstore.client.torch.state import flatten

__all__ = ["ReplicaComparison", "StepGuard"]

log = logging.getLogger("ckptstore.client")
GATHER_TIMEOUT = timedelta(minutes=5)  # a rank that died mid-save: the writer's copy then says "not compared"


def _step_owned(objects: Mapping[str, Any]) -> set[int]:
    """The memory of every tensor an optimizer among `objects` changes in its step: its parameters
    and its state."""
    owned: set[int] = set()
    for obj in objects.values():
        if isinstance(obj, torch.optim.Optimizer):
            owned |= {param.data_ptr() for group in obj.param_groups for param in group["params"]}
            owned |= {
                value.data_ptr()
                for state in obj.state.values()
                for value in state.values()
                if isinstance(value, torch.Tensor)
            }
    return owned


def _in_background(work: Callable[[], None]) -> Future[None]:
    """Run `work` on a daemon thread: a gather waiting for a rank that died never holds the process's
    exit (an executor's threads are joined at exit)."""
    done: Future[None] = Future()

    def run() -> None:
        try:
            work()
            done.set_result(None)
        except BaseException as exc:  # handed to whoever waits for it
            done.set_exception(exc)

    threading.Thread(target=run, name="ckptstore-agreement", daemon=True).start()
    return done


class StepGuard:
    """Holds every optimizer's next `step()` among `objects` while the tensors it changes are being
    hashed (a step pre-hook), and lets it go once they are."""

    def __init__(self, objects: Mapping[str, Any]):
        self._free = threading.Event()
        self._free.set()
        for obj in objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                obj.register_step_pre_hook(self._before_step)

    def _before_step(self, *_: Any) -> None:
        self._free.wait()

    def hold(self) -> None:
        self._free.clear()

    def release(self) -> None:
        self._free.set()


class ReplicaComparison:
    """One manager's comparisons, save after save (see the module docstring). Made at the first
    collective save, which every rank reaches together (it makes a process group)."""

    def __init__(self, objects: Mapping[str, Any], size: int, rank: int):
        import torch.distributed as dist

        self.objects, self.size, self.rank = objects, size, rank
        self.group = dist.new_group(backend="gloo", timeout=GATHER_TIMEOUT)
        self.pending: Future[Any] | None = None  # the previous save's hashing and gather
        self.guard = StepGuard(objects)

    def compare(self, *, captured: bool) -> dict[str, Any]:
        """This save's comparison: on the writer, `{AGREEMENT_KEY: Future}` — the copy's metadata once
        the other ranks' hashes are in (`{}` when it did not capture: it takes part, and drops them);
        on the other ranks `{}`, their hashes sent in the background."""
        self.wait()
        if self.rank == 0:
            agreement: Future[Any] = Future()
            self.pending = _in_background(lambda: self._receive(agreement))
            return {AGREEMENT_KEY: agreement} if captured else {}
        views, names = self._views(named=self.rank == 1)
        owned = _step_owned(self.objects)
        later = {key: view for key, view in views.items() if view.size and view.ctypes.data in owned}
        now = hashes({key: view for key, view in views.items() if key not in later})
        self.guard.hold()
        self.pending = _in_background(lambda: self._send(now, later, names))
        return {}

    def wait(self) -> None:
        """The previous save's comparison done (the collectives on the group stay in order)."""
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def close(self) -> None:
        self.wait()

    def _views(self, *, named: bool) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """Host views of every tensor of the model, optimizer and other non-data objects by its key in
        the checkpoint, and (`named`) each key's path as a person reads it."""
        views: dict[str, np.ndarray] = {}
        names: dict[str, str] = {}
        for name, obj in self.objects.items():
            if not is_data(obj):
                flatten(obj.state_dict(), name, views, names if named else None)
        return views, names

    def _send(self, now: dict[str, str], later: dict[str, np.ndarray], names: dict[str, str]) -> None:
        import torch.distributed as dist

        sent: tuple[dict[str, str], dict[str, str]] | str  # the hashes and names, or why there are none
        try:
            # After the writer's capture: reading the state at once would slow its copy (one memory bus).
            failed = self._collect(lambda: dist.broadcast_object_list([None], src=0, group=self.group))
            sent = (now | hashes(later), names) if failed is None else failed
        except Exception as exc:  # the writer waits for this rank's part: it gets "not compared"
            log.warning("ckptstore: rank %d could not hash its replica (%s): this save is not compared", self.rank, exc)
            sent = f"rank {self.rank} could not hash its state ({type(exc).__name__}: {exc})"
        finally:
            self.guard.release()
        self._collect(lambda: dist.gather_object(sent, None, dst=0, group=self.group))

    def _receive(self, agreement: Future[Any]) -> None:
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.size
        failed = self._collect(lambda: dist.broadcast_object_list([None], src=0, group=self.group))  # captured
        failed = self._collect(lambda: dist.gather_object(None, gathered, dst=0, group=self.group)) or failed
        others = gathered[1:]
        why = failed or next((ranked for ranked in others if isinstance(ranked, str)), None)
        if why is not None:
            agreement.set_result(unchecked_metadata(self.size, why)[AGREEMENT_KEY])
        else:
            agreement.set_result(agreement_metadata([ranked[0] for ranked in others], others[0][1])[AGREEMENT_KEY])

    def _collect(self, gather: Callable[[], object]) -> str | None:
        """Run one collective on the group; when it fails (a rank gone, say), why — said."""
        try:
            gather()
            return None
        except Exception as exc:
            log.warning("ckptstore: the replicas' hashes were not gathered (%s): this save is not compared", exc)
            return f"rank {self.rank}: the replicas' hashes were not gathered ({type(exc).__name__}: {exc})"
