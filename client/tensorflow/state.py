"""Training state ⇄ named arrays, with keys that are stable across processes.

Keras variable paths are not stable (an earlier model shifts `dense` → `dense_3`), so keys come
from structure: the object's name in `objects` plus the variable's position in its `variables`
list (`model/00003`). The manifest metadata records each key's path, shape and dtype, so a
mismatched model is named precisely on restore. `model.variables` includes the RNG state of
dropout layers, which an exact resume needs.
"""

from __future__ import annotations

import ctypes
import logging
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptstore.deferred import VerifiedTensors
from ckptstore.format.shard import ALIGN

log = logging.getLogger("ckptstore.client")

__all__ = [
    "StateMismatchError",
    "RestoreReport",
    "collect_variables",
    "describe",
    "restore_arrays",
    "staging_layout",
    "host_views",
]


class StateMismatchError(ValueError):
    """The checkpoint does not fit the objects being restored (shape, dtype or count)."""


@dataclass
class RestoreReport:
    restored: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # objects whose structure changed: what and what to do

    @property
    def complete(self) -> bool:
        return not (self.mismatched or self.missing or self.unexpected)


def _variables_of(obj: Any) -> list[Any]:
    if hasattr(obj, "shape") and hasattr(obj, "assign"):
        return [obj]  # a single variable (tf.Variable, keras.Variable)
    variables = obj.variables  # models, layers, optimizers, tf.Module
    return list(variables() if callable(variables) else variables)


def collect_variables(objects: Mapping[str, Any]) -> dict[str, Any]:
    """Stable key → variable for every variable of every object (models, optimizers, variables)."""
    keyed: dict[str, Any] = {}
    for name, obj in objects.items():
        for index, variable in enumerate(_variables_of(obj)):
            keyed[f"{name}/{index:05d}"] = variable
    return keyed


def _path(variable: Any) -> str:
    return str(getattr(variable, "path", None) or getattr(variable, "name", "?"))


def _dtype(variable: Any) -> np.dtype:
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)

    dtype = getattr(variable, "dtype", None)
    dtype = getattr(dtype, "as_numpy_dtype", dtype)
    return np.dtype(dtype)


