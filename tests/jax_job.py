"""A JAX/optax training loop as a user writes it with `ckptstore.client.jax.CheckpointManager` (run as a
subprocess, to be SIGKILLed): a 2-layer MLP with dropout, AdamW, a typed PRNG key in the state, the
data shuffled per epoch from a key, saves every 3 batches and at each epoch's end.

    python -m tests.jax_job --storage ROOT --job JOB --out OUT.npz [--local DIR] [--endpoint URL]
                            [--kill-at STEP]

Writes the final state's leaves to OUT.npz and the resume line's audit to stderr; `--kill-at` sends
itself SIGKILL right after that global step, once the save in flight is committed.
"""

from __future__ import annotations

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ckptstore.client.jax import CheckpointManager
from tests.job_runs import job_parser

EPOCHS, STEPS, BATCH, FEATURES, HIDDEN = 3, 8, 32, 16, 32


def initial_state() -> dict:
    init = jax.random.key(0)
    first, second = jax.random.split(init)
    params = {
        "dense1": {"w": jax.random.normal(first, (FEATURES, HIDDEN)) * 0.1, "b": jnp.zeros(HIDDEN)},
        "dense2": {"w": jax.random.normal(second, (HIDDEN, 1)) * 0.1, "b": jnp.zeros(1)},
    }
    return {"params": params, "opt": OPTIMIZER.init(params), "rng": jax.random.key(42), "step": jnp.int32(0)}


OPTIMIZER = optax.adamw(1e-2)
DATA = np.random.default_rng(7)
X = jnp.asarray(DATA.standard_normal((STEPS * BATCH, FEATURES)), dtype=jnp.float32)
Y = jnp.asarray(DATA.standard_normal((STEPS * BATCH, 1)), dtype=jnp.float32)


def loss(params: dict, x: jax.Array, y: jax.Array, key: jax.Array) -> jax.Array:
    hidden = jax.nn.relu(x @ params["dense1"]["w"] + params["dense1"]["b"])
    keep = jax.random.bernoulli(key, 0.8, hidden.shape)  # dropout
    hidden = jnp.where(keep, hidden / 0.8, 0.0)
    return jnp.mean((hidden @ params["dense2"]["w"] + params["dense2"]["b"] - y) ** 2)


@jax.jit
def train_step(state: dict, x: jax.Array, y: jax.Array) -> dict:
    rng, dropout = jax.random.split(state["rng"])
    grads = jax.grad(loss)(state["params"], x, y, dropout)
    updates, opt = OPTIMIZER.update(grads, state["opt"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt": opt, "rng": rng, "step": state["step"] + 1}


def batch_of(epoch: int, batch: int) -> tuple[jax.Array, jax.Array]:
    order = jax.random.permutation(jax.random.fold_in(jax.random.key(1234), epoch), STEPS * BATCH)
    index = order[batch * BATCH : (batch + 1) * BATCH]
    return X[index], Y[index]


def main() -> None:
    parser = job_parser()
    parser.add_argument("--local", default=None)
    parser.add_argument("--endpoint", default=None)
    args = parser.parse_args()
    options = {} if args.endpoint is None else {"endpoint_url": args.endpoint, "key": "testing", "secret": "testing"}
    mgr = CheckpointManager(
        storage=args.storage,
        local_storage=args.local,
        storage_options=options,
        job=args.job,
        node="n0",
        data={"seed": 1234, "batch_size": BATCH, "length": STEPS * BATCH},
    )
    start, state = mgr.restore_or_initialize(initial_state())
    for epoch in range(start, EPOCHS):
        for batch in range(mgr.first_batch(epoch), STEPS):
            x, y = batch_of(epoch, batch)
            mgr.observe_batch((x, y))  # shown to the resume proof
            state = train_step(state, x, y)
            if (batch + 1) % 3 == 0:
                mgr.save(epoch, state, batch=batch + 1)
            if args.kill_at is not None and int(state["step"]) == args.kill_at:
                mgr.wait()  # the save in flight committed: the kill lands at a known position
                os.kill(os.getpid(), signal.SIGKILL)
        mgr.save(epoch, state)
    mgr.wait()
    mgr.close()
    leaves = {name: np.asarray(jax.random.key_data(leaf) if name == "rng" else leaf) for name, leaf in flat(state)}
    np.savez(args.out, **leaves)


def flat(state: dict) -> list[tuple[str, jax.Array]]:
    paths, _ = jax.tree_util.tree_flatten_with_path(state)
    return [("rng" if path[0].key == "rng" else jax.tree_util.keystr(path), leaf) for path, leaf in paths]


if __name__ == "__main__":
    main()
