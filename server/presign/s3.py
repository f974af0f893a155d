"""Presigned S3 requests (SigV4), by botocore, for `ckptstore.server.presign.signer.Signer`: what each kind of URL a node
asks for (`UrlWanted`) is as an S3 operation, signed with the service's credentials for one root."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

from ckptstore.server.errors import ApiError
from ckptstore.wire.presign import UrlWanted

__all__ = ["Signing", "S3Signing", "CREATE_ONLY"]

CREATE_ONLY = {"If-None-Match": "*"}


class Signing(Protocol):
    """One storage root's signer: the URL for `wanted` on `bucket`/`key` and the headers to send with it."""

    def sign(
        self, bucket: str, key: str, wanted: UrlWanted, expires_s: int, *, create_only: bool
    ) -> tuple[str, dict[str, str]]: ...


class S3Signing:
    """SigV4 query-string signatures for one root's S3 (or S3-compatible) endpoint."""

    def __init__(self, options: Mapping[str, Any]):
        self._client = _s3_client(options)

    def sign(
        self, bucket: str, key: str, wanted: UrlWanted, expires_s: int, *, create_only: bool
    ) -> tuple[str, dict[str, str]]:
        operation, params = _operation(wanted, bucket, key, create_only)
        url = self._client.generate_presigned_url(operation, Params=params, ExpiresIn=expires_s)
        return url, dict(CREATE_ONLY) if "IfNoneMatch" in params else {}


def _operation(wanted: UrlWanted, bucket: str, key: str, create_only: bool) -> tuple[str, dict[str, Any]]:
    """The S3 operation and its parameters that `wanted` signs."""
    params: dict[str, Any] = {"Bucket": bucket, "Key": key}
    if wanted.method == "LIST":
        params = {"Bucket": bucket, "Prefix": key + "/"}
        if wanted.delimiter:
            params["Delimiter"] = "/"
        if wanted.continuation is not None:
            params["ContinuationToken"] = wanted.continuation
        return "list_objects_v2", params
    if wanted.upload_id is not None:
        params["UploadId"] = wanted.upload_id
    if create_only and wanted.method in ("PUT", "POST") and wanted.part is None:
        if wanted.method == "PUT" or wanted.upload_id is not None:
            params["IfNoneMatch"] = "*"  # a single upload, or a multipart upload's completion
    if wanted.method == "PUT":
        if wanted.part is None:
            return "put_object", params
        return "upload_part", params | {"PartNumber": wanted.part}
    if wanted.method == "POST":
        return ("complete_multipart_upload" if wanted.upload_id else "create_multipart_upload"), params
    if wanted.method == "DELETE":
        return ("abort_multipart_upload" if wanted.upload_id else "delete_object"), params
    return {"GET": "get_object", "HEAD": "head_object"}[wanted.method], params


def _s3_client(options: Mapping[str, Any]) -> Any:
    """A botocore S3 client from s3fs-style options (`key`, `secret`, `token`, `endpoint_url`,
    `client_kwargs`: {"region_name"}); what is not given comes from the environment (AWS_*, the
    endpoint from AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL). An S3-compatible endpoint is addressed by
    path (`http://minio:9000/bucket/key`), as MinIO and moto expect."""
    try:
        import botocore.session
        from botocore.config import Config
    except ImportError:
        raise ApiError(503, "unavailable", "this service cannot sign URLs: install ckptstore[s3] (botocore)") from None

    region = options.get("client_kwargs", {}).get("region_name") or options.get("region_name")
    endpoint = (
        options.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    )
    return botocore.session.get_session().create_client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=options.get("key"),
        aws_secret_access_key=options.get("secret"),
        aws_session_token=options.get("token"),
        region_name=region or "us-east-1",
        config=Config(signature_version="s3v4", s3={"addressing_style": "path" if endpoint else "auto"}),
    )
