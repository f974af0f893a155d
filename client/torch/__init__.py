"""PyTorch support: a loop `CheckpointManager` (exact resume: state dicts, RNGs, the data position),
a resumable sampler for the plain `DataLoader`, and a Distributed Checkpoint storage backend
(`ckptstore.client.torch.dcp`). Needs the `[torch]` extra."""

from ckptstore.client.torch.manager import CheckpointManager
from ckptstore.client.torch.sampler import ResumableSampler

__all__ = ["CheckpointManager", "ResumableSampler"]
