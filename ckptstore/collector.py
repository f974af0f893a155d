"""Pausing Python's cyclic garbage collector over the parts of a save that build a few objects per
tensor. Ten thousand small tensors make tens of thousands of records, slots and dicts, enough to
set off full collections that walk the whole training process's heap: measured here, 55 of a
210 ms save (bench/RESULTS.md, many small tensors). Nothing of a save makes reference cycles, so
the pause frees nothing late; it covers only those phases, never I/O, so a long upload does not hold
the collector off. Nested and concurrent pauses (saves in several threads) end with the last one,
and a collector the user had turned off stays off."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_paused"]

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def collector_paused() -> Iterator[None]:
    """Hold the cyclic garbage collector off for the block."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
