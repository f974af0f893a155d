"""Typed errors of ckptstore: one tree, shared by the core, the service client and the CLI.

    CkptStoreError
    ├── CheckpointNotFoundError     no committed checkpoint at that job/node/position/attempt
    ├── CorruptCheckpointError      a committed checkpoint whose bytes do not verify
    ├── CommitConflictError         same attempt and position, different content
    ├── FencedError                 a newer attempt of the node exists: this writer is a zombie
    ├── InvalidNameError            a job/node/attempt name or position that could escape or break the layout
    ├── StorageUnavailableError     storage cannot be reached or written now (`failure`: transient or permanent)
    ├── ConfigurationError          a set-up that can never work: a node outside the job, another storage root,
    │                               a missing bucket, a root under a file, access denied (refused before training)
    ├── ResumeRefusedError          intact copies of the job exist, but none qualifies to resume from: starting
    │                               from scratch would retrain committed work silently (`fresh_start=True` allows it)
    ├── ResumeDriftError            resume_check="raise" and the resume audit found drift: nothing was assigned
    ├── ReplicasDisagreeError       on_error="raise" and data-parallel replicas hold different state at a save
    └── ServiceError                the metadata service failed or refused
        ├── ServiceUnavailableError     unreachable, timed out, or 5xx after retries
        └── RequestRejectedError        a 4xx answer: carries the status, error code and detail

fsspec's own OSErrors pass through unchanged unless ckptstore gives them a new meaning.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "Failure",
    "CkptStoreError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "CommitConflictError",
    "FencedError",
    "InvalidNameError",
    "StorageUnavailableError",
    "ConfigurationError",
    "ResumeRefusedError",
    "ResumeDriftError",
    "ReplicasDisagreeError",
    "ServiceError",
    "ServiceUnavailableError",
    "RequestRejectedError",
]

# The kind of a storage failure (`ckptstore.storage.failures` maps each backend exception to one).
Failure = Literal["missing", "denied", "misconfigured", "unavailable"]


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
    """Storage cannot be reached, written or read right now. `failure` says why in one word
    (`ckptstore.storage.failures`): `unavailable` (transient), or `denied` / `misconfigured` (permanent until
    someone fixes the credentials or the configuration), or `missing`."""

    def __init__(self, *args: object, failure: Failure = "unavailable"):
        super().__init__(*args)
        self.failure = failure

    @property
    def permanent(self) -> bool:
        """Whether trying again cannot help until the configuration or the credentials change."""
        return self.failure in ("denied", "misconfigured")


class ConfigurationError(CkptStoreError, ValueError):
    """A set-up that can never work as configured; the message says what to change."""


class ResumeRefusedError(CkptStoreError):
    """A start would train from scratch although committed copies of the job exist; `copies` names them."""

    def __init__(self, message: str, *, copies: tuple[object, ...] = ()):
        super().__init__(message)
        self.copies = copies

    def __reduce__(self) -> tuple[type[ResumeRefusedError], tuple[str]]:
        """Picklable (torch.distributed sends a rank's exception to the others); the copies stay behind."""
        return type(self), (str(self),)


class ResumeDriftError(CkptStoreError):
    """resume_check="raise": the restore's audit found the live run differs from the saved one;
    `differences` names each way, and nothing was assigned."""

    def __init__(self, message: str, *, differences: tuple[str, ...] = ()):
        super().__init__(message)
        self.differences = differences

    def __reduce__(self) -> tuple[type[ResumeDriftError], tuple[str]]:
        return type(self), (str(self),)


class ReplicasDisagreeError(CkptStoreError):
    """Replicas that must hold the same state (DDP) do not, at a save; the message names the ranks and
    a tensor. Raised on every rank under on_error="raise" (otherwise the save is kept but not good)."""


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
