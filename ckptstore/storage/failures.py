"""What a storage backend's exception means to ckptstore: one explicit map, read by `Storage`'s boundary.

Every failure of a storage call is one of four kinds (`Failure`):

    missing        the object is not there (passes through as FileNotFoundError where "missing" is an answer)
    denied         credentials missing, expired or without permission            permanent until fixed
    misconfigured  a request that cannot succeed as configured: a bucket that does not exist, a root under
                   a regular file, a wrong region or endpoint, an invalid bucket name   permanent until fixed
    unavailable    the store cannot be reached, timed out or answered a server error     transient

An exception's kind is looked up along its class's MRO in `BY_CLASS` (qualified class names, so no
backend package is imported here); OSErrors without a class of their own go by errno (`BY_ERRNO`),
botocore's ClientError and gcsfs' HttpError by the code they carry. An exception none of this
names is not the backend's (a bug of ours, a bad argument): it passes through untranslated.
tests/test_storage_failures.py checks that every exception class of botocore, aiohttp, s3fs, gcsfs,
google-auth, google-api-core, fsspec, requests and urllib3 has a kind.
"""

from __future__ import annotations

import errno
from collections.abc import Callable

from ckptstore.errors import CkptStoreError, Failure, StorageUnavailableError

__all__ = ["PERMANENT", "BY_CLASS", "BY_ERRNO", "failure_of", "failure_of_type", "storage_error"]

PERMANENT: frozenset[Failure] = frozenset({"denied", "misconfigured"})

BY_ERRNO: dict[int, Failure] = {
    errno.ENOENT: "missing",
    errno.EACCES: "denied",
    errno.EPERM: "denied",
    errno.ENOTDIR: "misconfigured",  # a root under a regular file
    errno.EISDIR: "misconfigured",
    errno.EEXIST: "misconfigured",  # a folder wanted where a file is
    errno.EROFS: "misconfigured",
    errno.ENAMETOOLONG: "misconfigured",
    errno.EINVAL: "misconfigured",  # s3fs: a malformed authorization header (wrong region), a bad bucket name
    getattr(errno, "EREMCHG", errno.ENOENT): "misconfigured",  # s3fs: a permanent redirect (another region)
}
# botocore's ClientError codes that s3fs does not translate into OSErrors first.
_CLIENT_ERROR_CODES: dict[str, Failure] = {
    "NoSuchKey": "missing",
    "404": "missing",
    "NoSuchBucket": "misconfigured",
    "PermanentRedirect": "misconfigured",
    "AuthorizationHeaderMalformed": "misconfigured",
    "InvalidBucketName": "misconfigured",
    "AccessDenied": "denied",
    "403": "denied",
    "InvalidAccessKeyId": "denied",
    "SignatureDoesNotMatch": "denied",
    "ExpiredToken": "denied",
}


def _by_errno(exc: BaseException) -> Failure:
    code = getattr(exc, "errno", None)
    return BY_ERRNO.get(code, "unavailable") if isinstance(code, int) else "unavailable"


def _by_client_error_code(exc: BaseException) -> Failure:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    return _CLIENT_ERROR_CODES.get(code, "unavailable")


def _by_http_status(exc: BaseException) -> Failure:
    status = getattr(exc, "code", None)
    if status in (401, 403):
        return "denied"
    if status == 404:
        return "missing"
    if status in (400, 301, 307):
        return "misconfigured"
    return "unavailable"


