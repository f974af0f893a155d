"""Typed errors of ckptstore: one tree, shared by the core, the service client and the CLI.

    CkptStoreError
    ├── CheckpointNotFoundError     no committed checkpoint at that job/node/position/attempt
    ├── CorruptCheckpointError      a committed checkpoint whose bytes do not verify
    ├── CommitConflictError         same attempt and position, different content
    ├── FencedError                 a newer attempt of the node exists: this writer is a zombie
    ├── InvalidNameError            a job/node/attempt name or position that could escape or break the layout
    ├── StorageUnavailableError     storage cannot be reached or written now
    └── ServiceError                the metadata service failed or refused
        ├── ServiceUnavailableError     unreachable, timed out, or 5xx after retries
        └── RequestRejectedError        a 4xx answer: carries the status, error code and detail

fsspec's own OSErrors pass through unchanged unless ckptstore gives them a new meaning.
"""

from __future__ import annotations

__all__ = [
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


class CkptStoreError(Exception):
    """Base of every error ckptstore raises on purpose."""


class CheckpointNotFoundError(CkptStoreError, LookupError):
    """No committed checkpoint matches the request."""


class CorruptCheckpointError(CkptStoreError):
    """A committed checkpoint's bytes do not match its manifest.

    `location` is the checkpoint prefix, `file` the offending file inside it (when known), and
    `missing` whether the file is gone rather than damaged.
    """

    def __init__(self, message: str, *, location: str | None = None, file: str | None = None, missing: bool = False):
        super().__init__(message)
        self.location = location
        self.file = file
        self.missing = missing


class CommitConflictError(CkptStoreError):
    """The same attempt committed different content at the same position."""


class FencedError(CkptStoreError):
    """A newer attempt of this node exists; this writer must stop."""


class InvalidNameError(CkptStoreError, ValueError):
    """A name, attempt or position is not allowed (it could escape the storage root)."""


class StorageUnavailableError(CkptStoreError, OSError):
    """Storage cannot be reached, written or read right now."""


class ServiceError(CkptStoreError):
    """The metadata service failed or refused a request."""


class ServiceUnavailableError(ServiceError):
    """The service could not be reached, timed out, or kept answering 5xx."""


class RequestRejectedError(ServiceError):
    """The service answered 4xx; `status`, `code` and `detail` come from its JSON error."""

    def __init__(self, status: int, code: str, detail: str):
        super().__init__(f"{status} {code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail

    def __reduce__(self) -> tuple[type[RequestRejectedError], tuple[int, str, str]]:
        """Picklable (torch.distributed sends a rank's exception to the others)."""
        return type(self), (self.status, self.code, self.detail)
