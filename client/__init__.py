"""What runs in training scripts, installed as `ckptstore.client`.

The public face (README, docs/): the framework adapters — `ckptstore.client.keras` (the Keras 3
`BackupAndRestore` callback), `ckptstore.client.tensorflow` (the custom-loop `CheckpointManager` for
TF 2 / Keras objects), `ckptstore.client.torch`, `ckptstore.client.jax`, `ckptstore.client.hf`,
`ckptstore.client.lightning` — and `ServiceClient` here. The subpackages `engine/` (the node engine the
adapters drive), `service/` (the service's REST API, events, the presigned path) and `cli/` (the
`ckptstore` command) are internal: their names may change between releases.
"""

if __name__ != "ckptstore.client":  # the repository's folder on sys.path: one module, one name
    raise ImportError(f"import ckptstore.client, not {__name__}: the client/ folder installs as ckptstore.client")

from ckptstore.client.service.rest import ServiceClient  # noqa: E402

__all__ = ["ServiceClient"]