BY_CLASS: dict[str, Failure | Callable[[BaseException], Failure]] = {
    # Python's own OSErrors (what s3fs and gcsfs translate most answers into, and local disk raises).
    "builtins.FileNotFoundError": "missing",
    "builtins.PermissionError": "denied",
    "builtins.NotADirectoryError": "misconfigured",
    "builtins.IsADirectoryError": "misconfigured",
    "builtins.FileExistsError": "misconfigured",
    "builtins.ConnectionError": "unavailable",
    "builtins.TimeoutError": "unavailable",  # asyncio.TimeoutError and fsspec's FSTimeoutError too
    "builtins.OSError": _by_errno,
    # botocore (aiobotocore raises botocore's classes); its base class covers connections and timeouts.
    "botocore.exceptions.NoCredentialsError": "denied",
    "botocore.exceptions.PartialCredentialsError": "denied",
    "botocore.exceptions.CredentialRetrievalError": "denied",
    "botocore.exceptions.NoAuthTokenError": "denied",
    "botocore.exceptions.TokenRetrievalError": "denied",
    "botocore.exceptions.SSOError": "denied",
    "botocore.exceptions.LoginError": "denied",
    "botocore.exceptions.ParamValidationError": "misconfigured",
    "botocore.exceptions.InvalidRegionError": "misconfigured",
    "botocore.exceptions.InvalidEndpointConfigurationError": "misconfigured",
    "botocore.exceptions.InvalidConfigError": "misconfigured",
    "botocore.exceptions.ValidationError": "misconfigured",
    "botocore.exceptions.BaseEndpointResolverError": "misconfigured",
    "botocore.exceptions.EndpointProviderError": "misconfigured",
    "botocore.exceptions.ClientError": _by_client_error_code,
    "botocore.exceptions.BotoCoreError": "unavailable",
    "botocore.exceptions.UndefinedModelAttributeError": "misconfigured",
    # aiohttp: every client and protocol error is a connection that failed now.
    "aiohttp.client_exceptions.ClientError": "unavailable",
    "aiohttp.http_exceptions.HttpProcessingError": "unavailable",
    "aiohttp.client_exceptions.WSMessageTypeError": "unavailable",
    # gcsfs
    "gcsfs.retry.HttpError": _by_http_status,
    "gcsfs.retry.ChecksumError": "unavailable",
    "gcsfs.retry.NonRetryableError": "misconfigured",
    # google-auth and google-api-core (gcsfs' credentials)
    "google.auth.exceptions.DefaultCredentialsError": "denied",
    "google.auth.exceptions.RefreshError": "denied",
    "google.auth.exceptions.MalformedError": "denied",
    "google.auth.exceptions.InvalidValue": "denied",
    "google.auth.exceptions.GoogleAuthError": "unavailable",
    "google.api_core.exceptions.NotFound": "missing",
    "google.api_core.exceptions.Unauthorized": "denied",
    "google.api_core.exceptions.Forbidden": "denied",
    "google.api_core.exceptions.PermissionDenied": "denied",
    "google.api_core.exceptions.Unauthenticated": "denied",
    "google.api_core.exceptions.BadRequest": "misconfigured",
    "google.api_core.exceptions.InvalidArgument": "misconfigured",
    "google.api_core.exceptions.GoogleAPIError": "unavailable",
    "google.api_core.exceptions.AsyncRestUnsupportedParameterError": "misconfigured",
    # requests and urllib3 (google-auth's transport)
    "requests.exceptions.RequestException": "unavailable",
    "urllib3.exceptions.HTTPError": "unavailable",
    "urllib3.exceptions.HTTPWarning": "unavailable",
    "urllib3.exceptions.ProxySchemeUnsupported": "misconfigured",
    # fsspec
    "fsspec.exceptions.BlocksizeMismatchError": "misconfigured",
}


def failure_of_type(cls: type[BaseException]) -> Failure | Callable[[BaseException], Failure] | None:
    """The kind (or how to tell it from an instance) of exceptions of class `cls`, or None: not a backend's."""
    for base in cls.__mro__:
        found = BY_CLASS.get(f"{base.__module__}.{base.__qualname__}")
        if found is not None:
            return found
    return None


def failure_of(exc: BaseException) -> Failure | None:
    """What `exc` means for storage, or None when it is not a backend failure (it passes through)."""
    found = failure_of_type(type(exc))
    return found(exc) if callable(found) else found


_WHY: dict[Failure, str] = {
    "denied": "access denied (credentials missing, expired or without permission)",
    "misconfigured": "a request that cannot succeed as configured",
    "missing": "not found",
    "unavailable": "unreachable or failing now",
}


def storage_error(exc: Exception, where: str, *, missing_passes: bool = True) -> Exception:
    """What a backend failure means to ckptstore (the map above): `exc` itself when it is not the
    backend's or a not-found that callers handle (as FileNotFoundError), else a StorageUnavailableError that
    says where and why and carries the failure's kind."""
    if isinstance(exc, CkptStoreError):
        return exc
    failure = failure_of(exc)
    if failure is None:
        return exc
    if failure == "missing" and missing_passes:
        return exc if isinstance(exc, FileNotFoundError) else FileNotFoundError(errno.ENOENT, str(exc))
    reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    code = exc.errno if isinstance(exc, OSError) and exc.errno else errno.EIO
    return StorageUnavailableError(code, f"storage {where} is unavailable, {_WHY[failure]}: {reason}", failure=failure)
