"""What a data loader or sampler in `objects` needs, beyond its own `state_dict`, for a resume to be
exact — and what ckptstore can see of the data position (the fingerprint's data part).

Two draws happen when a loader's iterator is made, after the state a mid-epoch save captured:
torch's DataLoader draws its workers' base seed from the loader's generator (the global RNG when it
has none), and torchdata's shuffling sampler saves its generator as of the epoch's start and
replays that epoch's permutation on load. So after a restore the first iterator leaves the global
RNG one draw ahead, and the shuffling generator short of the base-seed draw the uninterrupted run
made: every later draw differs. ckptstore saves the generators' states as of the save and puts
them — and the restored global RNG — back right after the resumed loader's first iterator is made
(`replay_after_first_iterator`); a `ResumableSampler` used with a plain `DataLoader` does the same
when its resumed epoch starts (`ResumableSampler.restore_rng_when_iterated`).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data.dataloader import _BaseDataLoaderIter

from ckptstore.client.audit.proof import GLOBAL_ORDER
from ckptstore.client.torch.distributed import DistributedLoaderPosition
from ckptstore.client.torch.sampler import ResumableSampler, ResumableSamplerLoader

__all__ = [
    "is_loader",
    "generator_states",
    "set_generator_states",
    "replay_after_first_iterator",
    "data_fingerprint",
    "next_ids",
    "watch_first_draws",
    "record_batches",
    "DrawnBatches",
    "watch_every_iterator",
    "next_batches_ids",
    "NEXT_INDICES",
]

NEXT_INDICES = 64  # how many of the next sample ids a save records for the resume proof (per rank)
_LISTENERS = "_ckptstore_listeners"  # an iterator's attribute: who is told the ids of each batch it takes


def is_loader(obj: Any) -> bool:
    """A data loader whose iterator ckptstore can follow (torchdata's StatefulDataLoader and its kin)."""
    return hasattr(obj, "_get_iterator") and hasattr(obj, "sampler") and hasattr(obj, "batch_size")


def _generators(loader: Any) -> list[torch.Generator]:
    found: list[torch.Generator] = []
    for generator in (getattr(loader.sampler, "generator", None), getattr(loader, "generator", None)):
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def generator_states(loader: Any) -> list[torch.Tensor]:
    """The states, now, of the generators the loader and its sampler draw from (sampler's first)."""
    return [generator.get_state() for generator in _generators(loader)]


def set_generator_states(loader: Any, states: list[torch.Tensor]) -> bool:
    """Set the loader's generators (sampler's first) to `states`; False, changing nothing, when a
    generator was given or taken away since they were saved (the audit names it)."""
    generators = _generators(loader)
    if len(generators) != len(states):
        return False
    for generator, state in zip(generators, states, strict=True):
        generator.set_state(state)
    return True


def replay_after_first_iterator(loader: Any, states: list[torch.Tensor], rng: torch.Tensor) -> None:
    """Once the loader's next iterator is made (the restored position replayed), set its generators
    to `states` and the global torch RNG to `rng`: as the uninterrupted run had them at the save."""
    if len(_generators(loader)) != len(states):
        return  # its own state is all there is
    make_iterator = loader._get_iterator

    def first_iterator() -> Any:
        loader.__dict__.pop("_get_iterator", None)  # the class's own from now on
        iterator = make_iterator()
        set_generator_states(loader, states)
        torch.set_rng_state(rng)
        return iterator

    loader._get_iterator = first_iterator


def _sampler_part(sampler: Any) -> dict[str, Any]:
    part: dict[str, Any] = {"sampler": type(sampler).__name__}
    if isinstance(sampler, ResumableSampler):
        part |= {"seed": sampler.seed, "shuffle": sampler.shuffle, "length": sampler.size}
    elif hasattr(sampler, "data_source"):
        part["length"] = len(sampler.data_source)
    return part


def _torchdata_next(loader: Any, state: Mapping[str, Any]) -> list[int] | None:
    """The next indices a StatefulDataLoader with torchdata's RandomSampler would take from `state`
    (a single-process snapshot), drawn from a copy of the saved generator: nothing live changes."""
    try:
        snapshot = state["_snapshot"]["_main_snapshot"] if "_snapshot" in state else state
        iterator = snapshot["_sampler_iter_state"]
        sampler_state = iterator.get("sampler_iter_state", iterator)
        generator_state, taken = sampler_state["generator"], sampler_state["yielded"]
    except (KeyError, TypeError):
        return None
    length = len(loader.sampler.data_source)
    if taken >= length:  # the epoch is over: the next one's order is drawn as its iterator is made
        return None
    generator = torch.Generator()
    generator.set_state(generator_state)
    order = torch.randperm(length, generator=generator).tolist()
    return order[taken : taken + NEXT_INDICES]


def data_fingerprint(obj: Any) -> dict[str, Any] | None:
    """What a data object declares — its type, sampler, batch size, dataset length, seed — or None
    when `obj` is not a data loader or sampler."""
    if isinstance(obj, ResumableSampler):
        return {"type": "ResumableSampler"} | _sampler_part(obj)
    if isinstance(obj, ResumableSamplerLoader):  # the loader's batch size, and its sampler's settings
        return data_fingerprint(obj.loader)
    if isinstance(obj, DistributedLoaderPosition):  # the world size may change: resharded, not drift
        sampler = obj.sampler
        return {
            "type": "DataLoader",
            "sampler": "DistributedSampler",
            "batch_size": obj.loader.batch_size,
            "length": len(sampler.dataset),  # type: ignore[arg-type]
            "seed": sampler.seed,
            "shuffle": sampler.shuffle,
            "workers": obj.loader.num_workers,
            "reshards": True,
        }
    if not is_loader(obj):
        return None
    part = {"type": type(obj).__name__, "batch_size": obj.batch_size, "workers": getattr(obj, "num_workers", 0)}
    part["generators"] = len(_generators(obj))
    if hasattr(obj.dataset, "__len__"):
        part["length"] = len(obj.dataset)
    return part | _sampler_part(obj.sampler)


def next_ids(obj: Any, state: Mapping[str, Any]) -> list[int] | dict[str, list[int]] | None:
    """The ids of the samples the data object would hand out next from `state` (its state dict, as
    saved) — this rank's, or a DataLoader over a DistributedSampler's in the epoch's global order
    ({GLOBAL_ORDER: ids}: any world size takes its share) — or None where ckptstore cannot tell."""
    if isinstance(obj, (ResumableSampler, ResumableSamplerLoader)):
        return (
            obj.sampler.next_indices(state, NEXT_INDICES)
            if isinstance(obj, ResumableSamplerLoader)
            else (obj.next_indices(state, NEXT_INDICES))
        )
    if isinstance(obj, DistributedLoaderPosition):
        epoch, consumed = state["epoch"], state["consumed"]
        if not consumed and obj.position is not None and obj.position.batch is None:
            # An epoch's end: the next epoch's order is the one the loop sets (`set_epoch`) — the next
            # epoch's where it set this one's; epoch 0's where it never sets any; else it cannot be told.
            set_to, ended = state.get("sampler_epoch"), obj.position.epoch
            if obj.sets_epoch or (set_to == ended and ended > 0):
                epoch = ended + 1
            elif set_to == 0 and ended > 0:
                epoch = 0
            else:
                return None
        order = obj.permutation(epoch)
        return {GLOBAL_ORDER: order[consumed : consumed + NEXT_INDICES * state["world"]].tolist()}
    if is_loader(obj) and type(obj.sampler).__name__ == "RandomSampler":
        return _torchdata_next(obj, state)
    if is_loader(obj) and isinstance(obj.sampler, ResumableSampler):
        sampler_state = _find_sampler_state(state)
        return None if sampler_state is None else obj.sampler.next_indices(sampler_state, NEXT_INDICES)
    return None


def watch_first_draws(
    obj: Any, report: Callable[[Sequence[int]], None], remade: Callable[[], None] | None = None
) -> bool:
    """Make the data object `report` the ids it hands out, from the next iterator made, until
    NEXT_INDICES are reported (`ResumeProof.drawn`); False when it cannot be watched. A loader's
    batches are reported as its iterator takes them from the sampler — in the main process, before
    any worker fetches them, so before they train. `remade` is told when the loader makes another
    iterator after ids were reported (a loop that drew once, then began again: what trains may not be
    what was seen)."""
    loader = obj.loader if isinstance(obj, (ResumableSamplerLoader, DistributedLoaderPosition)) else obj
    if isinstance(loader, ResumableSampler):
        loader.watch = _Reporter(report).ids
        return True
    if not is_loader(loader) or getattr(loader, "batch_sampler", None) is None:
        return False
    reporter = _Reporter(report)
    make_iterator = [loader._get_iterator]

    def watched_iterator() -> Any:
        loader.__dict__.pop("_get_iterator", None)
        if reporter.count and remade is not None:
            remade()
        iterator = reporting(make_iterator[0], reporter.ids, lambda: reporter.done)
        make_iterator[0] = loader._get_iterator  # the class's own from now on
        if not reporter.count:  # e.g. a restored iterator whose epoch is over: the loader makes another
            loader._get_iterator = watched_iterator  # type: ignore[method-assign]
        return iterator

    loader._get_iterator = watched_iterator  # type: ignore[method-assign]
    return True


def watch_every_iterator(report: Callable[[Sequence[int]], None]) -> Callable[[], None]:
    """Tell `report` the ids of each batch any loader's iterator takes (until NEXT_INDICES are told) —
    for a loader made where ckptstore cannot reach it (the Trainer's, made inside its loop); returns
    what stops it."""
    reporter, original = _Reporter(report), _BaseDataLoaderIter._next_index

    def taking(self: Any) -> Any:
        index = original(self)
        reporter.ids(index)
        return index

    _BaseDataLoaderIter._next_index = taking  # type: ignore[method-assign]

    def stop() -> None:
        if _BaseDataLoaderIter._next_index is taking:
            _BaseDataLoaderIter._next_index = original  # type: ignore[method-assign]

    return stop


def next_batches_ids(batch_sampler: Any, taken: int) -> list[int]:
    """The ids of the NEXT_INDICES samples a batch sampler — one whose order is a function of its
    epoch, re-iterated here — yields after its first `taken` batches. Never past its last batch: a
    sampler may count an iteration run to its end as an epoch (accelerate's seedable one does)."""
    upcoming: list[int] = []
    for batch in itertools.islice(iter(batch_sampler), taken, len(batch_sampler)):
        upcoming += [int(i) for i in batch]
        if len(upcoming) >= NEXT_INDICES:
            break
    return upcoming[:NEXT_INDICES]


class DrawnBatches:
    """The ids of the batches one iterator took, by their number in it — the last KEPT of them only
    (what is trained trails what is taken by the prefetched batches at most)."""

    KEPT = 64

    def __init__(self) -> None:
        self.count = 0
        self._last: collections.deque[list[int]] = collections.deque(maxlen=self.KEPT)

    def took(self, ids: Any) -> None:
        self._last.append([int(i) for i in ids])
        self.count += 1

    def batch(self, number: int) -> list[int] | None:
        """The ids of batch `number` (from 0), None when not taken yet or no longer kept."""
        age = self.count - 1 - number
        return self._last[-1 - age] if 0 <= age < len(self._last) else None


def record_batches(make_iterator: Callable[[], Any], drawn: DrawnBatches) -> Any:
    """Make a loader's iterator with `make_iterator`, `drawn` told the ids of each batch it takes."""
    return reporting(make_iterator, drawn.took, lambda: False)


def reporting(make_iterator: Callable[[], Any], report: Callable[[Any], None], done: Callable[[], bool]) -> Any:
    """Make a loader's iterator with `make_iterator`, `report` told the ids of each batch it takes from
    its sampler — in the main process, before a worker fetches them — until `done()`. Several may
    listen to one iterator (each is told each batch once)."""
    original = _BaseDataLoaderIter._next_index

    def taking(self: Any) -> Any:  # a multi-process iterator takes its first batches' ids while it is made
        index = original(self)
        if not done():
            report(index)
        return index

    _BaseDataLoaderIter._next_index = taking  # type: ignore[method-assign]
    try:
        iterator = make_iterator()
    finally:
        _BaseDataLoaderIter._next_index = original  # type: ignore[method-assign]
    listeners: list[tuple[Callable[[Any], None], Callable[[], bool]]] = iterator.__dict__.setdefault(_LISTENERS, [])
    listeners.append((report, done))
    if len(listeners) == 1:

        def next_index() -> Any:
            index = type(iterator)._next_index(iterator)  # its class's, whatever was patched while it was made
            for listener in list(listeners):
                if listener[1]():
                    listeners.remove(listener)
                else:
                    listener[0](index)
            if not listeners:
                del iterator._next_index
            return index

        iterator._next_index = next_index
    return iterator


class _Reporter:
    """Reports ids as they come, until NEXT_INDICES are reported."""

    def __init__(self, report: Callable[[Sequence[int]], None]):
        self.report, self.count = report, 0

    @property
    def done(self) -> bool:
        return self.count >= NEXT_INDICES

    def ids(self, ids: Any) -> None:
        if self.done:
            return
        batch = [int(i) for i in ids] if isinstance(ids, (list, tuple)) else [int(ids)]
        self.count += len(batch)
        self.report(batch)


def _find_sampler_state(state: Any) -> Mapping[str, Any] | None:
    """The ResumableSampler's own state inside a loader's state dict (wherever torchdata keeps it)."""
    if isinstance(state, Mapping):
        if {"seed", "shuffle", "size", "epoch", "taken"} <= set(state):
            return state
        for value in state.values():
            found = _find_sampler_state(value)
            if found is not None:
                return found
    return None
