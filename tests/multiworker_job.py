"""One worker of a 2-worker MultiWorkerMirroredStrategy job (run as a subprocess per worker).

    python -m tests.multiworker_job INDEX PORT0,PORT1 STORAGE SERVICE JOB EPOCHS [lazy]

Custom GradientTape loop with the CheckpointManager: only the chief (worker 0) writes; every worker
restores the chief's checkpoint. With `lazy` the optimizer is left unbuilt (as the TensorFlow
tutorials leave it) and the manager restores outside the strategy scope. Prints `RESUMED <epoch> <batch>` or `FRESH`, then `EPOCH <e>`
after each epoch, then `DONE <sum of the model variables>`.
"""

from __future__ import annotations

import json
import os
import sys

index, ports, storage, service, job, epochs = (
    int(sys.argv[1]),
    sys.argv[2].split(","),
    sys.argv[3],
    sys.argv[4],
    sys.argv[5],
    int(sys.argv[6]),
)
lazy = sys.argv[7:] == ["lazy"]
os.environ["TF_CONFIG"] = json.dumps(
    {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": index}}
)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from ckptstore.client.tensorflow.manager import CheckpointManager  # noqa: E402

strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    if not lazy:
        optimizer.build(model.trainable_variables)

manager = CheckpointManager(
    storage=storage, service=service, job=job, objects={"model": model, "optimizer": optimizer}, async_save=False
)
start = manager.restore_or_initialize()
position = manager.resume_position
print("FRESH" if position is None else f"RESUMED {position.epoch} {position.batch}", flush=True)

rng = np.random.default_rng(0)
x = rng.standard_normal((64, 8)).astype("float32")
y = x.sum(axis=1, keepdims=True).astype("float32")
dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(16))


@tf.function
def step(batch):
    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(xb, training=True) - yb) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    strategy.run(replica_step, args=batch)


for epoch in range(start, epochs):
    for batch in dataset:
        step(batch)
    manager.save(epoch)
    print(f"EPOCH {epoch}", flush=True)
manager.close()
print(f"DONE {sum(float(np.asarray(v).sum()) for v in model.variables):.6f}", flush=True)
