"""The data position of the canonical DDP loop: a `DataLoader` over a `DistributedSampler`, as the
PyTorch DDP tutorial writes it (or torchdata's `StatefulDataLoader` in its place) —

    loader = DataLoader(dataset, batch_size=32, sampler=DistributedSampler(dataset))
    mgr = CheckpointManager(objects={"model": model, "optimizer": opt, "data": loader}, ...)
    for epoch in range(mgr.restore_or_initialize(), EPOCHS):
        loader.sampler.set_epoch(epoch)
        for batch, (x, y) in enumerate(loader, start=mgr.first_batch(epoch)):
            ...

The sampler has no `state_dict` (a StatefulDataLoader's counts this rank's samples only), but the
order is a function of (seed, epoch, dataset length, world size) and the position is the batch the
loop saved at — whatever worker processes fetched ahead. So a save records the *global* count of the
epoch's samples consumed — every rank took `batch × batch_size` of them, interleaved: the first
`batch × batch_size × world` positions of the epoch's padded permutation — and a resume makes the
resumed epoch's first iterator yield, on each rank, the rest of that same global order from the
count: `world` ranks then may be any number (resharded: no sample twice, none skipped, beyond the
padding `DistributedSampler` itself adds to make the ranks even). Later epochs are the sampler's own.
The loop's batch numbers go on from the position resumed from (positions stay in order), so a save
later in that epoch counts from the resumed count, `world` samples a batch per rank from there.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.distributed import DistributedSampler

from ckptstore import Position

__all__ = ["DistributedLoaderPosition", "is_distributed_loader"]


def is_distributed_loader(obj: Any) -> bool:
    """A DataLoader — torch's, or torchdata's StatefulDataLoader, whose own state counts this rank's
    samples only and so cannot follow a new world size — drawing batches from a DistributedSampler."""
    return isinstance(obj, DataLoader) and isinstance(obj.sampler, DistributedSampler) and obj.batch_sampler is not None


def epoch_order(sampler: DistributedSampler, epoch: int, world: int) -> torch.Tensor:
    """The epoch's global order of sample indices as `DistributedSampler` draws it for `world` ranks:
    the permutation of (seed + epoch), padded (or cut, with drop_last) to a multiple of `world`."""
    length = len(sampler.dataset)  # type: ignore[arg-type]
    if sampler.shuffle:
        generator = torch.Generator()
        generator.manual_seed(sampler.seed + epoch)
        order = torch.randperm(length, generator=generator)
    else:
        order = torch.arange(length)
    if sampler.drop_last:
        return order[: length // world * world]
    total = math.ceil(length / world) * world
    return order.repeat(math.ceil(total / length))[:total] if total > length else order


def rest_of_epoch(sampler: DistributedSampler, epoch: int, consumed: int) -> list[int]:
    """This rank's indices of `epoch` after the first `consumed` of the global order: the rest,
    shared round-robin over the ranks now, its tail padded (or cut, with drop_last) so that every
    rank gets as many."""
    world, rank = sampler.num_replicas, sampler.rank
    rest = epoch_order(sampler, epoch, world)[consumed:]
    uneven = len(rest) % world
    if uneven:
        rest = rest[: len(rest) - uneven] if sampler.drop_last else torch.cat([rest, rest[: world - uneven]])
    return rest[rank::world].tolist()


class _ResumedEpoch(Sampler[int]):
    """Stands in for the DistributedSampler inside the loader's batch sampler for one iterator: the
    resumed epoch's rest from the saved global count, with the global RNG put back as restored (the
    DataLoader drew its workers' base seed from it when it made the iterator: a draw the
    uninterrupted run made before the save)."""

    def __init__(self, owner: DistributedLoaderPosition, epoch: int, consumed: int):
        self.owner, self.epoch, self.consumed = owner, epoch, consumed

    def __len__(self) -> int:
        return len(self.owner.sampler)

    def __iter__(self) -> Iterator[int]:
        sampler = self.owner.sampler
        self.owner.batch_sampler.sampler = sampler  # one iterator: the sampler's own from now on
        if sampler.epoch != self.epoch:  # the loop went on to another epoch: nothing is skipped there
            yield from sampler
            return
        if self.owner.rng_on_start is not None:
            torch.set_rng_state(self.owner.rng_on_start)
        yield from rest_of_epoch(sampler, self.epoch, self.consumed)


class DistributedLoaderPosition:
    """What `objects={"data": loader}` saves and restores for a DataLoader over a DistributedSampler
    (see the module docstring): `state_dict` at the position a save captures."""

    def __init__(self, loader: DataLoader):
        self.loader = loader
        self.sampler: DistributedSampler = loader.sampler  # type: ignore[assignment]
        self.batch_sampler: Any = loader.batch_sampler
        self.position: Position | None = None  # the position being saved (set by the manager)
        self.rng_on_start: torch.Tensor | None = None  # the global RNG as restored (`restore_rng_when_iterated`)
        self.resumed: tuple[int, int, int] | None = None  # (epoch, batch, global count) of the position resumed from
        self.sets_epoch = False  # whether the loop is known to call `set_epoch` each epoch (Lightning does)
        self._order: tuple[int, torch.Tensor] | None = None  # an epoch's permutation, kept for the next save's

    def permutation(self, epoch: int) -> torch.Tensor:
        """The sampler's permutation of `epoch`, before any padding for the ranks (drawn once an epoch)."""
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(self.sampler, epoch, 1))
        return self._order[1]

    def state_dict(self) -> dict[str, Any]:
        """The sampler's settings and the global count consumed of the epoch the position is in."""
        position, sampler = self.position, self.sampler
        if position is None:
            epoch, consumed = sampler.epoch, 0
        elif position.batch is None:
            epoch, consumed = position.epoch + 1, 0  # an epoch's end: the next one starts from its first sample
        else:
            epoch, consumed = position.epoch, self._consumed(position.epoch, position.batch)
        return {
            "epoch": epoch,
            "consumed": consumed,
            "batch": None if position is None else position.batch,
            "world": sampler.num_replicas,
            "seed": sampler.seed,
            "shuffle": sampler.shuffle,
            "drop_last": sampler.drop_last,
            "length": len(sampler.dataset),  # type: ignore[arg-type]
            "batch_size": self.loader.batch_size,
            "sampler_epoch": sampler.epoch,  # as the loop last set it (`set_epoch`): what the next epoch draws
        }

    def _consumed(self, epoch: int, batch: int) -> int:
        """The global count of `epoch`'s samples trained once the loop is at `batch`: from the resumed
        position's count when the loop resumed in that epoch (on this world size or another)."""
        per_batch = (self.loader.batch_size or 1) * self.sampler.num_replicas
        resumed = self.resumed
        if resumed is not None and resumed[0] == epoch and batch >= resumed[1]:
            return resumed[2] + (batch - resumed[1]) * per_batch
        return batch * per_batch

    def restore_rng_when_iterated(self, rng: torch.Tensor) -> None:
        """Set the global torch RNG to `rng` when the resumed epoch's iterator starts (`_ResumedEpoch`)."""
        self.rng_on_start = rng

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the saved epoch from its global count, on this world size, when the loop next
        iterates the loader in that epoch. A dataset, seed or shuffle that changed is refused: the
        count would mean other samples."""
        sampler = self.sampler
        saved = (state["seed"], state["shuffle"], state["length"])
        now = (sampler.seed, sampler.shuffle, len(sampler.dataset))  # type: ignore[arg-type]
        if saved != now:
            raise ValueError(f"the DistributedSampler changed: saved seed/shuffle/length {saved}, now {now}")
        if state["consumed"]:
            batch = state.get("batch")  # absent in older copies, saved when the count was batch × size × world
            if batch is None:
                batch = state["consumed"] // ((state["batch_size"] or 1) * state["world"])
            self.resumed = (state["epoch"], batch, state["consumed"])
            self.batch_sampler.sampler = _ResumedEpoch(self, state["epoch"], state["consumed"])
