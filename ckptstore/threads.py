"""Fan work out over a few threads — or none, when one item or one worker would do: starting a thread
costs about 0.4 ms here, and a small checkpoint's restore used to start several for one shard each."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["map_threads"]

T = TypeVar("T")
R = TypeVar("R")


def map_threads(fn: Callable[[T], R], items: Sequence[T], workers: int) -> list[R]:
    """`fn` over `items`, in order, on up to `workers` threads (in the calling thread for one item or
    one worker); the first exception raised propagates."""
    if workers <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        return list(pool.map(fn, items))
