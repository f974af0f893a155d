"""JAX pytrees: `ckptstore.client.jax.CheckpointManager` against Orbax's `StandardCheckpointer`, in one run.

    python bench/jax_orbax.py [--mib 512] [--reps 5]

A pytree shaped like a transformer's training state — bf16 weights, fp32 Adam moments (optax.adam),
a step and a typed PRNG key — of about `--mib` MiB of weights, saved and restored to local disk by
each, alternating, `--reps` times, each save to a new folder: seconds to save (until durable: the
manager's `wait()`, Orbax's `wait_until_finished()`) and to restore into a fresh pytree, and whether
the restored leaves are bit-equal. Needs `pip install orbax-checkpoint` beside `.[jax]` (not a
ckptstore dependency: this is the measurement behind docs/jax.md's choice of ckptstore's own format).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


def state_of(mib: int) -> dict:
    """Weights in 64 layers of bf16 matrices, Adam's moments of them, a step and a key."""
    side = int((mib * 2**20 / 64 / 2) ** 0.5)
    rng = np.random.default_rng(0)
    params = {
        f"layer{i}": jnp.asarray(rng.standard_normal((side, side), dtype=np.float32) * 0.02, jnp.bfloat16)
        for i in range(64)
    }
    opt = optax.adam(1e-3).init(jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params))
    return {"params": params, "opt": opt, "step": jnp.int32(7), "rng": jax.random.key(3)}


def leaves_equal(a: dict, b: dict) -> bool:
    def raw(leaf):
        return np.asarray(jax.random.key_data(leaf) if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf)

    pairs = zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
    return all(raw(x).tobytes() == raw(y).tobytes() for x, y in pairs)


def ckptstore_round(state: dict, folder: str) -> tuple[float, float, bool]:
    from ckptstore.client.jax import CheckpointManager

    options = {"storage": folder, "job": "bench", "node": "n0", "async_save": False}
    with CheckpointManager(**options) as mgr:
        mgr.restore_or_initialize(state)
        started = time.perf_counter()
        mgr.save(0, state)
        mgr.wait()
        saved = time.perf_counter() - started
    blank = jax.tree_util.tree_map(jnp.zeros_like, state)
    blank["rng"] = jax.random.key(0)
    started = time.perf_counter()
    with CheckpointManager(**options) as mgr:
        _, restored = mgr.restore_or_initialize(blank)
    jax.block_until_ready(restored)
    return saved, time.perf_counter() - started, leaves_equal(state, restored)


def orbax_round(state: dict, folder: str) -> tuple[float, float, bool]:
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    path = os.path.join(folder, "orbax")
    started = time.perf_counter()
    checkpointer.save(path, state)
    checkpointer.wait_until_finished()
    saved = time.perf_counter() - started
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state)
    started = time.perf_counter()
    restored = checkpointer.restore(path, abstract)
    jax.block_until_ready(restored)
    return saved, time.perf_counter() - started, leaves_equal(state, restored)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    state = state_of(args.mib)
    nbytes = sum(
        np.asarray(leaf).nbytes for leaf in jax.tree_util.tree_leaves(state) if leaf.dtype != jax.random.key(0).dtype
    )
    runs: dict[str, list[tuple[float, float, bool]]] = {"ckptstore": [], "orbax": []}
    rounds = {"ckptstore": ckptstore_round, "orbax": orbax_round}
    for rep in range(args.reps):
        for name in list(rounds)[:: 1 if rep % 2 == 0 else -1]:
            folder = tempfile.mkdtemp(prefix=f"bench-{name}-", dir=args.workdir)
            try:
                runs[name].append(rounds[name](state, folder))
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    results = {"bytes": nbytes, "args": vars(args)}
    for name, values in runs.items():
        save, load = statistics.median(v[0] for v in values), statistics.median(v[1] for v in values)
        results[name] = {
            "save_s": [round(v[0], 3) for v in values],
            "restore_s": [round(v[1], 3) for v in values],
            "save_gb_s_median": round(nbytes / save / 1e9, 2),
            "restore_gb_s_median": round(nbytes / load / 1e9, 2),
            "bit_equal": all(v[2] for v in values),
        }
    results["ckptstore_over_orbax"] = {
        "save_speed": round(
            statistics.median(v[0] for v in runs["orbax"]) / statistics.median(v[0] for v in runs["ckptstore"]), 2
        ),
        "restore_speed": round(
            statistics.median(v[1] for v in runs["orbax"]) / statistics.median(v[1] for v in runs["ckptstore"]), 2
        ),
    }
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
