"""Positions `(epoch, batch)`: where in training a checkpoint was taken, and their order.

`batch` is the number of batches of `epoch` already trained, or None for the end-of-epoch
checkpoint, which orders after every mid-epoch position of the same epoch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ckptstore.errors import InvalidNameError

__all__ = ["Position", "POSITION_LIMIT"]

POSITION_LIMIT = 10**10


def _check_count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidNameError(f"{what} must be an integer, got {value!r}")
    if not 0 <= value < POSITION_LIMIT:
        raise InvalidNameError(f"{what} must be in [0, 10^10), got {value}")
    return value


@functools.total_ordering
@dataclass(frozen=True, slots=True)
class Position:
    """A validated training position; end-of-epoch (batch None) sorts last within its epoch."""

    epoch: int
    batch: int | None = None

    def __post_init__(self) -> None:
        _check_count(self.epoch, "epoch")
        if self.batch is not None:
            _check_count(self.batch, "batch")

    @property
    def is_end_of_epoch(self) -> bool:
        return self.batch is None

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.epoch, POSITION_LIMIT if self.batch is None else self.batch)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Position):
            return NotImplemented
        return self.sort_key < other.sort_key

    def __str__(self) -> str:
        return f"epoch {self.epoch}" if self.batch is None else f"epoch {self.epoch} batch {self.batch}"
