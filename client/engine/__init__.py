"""The node engine every adapter drives: one node's checkpoints of one job (`node`), its options, the
start checks, restore, background saves and replication, retention, reports and cadence. Internal:
adapters (keras, tensorflow, torch, jax, hf, lightning) are the public face."""

__all__: list[str] = []
