"""A `tf.data` iterator in a TF manager's `objects`: its state — the position in the pipeline, the
shuffle buffer, the reshuffling seeds — saved as bytes and put back, so a loop that draws its
batches from one iterator (`iter(dataset.repeat())`) resumes on exactly the batches the
uninterrupted run would have drawn, reshuffled or not."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["is_iterator", "iterator_state", "restore_iterator", "iterator_fingerprint"]


def is_iterator(obj: Any) -> bool:
    """A tf.data iterator of one process (`iter(dataset)`)."""
    return hasattr(obj, "_iterator_resource") and hasattr(obj, "element_spec")


def iterator_state(iterator: Any) -> np.ndarray:
    """The iterator's state as bytes (TF's own iterator checkpoint, serialized)."""
    tf = sys.modules["tensorflow"]
    state = tf.raw_ops.SerializeIterator(resource_handle=iterator._iterator_resource)
    return np.frombuffer(tf.io.serialize_tensor(state).numpy(), np.uint8)


def restore_iterator(iterator: Any, state: np.ndarray) -> None:
    """Put `iterator_state`'s bytes back into `iterator` (one over the same pipeline)."""
    tf = sys.modules["tensorflow"]
    serialized = tf.io.parse_tensor(np.asarray(state).tobytes(), tf.variant)
    tf.raw_ops.DeserializeIterator(resource_handle=iterator._iterator_resource, serialized=serialized)


def iterator_fingerprint(iterator: Any) -> dict[str, Any]:
    return {"type": "tf.data iterator", "elements": str(iterator.element_spec)[:500]}
