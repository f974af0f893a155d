"""`CheckpointManager` for JAX training loops: any pytree of arrays — parameters, optax state, typed
PRNG keys, step counters — through the same store, service, tiers, fallback, async saves and resume
audit as the other managers (client/engine/manager.py).

mgr = CheckpointManager(storage="s3://bucket/ckpt", job="lm", local_storage="/nvme/ckpt")
epoch, state = mgr.restore_or_initialize(state)      # the next epoch, and the restored pytree
for epoch in range(epoch, EPOCHS):
    for batch in range(mgr.first_batch(epoch), STEPS):
        state = train_step(state, data(epoch, batch))
        mgr.save(epoch, state, batch=batch + 1)       # mid-epoch, whenever you like
    mgr.save(epoch, state)
mgr.wait()

Leaves are named by their path in the tree (`jax.tree_util.keystr`), saved as host arrays (a typed
PRNG key as its key data, with its implementation in the manifest) and put back on the device and
sharding of the leaf in the tree passed to `restore_or_initialize`. What "exact" needs is the loop's:
every random draw from keys in the state, data order a function of (epoch, batch).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from ckptstore import Position
from ckptstore.client.audit.declared import declared_data
from ckptstore.client.audit.proof import PROOF_KEY, recorded
from ckptstore.client.engine.cadence import SaveEvery
from ckptstore.client.engine.manager import LOOP, LoopManager
from ckptstore.client.engine.options import CheckpointOptions
from ckptstore.fingerprint import FINGERPRINT_KEY

__all__ = ["CheckpointManager"]

STATE_KEY = "jax_state"  # manifest metadata: each leaf's name and, for a typed PRNG key, its implementation
ROOT = "state"


def _leaves(state: Any) -> list[tuple[str, Any]]:
    """(name, leaf) for every leaf of the pytree, in its flattening order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    return [(ROOT + jax.tree_util.keystr(path), leaf) for path, leaf in flat]


