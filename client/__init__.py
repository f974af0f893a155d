"""What runs in training scripts: the Keras callback (`client.keras`), the custom-loop manager
(`client.loop`), the service client and the `ckptstore` command line (`client.cli`)."""

from client.service import ServiceClient

__all__ = ["ServiceClient"]
