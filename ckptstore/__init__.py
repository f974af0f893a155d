"""ckptstore core: checkpoints as safetensors shards + a manifest on any fsspec storage."""

from ckptstore import errors
from ckptstore.copykey import CopyKey
from ckptstore.errors import *  # noqa: F403  (the error tree, as ckptstore.errors.__all__ lists it)
from ckptstore.format.manifest import Manifest
from ckptstore.position import Position
from ckptstore.report import AccessReport, CheckpointInfo, CheckpointRef, LoadedCheckpoint, Problem, VerifyReport
from ckptstore.store import Store

__all__ = [
    "Store",
    "Position",
    "CopyKey",
    "Manifest",
    "CheckpointRef",
    "CheckpointInfo",
    "LoadedCheckpoint",
    "VerifyReport",
    "Problem",
    "AccessReport",
    *errors.__all__,
]
__version__ = "0.1.0"
