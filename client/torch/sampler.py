"""A sampler for the plain `DataLoader` that resumes mid-epoch: the same order of indices, from
where the restored state left off.

Each epoch's order is a permutation drawn from its own generator seeded with (seed, epoch), so
it never depends on what else drew random numbers; `state_dict` says which epoch it is in and how
many indices the loader has taken. Exact with `num_workers=0`; with worker processes the loader
takes indices ahead of the batches trained — put this sampler in torchdata's `StatefulDataLoader` there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

__all__ = ["ResumableSampler"]


class ResumableSampler(Sampler[int]):
    """Indices of `data_source` (or `range(n)`), shuffled per epoch with `seed` when `shuffle`."""

    def __init__(self, data_source: Sized | int, *, shuffle: bool = True, seed: int = 0):
        self.size = data_source if isinstance(data_source, int) else len(data_source)
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.taken = 0, 0

    def __len__(self) -> int:
        return self.size

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        generator = torch.Generator()
        generator.manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.size, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        while self.taken < self.size:
            index = order[self.taken]
            self.taken += 1
            yield index
        self.epoch, self.taken = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "shuffle": self.shuffle, "size": self.size, "epoch": self.epoch, "taken": self.taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["seed"], state["shuffle"], state["size"]) != (self.seed, self.shuffle, self.size):
            raise ValueError(
                f"the sampler changed: saved seed/shuffle/size {state['seed']}, {state['shuffle']}, {state['size']}; "
                f"now {self.seed}, {self.shuffle}, {self.size}"
            )
        self.epoch, self.taken = state["epoch"], state["taken"]
