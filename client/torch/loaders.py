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

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

from ckptstore.client.torch.distributed import DistributedLoaderPosition
from ckptstore.client.torch.sampler import ResumableSampler, ResumableSamplerLoader

__all__ = [
    "is_loader",
    "generator_states",
    "set_generator_states",
    "replay_after_first_iterator",
    "data_fingerprint",
    "NEXT_INDICES",
]

NEXT_INDICES = 64  # how many of the next sample indices the data fingerprint hashes


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
        del loader._get_iterator  # the class's own from now on
        iterator = make_iterator()
        set_generator_states(loader, states)
        torch.set_rng_state(rng)
        return iterator

    loader._get_iterator = first_iterator


def _digest(indices: list[int]) -> str:
    return hashlib.sha256(repr(indices).encode()).hexdigest()[:16]


def _sampler_part(sampler: Any, state: Mapping[str, Any] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"sampler": type(sampler).__name__}
    if isinstance(sampler, ResumableSampler):
        part |= {"seed": sampler.seed, "shuffle": sampler.shuffle, "length": sampler.size}
        if state is not None:
            part["next"] = _digest(sampler.next_indices(state, NEXT_INDICES))
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
    generator = torch.Generator()
    generator.set_state(generator_state)
    order = torch.randperm(len(loader.sampler.data_source), generator=generator).tolist()
    return order[taken : taken + NEXT_INDICES]


def data_fingerprint(obj: Any, state: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What ckptstore can see of a data object's position — its type, sampler, batch size, dataset
    length, seed, and a hash of the next sample indices `state` (its state dict) leads to — or None
    when `obj` is not a data loader or sampler."""
    if isinstance(obj, ResumableSampler):
        return {"type": "ResumableSampler"} | _sampler_part(obj, state)
    if isinstance(obj, ResumableSamplerLoader):  # the loader's batch size, and its sampler's position
        return data_fingerprint(obj.loader, state)
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
    inner = obj.sampler
    sampler_state = None
    if isinstance(inner, ResumableSampler) and state is not None:
        sampler_state = _find_sampler_state(state)
    part |= _sampler_part(inner, sampler_state)
    if "next" not in part and state is not None and type(inner).__name__ == "RandomSampler":
        upcoming = _torchdata_next(obj, state)
        if upcoming is not None:
            part["next"] = _digest(upcoming)
    return part


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
