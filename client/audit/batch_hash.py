"""What the resume proof keeps of a batch it is shown on the host — by a custom loop
(`LoopManager.observe_batch`), or by Keras' `fit` on the torch and JAX backends (`FitBatches`): a
hash of its values — any nest of arrays (NumPy, TensorFlow, JAX, CPU torch) — taking at most HASHED
values of each array, evenly spaced through it, so its cost stays flat however large the batch."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = ["HASHED", "batch_hash", "FitBatches"]

HASHED = 4096  # values of each array a hash takes


def _leaves(batch: Any) -> list[Any]:
    if isinstance(batch, Mapping):
        return [leaf for key in sorted(batch, key=str) for leaf in _leaves(batch[key])]
    if isinstance(batch, (list, tuple)):
        return [leaf for item in batch for leaf in _leaves(item)]
    return [batch]


def batch_hash(batch: Any) -> int:
    """The hash of one batch (a signed 64-bit integer): equal batches hash equal, on any framework."""
    hasher = hashlib.blake2b(digest_size=8)
    for leaf in _leaves(batch):
        values = np.asarray(leaf)
        flat = values.reshape(-1)
        if flat.size > HASHED:
            flat = flat[np.linspace(0, flat.size - 1, HASHED).astype(np.int64)]
        hasher.update(f"{values.shape}{values.dtype.str}".encode())
        hasher.update(np.ascontiguousarray(flat).tobytes())
    return int.from_bytes(hasher.digest(), "little", signed=True)


class FitBatches:
    """The hash of the last batch Keras' `fit` trained (`last`) on the torch or JAX backend, whose train
    function gets its batches in Python (torch: a list of batches; JAX: an iterator it draws one from):
    the function is wrapped to keep a reference to the batch — hashed only when `last` is read, so a
    step costs nothing more. (The TensorFlow backend digests in its compiled step:
    client/tensorflow/batch_digest.py.)"""

    def __init__(self, model: Any, backend: str):
        self.model, self.backend = model, backend
        self._last: Any = None

    @staticmethod
    def available(model: Any, backend: str) -> bool:
        """Whether `fit`'s batches can be kept: torch (any steps_per_execution), JAX (one step a call)."""
        steps = int(getattr(model, "steps_per_execution", 1) or 1)
        return backend == "torch" or (backend == "jax" and steps == 1)

    def install(self) -> None:
        """Wrap `fit`'s train function (made now, as fit would) to keep each batch it trains."""
        self.model.make_train_function()
        original: Callable[..., Any] = self.model.train_function

        def keeping(*args: Any) -> Any:
            *state, data = args
            if self.backend == "jax":  # (state, iterator): the batch is drawn here and handed on
                self._last = next(data)
                return original(*state, iter([self._last]))
            self._last = data[-1]
            return original(*args)

        self.model.train_function = keeping

    def of(self, batch: Any) -> int:
        """The hash of one batch."""
        return batch_hash(batch)

    @property
    def last(self) -> int:
        """The hash of the batch trained last."""
        return batch_hash(self._last)
