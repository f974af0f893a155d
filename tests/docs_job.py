"""Run a documented training loop as written (a ```python block of README.md or docs/), in a
process of its own, for tests/test_docs_code.py.

    python -m tests.docs_job --block tf-loop|torch-loop|jax-loop --storage ROOT --job J --out FINAL.npz [--kill-at N]

The block runs with what its prose assumes defined (model, optimizer, dataset, train_step, EPOCHS,
…) on a small model with Dropout and shuffled synthetic data; only its placeholders are replaced
(the storage and service URLs, the save interval). --kill-at N SIGKILLs the process before the N-th
training step, after the save in flight is committed. Writes every model and optimizer value to --out.
"""

from __future__ import annotations

import argparse
import os
import signal

import numpy as np

from tests.job_runs import documented_block

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCKS = {  # name: (file, the text the block follows, placeholders replaced)
    "tf-loop": (
        "README.md",
        "Custom loops:",
        {"% 100": "% 5", '"/data/ckpt"': "STORAGE", "service=": "service=None and "},
    ),
    "torch-loop": (
        "docs/pytorch.md",
        "## A plain training loop",
        {"% 500": "% 5", '"s3://ckpt/jobs"': "STORAGE", "service=": "service=None and "},
    ),
    "jax-loop": ("docs/jax.md", "## A training loop", {"% 500": "% 3", '"s3://ckpt/jobs"': "STORAGE"}),
}


def block(name: str) -> str:
    return documented_block(*BLOCKS[name])


def killer(kill_at: int | None, wait):
    calls = [0]

    def step_taken() -> None:
        calls[0] += 1
        if calls[0] == kill_at:
            wait()
            os.kill(os.getpid(), signal.SIGKILL)

    return step_taken


def tf_globals(args, namespace: dict) -> dict[str, np.ndarray]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import tensorflow as tf

    from tests.train_job import data, make_model

    model = make_model(seeded_dropout=False)
    opt = model.optimizer

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    def train_step(x, y):
        namespace["step_taken"]()
        step(x, y)

    namespace.update(model=model, opt=opt, dataset=tf.data.Dataset.from_tensor_slices(data()), EPOCHS=3)
    namespace.update(STEPS_PER_EPOCH=12, train_step=train_step)

    def final() -> dict[str, np.ndarray]:
        return {f"v/{i}": keras.ops.convert_to_numpy(v) for i, v in enumerate(model.variables + opt.variables)}

    return final


def torch_globals(args, namespace: dict):
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    x = torch.randn(384, 16, generator=torch.Generator().manual_seed(1))  # 12 batches of 32
    dataset = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True) * 0.1)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)

    def train_step(x, y):
        namespace["step_taken"]()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()

    namespace.update(DataLoader=DataLoader, dataset=dataset, model=model, opt=opt, sched=sched, EPOCHS=3)
    namespace.update(train_step=train_step)

    def final() -> dict[str, np.ndarray]:
        state = {f"model/{k}": v.detach().numpy().copy() for k, v in model.state_dict().items()}
        for index, slots in opt.state_dict()["state"].items():
            state |= {f"opt/{index}/{k}": torch.as_tensor(v).numpy().copy() for k, v in slots.items()}
        return state | {"rng": torch.get_rng_state().numpy().copy()}

    return final


def jax_globals(args, namespace: dict):
    import jax

    from tests import jax_job

    def train_step(state, x, y):
        namespace["step_taken"]()
        return jax_job.train_step(state, x, y)

    namespace.update(initial_state=jax_job.initial_state, batch_of=jax_job.batch_of, train_step=train_step)
    namespace.update(EPOCHS=jax_job.EPOCHS, STEPS_PER_EPOCH=jax_job.STEPS)

    def final() -> dict[str, np.ndarray]:
        leaves = jax.tree_util.tree_flatten_with_path(namespace["state"])[0]
        return {
            jax.tree_util.keystr(path): np.asarray(jax.random.key_data(leaf) if path[0].key == "rng" else leaf)
            for path, leaf in leaves
        }

    return final


GLOBALS = {"tf-loop": tf_globals, "torch-loop": torch_globals, "jax-loop": jax_globals}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--block", choices=sorted(BLOCKS), required=True)
    parser.add_argument("--storage", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-at", type=int, default=None)
    args = parser.parse_args()
    os.environ["CKPTSTORE_JOB"] = args.job  # the block names its own job: runs must not share it
    namespace: dict = {"STORAGE": args.storage}
    final = GLOBALS[args.block](args, namespace)
    namespace["step_taken"] = lambda: None
    code = block(args.block).replace('job="gan"', "job=__import__('os').environ['CKPTSTORE_JOB']")
    code = code.replace('job="lm"', "job=__import__('os').environ['CKPTSTORE_JOB']")
    namespace["step_taken"] = killer(args.kill_at, lambda: namespace["mgr"].wait())
    exec(compile(code, f"<{args.block}>", "exec"), namespace)
    np.savez(args.out, **final())


if __name__ == "__main__":
    main()