def describe(variables: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Manifest metadata: key → path, shape and dtype at save time."""
    return {key: {"path": _path(v), "shape": list(v.shape), "dtype": str(_dtype(v))} for key, v in variables.items()}


def restore_arrays(
    variables: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    *,
    strict: bool = True,
    saved: Mapping[str, dict[str, Any]] | None = None,
) -> RestoreReport:
    """Assign arrays to variables by key, after checking every shape and dtype.

    strict=True raises StateMismatchError naming each mismatch before assigning anything;
    strict=False assigns what matches and reports the rest.
    """
    report = RestoreReport()
    plan = []
    changed = _changed_objects(variables, arrays, saved or {})
    report.notes = list(changed.values())
    for key, variable in variables.items():
        if key.split("/", 1)[0] in changed:
            continue
        if key not in arrays:
            report.missing.append(f"{key} ({_path(variable)})")
            continue
        want_shape, want_dtype = tuple(variable.shape), _dtype(variable)
        shape, dtype = _spec(arrays, key)
        if shape != want_shape or dtype != want_dtype:
            was = (saved or {}).get(key, {}).get("path", "?")
            report.mismatched.append(
                f"{key}: variable {_path(variable)} is {want_shape} {want_dtype}, "
                f"checkpoint has {shape} {dtype} (saved from {was})"
            )
            continue
        plan.append((key, variable))
    report.unexpected = sorted(k for k in set(arrays) - set(variables) if k.split("/", 1)[0] not in changed)
    if strict and (changed or not report.complete):
        problems = report.notes + report.mismatched + [f"missing in checkpoint: {m}" for m in report.missing]
        problems += [f"not in the model: {u}" for u in report.unexpected]
        raise StateMismatchError("checkpoint does not fit: " + "; ".join(problems[:10]))
    deferred = arrays if isinstance(arrays, VerifiedTensors) else None
    in_place: dict[str, np.ndarray] = {}
    for key, variable in plan:
        target = _own_memory(variable) if deferred is not None else None
        if target is not None:
            in_place[key] = target
        else:
            variable.assign(_adopted(arrays[key]))
        report.restored.append(key)
    if deferred is not None and in_place:
        deferred.read_into(in_place)
    return report


def _spec(arrays: Mapping[str, np.ndarray], key: str) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of a checkpoint array, without reading a deferred one."""
    if isinstance(arrays, VerifiedTensors):
        return arrays.spec(key)
    array = arrays[key]
    return tuple(array.shape), array.dtype


def _own_memory(variable: Any) -> np.ndarray | None:
    """A writable byte array over the variable's own host memory, so a restore writes its value
    there instead of into new memory (3 GiB of fresh pages cost ~1.8 s to fault in here): only for
    TensorFlow and PyTorch tensors whose host view is the variable's memory (two reads give one
    address; a copy from a GPU, or TensorFlow's copy-on-read, would not). None elsewhere (JAX
    arrays are immutable): the caller assigns."""
    first, second = _live_tensor(variable), _live_tensor(variable)
    if type(first).__module__.split(".", 1)[0] not in ("tensorflow", "torch"):
        return None
    view, again = np.asarray(first), np.asarray(second)
    if view.ctypes.data != again.ctypes.data or not view.flags.c_contiguous or view.nbytes == 0:
        return None
    return np.ctypeslib.as_array((ctypes.c_uint8 * view.nbytes).from_address(view.ctypes.data))


_ADOPTABLE = {np.dtype(t) for t in ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8")}


def _adopted(array: np.ndarray) -> Any:
    """The value to assign: for TensorFlow, a tensor that adopts the verified read buffer through
    DLPack (no copy: assigning 3 GiB took 1.2-1.5 s, all of it numpy→tensor copies) where the buffer
    is writable and 64-byte aligned (TensorFlow aborts the process on misaligned adopted buffers);
    else the array itself, which the framework copies."""
    tf = sys.modules.get("tensorflow")
    if tf is None or array.dtype not in _ADOPTABLE or not array.flags.c_contiguous or array.ctypes.data % ALIGN:
        return array
    writable = array.view()
    try:
        writable.flags.writeable = True  # refused where the buffer is read-only (bytes from object stores)
    except ValueError:
        return array
    return tf.experimental.dlpack.from_dlpack(writable.__dlpack__())


def _kind(described: list[tuple[str, tuple[int, ...]]]) -> tuple[str, list[str]]:
    """(the owner named in variable paths, e.g. `adam`, and the kinds of its per-weight slots, e.g.
    momentum, velocity: the last word of each non-scalar variable's name)."""
    # `dense_3` and `dense` are one owner: Keras numbers auto-generated names per process.
    owners = sorted({re.sub(r"_\d+$", "", path.split("/", 1)[0]) for path, _ in described if "/" in path}) or ["?"]
    slots = sorted({path.rsplit("_", 1)[-1] for path, shape in described if shape and "_" in path.rsplit("/", 1)[-1]})
    return "/".join(owners), slots


def _changed_objects(
    variables: Mapping[str, Any], arrays: Mapping[str, np.ndarray], saved: Mapping[str, dict[str, Any]]
) -> dict[str, str]:
    """Objects whose number of variables differs from the checkpoint's (an optimizer swapped for
    another, say): name → what changed and what to do. Their variables are never assigned piecemeal."""
    changed = {}
    for name in sorted({key.split("/", 1)[0] for key in variables}):
        now = [key for key in variables if key.startswith(name + "/")]
        then = [key for key in arrays if key.startswith(name + "/")]
        then_owner, then_slots = _kind([(str(saved.get(k, {}).get("path", "")), _spec(arrays, k)[0]) for k in then])
        now_owner, now_slots = _kind([(_path(variables[k]), tuple(variables[k].shape)) for k in now])
        if len(now) == len(then):
            if saved and then_owner != now_owner and "?" not in (then_owner, now_owner):
                log.warning(
                    "%s: the checkpoint was saved from %s, restoring into %s by position (shapes are checked)",
                    name,
                    then_owner,
                    now_owner,
                )
            continue
        changed[name] = (
            f"{name}: the checkpoint has {len(then)} variables from {then_owner} (slots: {', '.join(then_slots) or 'none'}), "
            f"{name} has {len(now)} from {now_owner} (slots: {', '.join(now_slots) or 'none'}); restore with "
            f"strict=False to load everything else and start {name} afresh"
        )
    return changed


def _live_tensor(variable: Any) -> Any:
    """The framework tensor holding the variable's current value (the variable itself where none)."""
    value = getattr(variable, "value", None)
    tensor = value() if callable(value) else value
    if tensor is not None and hasattr(tensor, "read_value"):  # a Keras variable wrapping a tf.Variable
        tensor = tensor.read_value()
    if tensor is not None and hasattr(tensor, "detach"):  # Keras on PyTorch: a parameter that needs grad
        tensor = tensor.detach().cpu()
    return tensor if tensor is not None else variable


def _host_view(variable: Any) -> np.ndarray:
    """The variable's current value as a host array, without an extra copy where TF allows it."""
    return np.asarray(_live_tensor(variable))


def staging_layout(variables: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Key → (shape, dtype) of the host buffers `snapshot_arrays` will need (variables of fully known shape)."""
    layout = {key: (tuple(variable.shape), _dtype(variable)) for key, variable in variables.items()}
    return {key: (shape, dtype) for key, (shape, dtype) in layout.items() if None not in shape}


def host_views(variables: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Every variable's current value as a host array (a view, not a copy, where TF allows it)."""
    return {key: _host_view(variable) for key, variable in variables.items()}
