"""The fingerprint of a PyTorch run (ckptstore.fingerprint): torch's version, the world, the seed,
each object's type and arrays (a module's state dict keys, shapes and dtypes; an optimizer's type,
parameter count and slot coverage) and each data object's position (client/torch/loaders.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ckptstore.client.torch.loaders import data_fingerprint

__all__ = ["fingerprint", "is_data"]


def is_data(obj: Any) -> bool:
    """A data loader or sampler: its fingerprint is its data position, not its arrays."""
    return data_fingerprint(obj) is not None


def _spec(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def _object_part(obj: Any, state: Mapping[str, Any]) -> dict[str, Any]:
    part: dict[str, Any] = {"type": type(obj).__name__}
    if hasattr(obj, "param_groups"):
        part["params"] = sum(len(group["params"]) for group in obj.param_groups)
        slots: dict[str, int] = {}
        for values in state.get("state", {}).values():
            for slot in values:
                slots[str(slot)] = slots.get(str(slot), 0) + 1
        part["slots"] = slots
    elif isinstance(state, Mapping) and state and all(isinstance(v, torch.Tensor) for v in state.values()):
        part["arrays"] = {str(key): _spec(value) for key, value in state.items()}
    return part


def fingerprint(
    objects: Mapping[str, Any],
    states: Mapping[str, Any],
    *,
    world: tuple[int, int],
    seed: int,
    rank_seeds: list[int] | None,
) -> dict[str, Any]:
    """The run as saved (or restored into): `states` holds the state dict of each model and
    optimizer (data objects declare their settings; where they lead next is the resume proof's)."""
    size, rank = world
    record: dict[str, Any] = {
        "framework": {"name": "torch", "versions": {"torch": torch.__version__, "numpy": np.__version__}},
        "world": {"size": size, "rank": rank},
        "seed": seed,
        "objects": {},
        "data": {},
    }
    for name, obj in objects.items():
        data = data_fingerprint(obj)
        if data is not None:
            record["data"][name] = data
            record["objects"][name] = {"type": type(obj).__name__}
        else:
            record["objects"][name] = _object_part(obj, states.get(name, {}))
    if rank_seeds is not None:  # every rank's RNG is saved (replicated state): their seeds too
        record["rng_ranks"], record["rank_seeds"] = len(rank_seeds), rank_seeds
    return record
