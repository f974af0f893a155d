"""ckptstore core: checkpoints as safetensors shards + a manifest on any fsspec storage.

The public modules: `ckptstore` (the names in `__all__`), `ckptstore.errors`, `ckptstore.client`
(`ServiceClient`) and the framework adapters `ckptstore.client.keras`, `.tensorflow`, `.torch` (with
`.torch.dcp`), `.jax`, `.hf` and `.lightning`. Every other module — the core's `format/`, `storage/` and
`wire/`, the client's `engine/`, `service/` and `cli/`, the service — is internal: its names may change
between releases (tests/test_public_surface.py holds the rule).
"""

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
