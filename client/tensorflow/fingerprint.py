"""The fingerprint of a TensorFlow / Keras run (ckptstore.fingerprint): the framework and versions
(Keras' backend too), the world under TF_CONFIG, each object's type and variables (by their place
in the object, as checkpoints key them — names change between processes — with shapes and dtypes), and the data position as far as ckptstore sees it (a tf.data iterator in objects; the
Keras callback adds the fit's steps per epoch)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["fingerprint"]


def _versions() -> dict[str, str]:
    versions = {}
    for package in ("tensorflow", "keras", "torch", "jax"):
        module = sys.modules.get(package)
        if module is not None and hasattr(module, "__version__"):
            versions[package] = str(module.__version__)
    keras = sys.modules.get("keras")
    if keras is not None:
        versions["keras backend"] = str(keras.backend.backend())
    return versions


def _world() -> dict[str, int]:
    try:
        config = json.loads(os.environ.get("TF_CONFIG") or "{}")
        cluster = config.get("cluster", {})
        size = sum(len(a) for a in cluster.values() if isinstance(a, list)) or 1
        return {"size": size, "rank": int(config.get("task", {}).get("index", 0))}
    except (ValueError, TypeError, AttributeError):
        return {"size": 1, "rank": 0}


def fingerprint(
    objects: Mapping[str, Any], described: Mapping[str, Mapping[str, Any]], data: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """`described` is `ckptstore.client.tensorflow.state.describe` of the objects' variables (keys `<object>/<index>`)."""
    parts: dict[str, dict[str, Any]] = {
        name: {"type": type(obj).__name__, "arrays": {}} for name, obj in objects.items()
    }
    for key, variable in described.items():  # keyed by structure: layer names change between processes
        name, index = key.split("/", 1)
        parts[name]["arrays"][index] = f"{tuple(variable['shape'])} {variable['dtype']}"
    return {
        "framework": {"name": "keras", "versions": _versions()},
        "world": _world(),
        "objects": parts,
        "data": dict(data),
    }
