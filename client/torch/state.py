"""PyTorch training state ⇄ named host arrays plus a JSON tree, exactly.

Every object's `state_dict()` (model, optimizer, scheduler, scaler, data loader, sampler, …) and the
random number generators are walked once: each tensor (and numpy array) becomes a named array
(`model/00003`), everything else — Python ints, floats, strings, None, tuples, dicts with integer
keys — stays in a JSON tree that says where each array goes back. Types that JSON would blur are
tagged (tuples, non-string dict keys, non-finite floats), so a state dict comes back equal, not
merely similar. Dtypes numpy lacks (bfloat16, float8) travel as same-width integers.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = [
    "flatten",
    "unflatten",
    "rng_state",
    "set_rng_state",
    "host_array",
    "host_views_are_live",
    "BITS",
    "UnsupportedStateError",
]

BITS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


class UnsupportedStateError(TypeError):
    """A state dict holds a value that cannot be saved exactly (names where it is)."""


def host_array(tensor: torch.Tensor) -> np.ndarray:
    value = tensor.detach()
    if value.layout != torch.strided:
        raise UnsupportedStateError(f"{value.layout} tensors are not supported")
    value = value.cpu().contiguous()
    return value.view(BITS[value.dtype]).numpy() if value.dtype in BITS else value.numpy()


def flatten(tree: Any, prefix: str, arrays: dict[str, np.ndarray], names: dict[str, str] | None = None) -> Any:
    """`tree` as JSON, its tensors and arrays moved into `arrays` under `prefix/NNNNN` in walk order
    (host views of the live values: copy them before training goes on); `names` gets each key's
    path in the tree as a person reads it (`optimizer['state'][0]['exp_avg']`)."""
    return _Flattener(prefix, arrays, names).walk(tree, "")


class _Flattener:
    def __init__(self, prefix: str, arrays: dict[str, np.ndarray], names: dict[str, str] | None):
        self.prefix, self.arrays, self.names, self.count = prefix, arrays, names, 0

    def _key(self, array: np.ndarray, where: str) -> str:
        key = f"{self.prefix}/{self.count:05d}"
        self.count += 1
        self.arrays[key] = array
        if self.names is not None:
            self.names[key] = f"{self.prefix}{where}"
        return key

    def walk(self, tree: Any, where: str) -> Any:
        if isinstance(tree, torch.Tensor):
            return {"__tensor__": self._key(host_array(tree), where), "dtype": str(tree.dtype).removeprefix("torch.")}
        if isinstance(tree, np.ndarray):
            return {"__ndarray__": self._key(np.ascontiguousarray(tree), where)}
        if isinstance(tree, bool) or tree is None or isinstance(tree, (int, str)):
            return tree
        if isinstance(tree, float):
            return tree if math.isfinite(tree) else {"__float__": repr(tree)}
        if isinstance(tree, np.generic):
            return {"__npscalar__": [str(tree.dtype), tree.item()]}
        if isinstance(tree, tuple):
            return {"__tuple__": [self.walk(v, f"{where}[{i}]") for i, v in enumerate(tree)]}
        if isinstance(tree, list):
            return [self.walk(v, f"{where}[{i}]") for i, v in enumerate(tree)]
        if isinstance(tree, Mapping):
            return {
                "__dict__": [[self.walk(k, f"{where} key"), self.walk(v, f"{where}[{k!r}]")] for k, v in tree.items()]
            }
        raise UnsupportedStateError(f"{self.prefix}{where}: {type(tree).__name__} values cannot be saved exactly")


def host_views_are_live(tree: Any) -> bool:
    """Whether `host_array` of every tensor in a (nested) state dict is a view of the tensor's own
    memory (CPU, strided, contiguous), so writing the view writes the tensor."""
    if isinstance(tree, torch.Tensor):
        return tree.device.type == "cpu" and tree.layout == torch.strided and tree.is_contiguous()
    if isinstance(tree, Mapping):
        return all(host_views_are_live(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return all(host_views_are_live(v) for v in tree)
    return True


def unflatten(tree: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    """The value `flatten` took apart, tensors rebuilt on the CPU from `arrays` (their buffers are used
    where they are writable; `load_state_dict` moves them to where the objects live)."""
    if isinstance(tree, list):
        return [unflatten(v, arrays) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if "__tensor__" in tree:
        dtype = getattr(torch, tree["dtype"])
        tensor = _tensor(arrays[tree["__tensor__"]])
        return tensor.view(dtype) if dtype in BITS else tensor
    if "__ndarray__" in tree:
        return np.array(arrays[tree["__ndarray__"]])
    if "__float__" in tree:
        return float(tree["__float__"])
    if "__npscalar__" in tree:
        dtype, value = tree["__npscalar__"]
        return np.dtype(dtype).type(value)
    if "__tuple__" in tree:
        return tuple(unflatten(v, arrays) for v in tree["__tuple__"])
    return {unflatten(k, arrays): unflatten(v, arrays) for k, v in tree["__dict__"]}


def _tensor(array: np.ndarray) -> torch.Tensor:
    if not array.flags.writeable:
        try:
            view = array.view()
            view.flags.writeable = True  # our own read buffers: safe to adopt
            array = view
        except ValueError:
            array = array.copy()
    return torch.from_numpy(array)


def rng_state() -> dict[str, Any]:
    """The random number generators a training step may draw from: torch (CPU, and every CUDA
    device when present), numpy's global generator and Python's `random`."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
