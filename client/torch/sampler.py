"""A sampler for the plain `DataLoader` that resumes mid-epoch: the same order of indices, from
where the restored state left off.

Each epoch's order is a permutation drawn from its own generator seeded with (seed, epoch), so
it never depends on what else drew random numbers; `state_dict` says which epoch it is in and how
many indices the loader has taken. Exact with `num_workers=0`; with worker processes the loader
takes indices ahead of the batches trained — put this sampler in torchdata's `StatefulDataLoader` there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

__all__ = ["ResumableSampler", "ResumableSamplerLoader", "is_resumable_sampler_loader"]


class ResumableSampler(Sampler[int]):
    """Indices of `data_source` (or `range(n)`), shuffled per epoch with `seed` when `shuffle`."""

    def __init__(self, data_source: Sized | int, *, shuffle: bool = True, seed: int = 0):
        self.size = data_source if isinstance(data_source, int) else len(data_source)
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.taken = 0, 0
        self._rng_on_start: torch.Tensor | None = None
        self.watch: Callable[[int], None] | None = None  # told each index yielded (the resume proof watches)
        self._drawn: tuple[int, list[int]] | None = None  # the last epoch's order drawn: a save reads its next ids

    def __len__(self) -> int:
        return self.size

    def _order(self, epoch: int) -> list[int]:
        if self._drawn is not None and self._drawn[0] == epoch:
            return self._drawn[1]
        if not self.shuffle:
            order = list(range(self.size))
        else:
            generator = torch.Generator()
            generator.manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(self.size, generator=generator).tolist()
        self._drawn = (epoch, order)
        return order

    def next_indices(self, state: Mapping[str, Any], count: int) -> list[int]:
        """The next `count` indices this sampler would yield from `state` (nothing changes): the next
        epoch's first ones when its epoch is over."""
        epoch, taken = state["epoch"], state["taken"]
        if taken >= self.size:
            epoch, taken = epoch + 1, 0
        return self._order(epoch)[taken : taken + count]

    def restore_rng_when_iterated(self, rng: torch.Tensor) -> None:
        """Set the global torch RNG to `rng` when the resumed epoch starts: the DataLoader draws its
        base seed from it when it makes the iterator — a draw the uninterrupted run made before the
        save — so a mid-epoch resume would otherwise run one draw ahead."""
        if self.taken:
            self._rng_on_start = rng

    def __iter__(self) -> Iterator[int]:
        if self._rng_on_start is not None:
            torch.set_rng_state(self._rng_on_start)
            self._rng_on_start = None
        order = self._order(self.epoch)
        while self.taken < self.size:
            index = order[self.taken]
            self.taken += 1
            if self.watch is not None:
                self.watch(index)
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


def is_resumable_sampler_loader(obj: Any) -> bool:
    """A plain DataLoader (no state of its own) drawing from a ResumableSampler."""
    return isinstance(obj, DataLoader) and isinstance(obj.sampler, ResumableSampler) and not hasattr(obj, "state_dict")


class ResumableSamplerLoader:
    """What `objects={"data": loader}` keeps of a plain DataLoader over a ResumableSampler: the
    sampler's state — and, in the fingerprint, the loader's batch size, which the sampler alone
    cannot see (a resume with another batch size is named, not audited exact)."""

    def __init__(self, loader: DataLoader):
        self.loader = loader
        self.sampler: ResumableSampler = loader.sampler  # type: ignore[assignment]

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def restore_rng_when_iterated(self, rng: torch.Tensor) -> None:
        self.sampler.restore_rng_when_iterated(rng)
