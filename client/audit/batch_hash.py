"""What the resume proof keeps of a batch a custom loop shows it (`LoopManager.observe_batch`): a hash
of its values — any nest of arrays (NumPy, TensorFlow, JAX, CPU torch) — taking at most HASHED values
of each array, evenly spaced through it, so its cost stays flat however large the batch."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["HASHED", "batch_hash"]

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
