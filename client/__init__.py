"""What runs in training scripts: the service client (Keras callback and loop manager to come)."""

from client.service import ServiceClient

__all__ = ["ServiceClient"]
