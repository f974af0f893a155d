"""The resume proof's late record: what a run drew first after an epoch-end save whose next draws could
not be told at the save (client/audit/proof.py). The data objects report their first draw after the
save; once each has, the record is kept beside the copy (`NodeCheckpointer.record_drawn_next`)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from ckptstore import Position

__all__ = ["LateRecord"]


class LateRecord:
    """The first draws after the save at `position` of the data objects `names`, by the process (size,
    rank) `world`; handed to `keep` (position, record) once every one of them drew."""

    def __init__(
        self,
        position: Position,
        names: Collection[str],
        world: tuple[int, int],
        keep: Callable[[Position, Mapping[str, Any]], None],
    ):
        self.position, self.names, self.world, self._keep = position, set(names), world, keep
        self.drawn: dict[str, Any] = {}

    @property
    def kept(self) -> bool:
        return set(self.drawn) >= self.names

    def drew(self, name: str, first: Any) -> None:
        """The data object `name` drew `first` after the save (a batch's sample ids, or the digest of the
        batch trained: proof.FIRST_BATCH), the first time it reports; kept once every one has."""
        if self.kept or name not in self.names or name in self.drawn:
            return
        self.drawn[name] = first
        if self.kept:
            self._keep(self.position, {"world": list(self.world), "next": self.drawn})
