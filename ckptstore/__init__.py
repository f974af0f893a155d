"""ckptstore core: checkpoints as safetensors shards + a manifest on any fsspec storage."""

from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    CommitConflictError,
    CorruptCheckpointError,
    FencedError,
    InvalidNameError,
    RequestRejectedError,
    ServiceError,
    ServiceUnavailableError,
    StorageUnavailableError,
)
from ckptstore.manifest import Manifest
from ckptstore.position import Position
from ckptstore.report import AccessReport, CheckpointInfo, CheckpointRef, LoadedCheckpoint, Problem, VerifyReport
from ckptstore.store import Store

__all__ = [
    "Store",
    "Position",
    "Manifest",
    "CheckpointRef",
    "CheckpointInfo",
    "LoadedCheckpoint",
    "VerifyReport",
    "Problem",
    "AccessReport",
    "CkptStoreError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "CommitConflictError",
    "FencedError",
    "InvalidNameError",
    "StorageUnavailableError",
    "ServiceError",
    "ServiceUnavailableError",
    "RequestRejectedError",
]
__version__ = "0.1.0"
