"""Which node this process is, and whether it is the chief (the one that writes by default).

Order: `node=`, `CKPTSTORE_NODE`, TF_CONFIG (task type + index; `chief`/`master`, else worker 0
is the chief), `JOB_COMPLETION_INDEX`, `RANK`, `SLURM_PROCID`, else the host name.
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass

from ckptstore.names import validate_name

__all__ = ["NodeIdentity", "resolve_identity"]


@dataclass(frozen=True)
class NodeIdentity:
    """`node` is this process; `checkpoint_node` the node whose checkpoints it restores (and, if
    chief, writes): under TF_CONFIG every worker restores the chief's checkpoints."""

    node: str
    is_chief: bool
    source: str
    checkpoint_node: str = ""
    shared_restore: bool = False  # other processes restore this node's checkpoints (multi-worker TF_CONFIG)

    def __post_init__(self) -> None:
        if not self.checkpoint_node:
            object.__setattr__(self, "checkpoint_node", self.node)


def _from_tf_config(raw: str) -> NodeIdentity | None:
    try:
        config = json.loads(raw)
        task = config["task"]
        kind, index = str(task["type"]), int(task["index"])
    except (ValueError, KeyError, TypeError):
        return None
    cluster = config.get("cluster", {})
    chief_kind = next((k for k in ("chief", "master") if k in cluster), "worker")
    chief = kind == chief_kind and index == 0
    tasks = sum(len(addresses) for addresses in cluster.values() if isinstance(addresses, list))
    return NodeIdentity(
        f"{kind}-{index}", chief, "TF_CONFIG", checkpoint_node=f"{chief_kind}-0", shared_restore=tasks > 1
    )


def _host_node() -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip(".-_") or "node"
    return name[:128]


def resolve_identity(node: str | None = None) -> NodeIdentity:
    """This process's node name (validated) and chief role."""
    if node is not None:
        return NodeIdentity(validate_name(node, kind="node"), True, "argument")
    if os.environ.get("CKPTSTORE_NODE"):
        return NodeIdentity(validate_name(os.environ["CKPTSTORE_NODE"], kind="node"), True, "CKPTSTORE_NODE")
    if os.environ.get("TF_CONFIG"):
        identity = _from_tf_config(os.environ["TF_CONFIG"])
        if identity is not None:
            return identity
    for variable in ("JOB_COMPLETION_INDEX", "RANK", "SLURM_PROCID"):
        value = os.environ.get(variable, "")
        if value.isdigit():
            return NodeIdentity(f"node-{int(value)}", int(value) == 0, variable)
    return NodeIdentity(_host_node(), True, "hostname")
