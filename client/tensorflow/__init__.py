"""TensorFlow and Keras 3 state for custom training loops: `CheckpointManager` over TF 2 / Keras objects
(`manager`), training state as named arrays with keys stable across processes (`state`), `tf.data`
iterators (`data`), the run's fingerprint and the global RNGs a run may draw from. Needs the `[tf]` extra."""

from ckptstore.client.tensorflow.manager import CheckpointManager

__all__ = ["CheckpointManager"]
