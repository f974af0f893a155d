"""What the resume proof can see of the batches Keras' `fit` trains (TensorFlow backend).

`fit` draws its batches inside a compiled step, where no callback sees them. So the step is made
again around a digest: each batch's digest — an integer of the batch's bits, at most DIGESTED values
of each tensor taken evenly through it, position-weighted so that another order of the same samples
differs — is kept in a variable as the batch trains. A mid-epoch save records the digest of the last
batch trained. A mid-epoch resume draws the epoch's batches again to skip the trained ones (in
Python: client/keras.py) and digests the last one the same way: equal, the resumed epoch draws the
saved run's order; not, it does not (a pipeline that replays another epoch's order, another seed).
Integer arithmetic only, so the compiled and the eager digest of one batch are one number.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

__all__ = ["DIGESTED", "digest", "BatchDigests"]

DIGESTED = 4096  # values of each tensor a digest takes (evenly spaced through it): its cost stays flat
_BITS = {2: tf.int16, 4: tf.int32, 8: tf.int64}


def digest(data: Any) -> tf.Tensor:
    """The digest of one batch (any nest of tensors; strings are left out), an int64 scalar."""
    total = tf.constant(0, tf.int64)
    for tensor in tf.nest.flatten(data):
        tensor = tf.convert_to_tensor(tensor)
        if tensor.dtype.is_floating:
            bits = tf.bitcast(tensor, _BITS[tensor.dtype.size])
        elif tensor.dtype.is_integer or tensor.dtype == tf.bool:
            bits = tensor
        else:
            continue
        flat = tf.reshape(bits, [-1])
        size = tf.size(flat, out_type=tf.int64)
        taken = tf.cast(flat[:: tf.maximum(size // DIGESTED, 1)], tf.int64)  # only what is read is widened
        weights = tf.range(1, tf.size(taken, out_type=tf.int64) + 1, dtype=tf.int64) * 2654435761
        total = total * 1000003 + tf.reduce_sum(taken * weights) + size
    return total


class BatchDigests:
    """The digest of the last batch a model's `fit` trained (`last`), kept by its compiled step."""

    def __init__(self, model: keras.Model):
        self.model = model
        self.variable = tf.Variable(0, dtype=tf.int64, trainable=False, name="ckptstore_batch_digest")

    @staticmethod
    def available(model: keras.Model) -> bool:
        """Whether `fit`'s step can be made again around a digest: the TensorFlow backend, outside a
        tf.distribute strategy (whose replicas would each keep one)."""
        return (
            keras.backend.backend() == "tensorflow"
            and not tf.distribute.has_strategy()
            and hasattr(model, "_make_function")
        )

    def install(self) -> None:
        """Make `fit`'s train function again, the step keeping each batch's digest as it trains."""
        model, variable, step = self.model, self.variable, self.model.train_step

        def digesting_step(data: Any) -> Any:
            variable.assign(digest(data))
            return step(data)

        model.train_function = model._make_function(digesting_step)

    def of(self, batch: Any) -> int:
        """The digest of one batch (a batch drawn again, in Python)."""
        return int(digest(batch))

    @property
    def last(self) -> int:
        """The digest of the batch trained last."""
        return int(self.variable.numpy())
