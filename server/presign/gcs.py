"""V4 signed URLs to Google Cloud Storage's XML API, by google-cloud-storage, for `ckptstore.server.presign.signer.Signer`.

The XML API speaks S3's protocol for what a node needs — GET (ranges too), HEAD, PUT, DELETE, a
listing (`list-type=2`), multipart uploads — so a node's presigned filesystem (`ckptstore.client.service.presigned`)
reads both the same way; a create-only write carries `x-goog-if-generation-match: 0`, signed. The
credentials are a service account's (they hold the private key a signature needs): the root's
`token` option — a key file's path, or its JSON as a mapping — else the service's
GOOGLE_APPLICATION_CREDENTIALS; `endpoint_url` names another endpoint (an emulator).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from ckptstore.server.errors import ApiError
from ckptstore.wire.presign import UrlWanted

__all__ = ["GcsSigning", "GCS_CREATE_ONLY"]

GCS_CREATE_ONLY = {"x-goog-if-generation-match": "0"}
_ENDPOINT = "https://storage.googleapis.com"


class GcsSigning:
    """GOOG4-RSA-SHA256 signatures for one root's bucket."""

    def __init__(self, options: Mapping[str, Any]):
        try:
            from google.cloud import storage
        except ImportError:
            raise ApiError(503, "unavailable", "this service cannot sign GCS URLs: install ckptstore[gcs]") from None
        self._credentials = _credentials(options.get("token"))
        self._endpoint = str(options.get("endpoint_url") or _ENDPOINT).rstrip("/")
        self._client = storage.Client(project="-", credentials=self._credentials)

    def sign(
        self, bucket: str, key: str, wanted: UrlWanted, expires_s: int, *, create_only: bool
    ) -> tuple[str, dict[str, str]]:
        query, headers = _query(wanted, key), {}
        if create_only and wanted.part is None and (wanted.method == "PUT" or wanted.upload_id is not None):
            headers = dict(GCS_CREATE_ONLY)  # a single upload, or a multipart upload's completion
        where = self._client.bucket(bucket)
        target = where if wanted.method == "LIST" else where.blob(key)
        url = target.generate_signed_url(
            version="v4",
            expiration=datetime.timedelta(seconds=expires_s),
            api_access_endpoint=self._endpoint,
            method="GET" if wanted.method == "LIST" else wanted.method,
            headers=dict(headers) or None,  # the library adds Host to the mapping it is given
            query_parameters=query or None,
            credentials=self._credentials,
        )
        return url, headers


def _query(wanted: UrlWanted, key: str) -> dict[str, str]:
    if wanted.method == "LIST":
        query = {"list-type": "2", "prefix": key + "/"}
        if wanted.delimiter:
            query["delimiter"] = "/"
        if wanted.continuation is not None:
            query["continuation-token"] = wanted.continuation
        return query
    if wanted.upload_id is not None:
        return {"uploadId": wanted.upload_id} | ({} if wanted.part is None else {"partNumber": str(wanted.part)})
    return {"uploads": ""} if wanted.method == "POST" else {}


def _credentials(token: Any) -> Any:
    """A service account's credentials (`token`: a key file's path or its JSON), else the environment's."""
    import google.auth
    from google.oauth2 import service_account

    try:
        if isinstance(token, Mapping):
            return service_account.Credentials.from_service_account_info(dict(token))
        if isinstance(token, str) and token not in ("anon", "google_default", "cloud"):
            return service_account.Credentials.from_service_account_file(token)
        credentials, _ = google.auth.default()
    except (OSError, ValueError, google.auth.exceptions.GoogleAuthError) as exc:
        raise ApiError(503, "unavailable", f"this service has no GCS credentials to sign with: {exc}") from None
    if not hasattr(credentials, "sign_bytes"):
        raise ApiError(503, "unavailable", "the service's GCS credentials hold no key to sign URLs with")
    return credentials
