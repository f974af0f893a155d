"""The process-wide random number generators a Keras or TensorFlow run may draw from besides its
variables — Python's `random`, numpy's global generator and, when torch is loaded (Keras on the
torch backend), torch's CPU generator — as JSON and back.

Keras' own RNG state lives in variables (seed generators), saved with the model. But Keras on the
torch backend shuffles `fit`'s arrays with torch's global generator and runs an unseeded Dropout
on it; on the JAX backend it shuffles with numpy's. A resume that did not put these back would
train on another order and other masks.
"""

from __future__ import annotations

import random
import sys
from typing import Any, cast

import numpy as np

__all__ = ["capture", "restore"]


def capture() -> dict[str, Any]:
    """The generators' states now."""
    kind, keys, pos, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": pos, "has_gauss": has_gauss, "cached": cached},
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_rng_state"):
        state["torch"] = torch.get_rng_state().tolist()
    return state


def restore(state: dict[str, Any]) -> None:
    """Put `capture`'s states back (a generator it did not capture is left as it is)."""
    saved = state["numpy"]
    keys = np.asarray(saved["keys"], dtype=np.uint32)
    np.random.set_state((saved["kind"], keys, saved["pos"], saved["has_gauss"], saved["cached"]))
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))
    torch = sys.modules.get("torch")
    if "torch" in state and torch is not None:
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