def _is_key(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _host(name: str, leaf: Any) -> np.ndarray:
    """The leaf's values as a host array (a typed key's key data)."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        raise ValueError(
            f"{name} is sharded across hosts: ckptstore.client.jax saves only arrays a process can address whole"
        )
    return np.asarray(jax.device_get(jax.random.key_data(leaf) if _is_key(leaf) else leaf))


def _spec(leaf: Any) -> str:
    if _is_key(leaf):
        return f"{tuple(leaf.shape)} key<{jax.random.key_impl(leaf)}>"
    array = np.asarray(leaf) if not isinstance(leaf, jax.Array) else leaf
    return f"{tuple(array.shape)} {array.dtype}"


def _restored(template: Any, array: np.ndarray, impl: str | None) -> Any:
    """`array` as a leaf of the template's kind: a typed key, an array on the template's sharding, a
    numpy array, or a Python scalar."""
    if impl is not None:
        return jax.device_put(jax.random.wrap_key_data(jax.numpy.asarray(array), impl=impl), template.sharding)
    if isinstance(template, jax.Array):
        return jax.device_put(array, template.sharding)
    if isinstance(template, np.ndarray):
        return np.array(array)
    return type(template)(array.item())


class CheckpointManager(LoopManager):
    """Save and restore a JAX pytree (parameters, optax state, PRNG keys) every epoch or batch.

    Options are `CheckpointOptions`' (storage, service, job, node, local_storage, max_to_keep,
    async_save, codec, …), each defaulting to its CKPTSTORE_* variable where it has one.
    `data`: how the loop picks its batches from (epoch, batch) — `seed`, `batch_size`, `length`,
    `shuffle` — recorded with every save and compared at every resume (the resume audit: a change is
    drift). The loop shows the resume proof its batches with `observe_batch(batch)`: a resume is
    `exact` only once its first batch is the one the saved run trained after the save; without them
    it is `unverified`, never `exact` (client/audit/proof.py).
    """

    def _watchable(self) -> set[str]:
        return {LOOP}

    def __init__(
        self,
        *,
        options: CheckpointOptions | None = None,
        save_every: SaveEvery = None,
        save_every_seconds: float | None = None,
        data: Mapping[str, Any] | None = None,
        job: str | None = None,
        storage: str | None = None,
        service: str | list[str] | None = None,
        local_storage: str | None = None,
        **settings: Any,
    ):
        settings.update(job=job, storage=storage, service=service, local_storage=local_storage)
        super().__init__(options=options, save_every=save_every, save_every_seconds=save_every_seconds, **settings)
        self._state: Any = None
        self._data = declared_data("jax loop", data)

    def restore_or_initialize(self, state: Any) -> tuple[int, Any]:  # type: ignore[override]
        """Restore the last good position into a pytree shaped like `state`; returns the next epoch to
        run (0 on a fresh job) and the restored pytree (`state` itself when there is nothing to restore)."""
        self._state = state
        epoch = super().restore_or_initialize()
        return epoch, self._state

    def save(  # type: ignore[override]
        self,
        epoch: int,
        state: Any,
        *,
        batch: int | None = None,
        step: int | None = None,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> bool:
        """Checkpoint `state` at (epoch, batch) when the cadence says a save is due (`LoopManager.save`);
        returns whether it saved."""
        self._state = state
        return super().save(epoch, batch=batch, step=step, metrics=metrics, metadata=metadata)

    def checkpoint_if_preempted(self, epoch: int, batch: int, state: Any = None, *, requests: bool = True) -> None:
        """Call between batches with the current state: after a SIGTERM, save it and exit; after a
        checkpoint request, save it and go on (`LoopManager.checkpoint_if_preempted`)."""
        if state is not None:
            self._state = state
        super().checkpoint_if_preempted(epoch, batch, requests=requests)

    def _capture(self, position: Position) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        leaves = _leaves(self._state)
        arrays = {name: _host(name, leaf) for name, leaf in leaves}
        keys = {name: str(jax.random.key_impl(leaf)) for name, leaf in leaves if _is_key(leaf)}
        described = {"names": [name for name, _ in leaves], "keys": keys}
        self._custom_loop_batches()
        fingerprint = self._fingerprint(leaves) | {PROOF_KEY: recorded()}
        return arrays, {STATE_KEY: json.dumps(described), FINGERPRINT_KEY: fingerprint}

    def _live_fingerprint(self, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, Any]) -> dict[str, Any]:
        return self._fingerprint(_leaves(self._state))

    def _fingerprint(self, leaves: list[tuple[str, Any]]) -> dict[str, Any]:
        import jaxlib

        return {
            "framework": {"name": "jax", "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__}},
            "world": {"size": jax.process_count(), "rank": jax.process_index()},
            "objects": {ROOT: {"type": "pytree", "arrays": {name: _spec(leaf) for name, leaf in leaves}}},
            "data": self._data,
        }

    def _apply(self, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, Any]) -> None:
        if STATE_KEY not in metadata:
            raise ValueError("this checkpoint was not written by ckptstore.client.jax.CheckpointManager")
        keys: dict[str, str] = json.loads(metadata[STATE_KEY])["keys"]
        flat, treedef = jax.tree_util.tree_flatten(self._state)
        names = [name for name, _ in _leaves(self._state)]
        unfit = [
            name
            for name, leaf in zip(names, flat)
            if name not in arrays or _spec(leaf) != _saved_spec(arrays[name], keys.get(name), leaf)
        ]
        if unfit and self.options.strict:
            raise ValueError(
                f"the checkpoint does not fit {len(unfit)} leaves of the state, e.g. {unfit[:3]} "
                "(strict=False restores the rest)"
            )
        restored = [
            leaf if name in unfit else _restored(leaf, np.asarray(arrays[name]), keys.get(name))
            for name, leaf in zip(names, flat)
        ]
        self._state = jax.tree_util.tree_unflatten(treedef, restored)


def _saved_spec(array: np.ndarray, impl: str | None, template: Any) -> str:
    """The spec of a saved leaf, as `_spec` gives it for a live one."""
    if impl is None:
        return f"{tuple(array.shape)} {array.dtype}"
    return f"{tuple(array.shape[: template.ndim])} key<{impl}>" if _is_key(template) else f"key<{impl}>"
