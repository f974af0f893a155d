"""The wire schema of the presigned data path: a node asks the service for short-lived URLs to its own
objects (`POST /v1/jobs/{job}/nodes/{node}/urls`) and moves the bytes itself."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from ckptstore.schema import AttemptId, RequestModel

__all__ = ["URL_LIMIT", "UrlWanted", "UrlsRequest", "SignedUrl", "SignedUrls"]

URL_LIMIT = 1000  # URLs one request may ask for


class UrlWanted(RequestModel):
    """One object to read (GET) or write (PUT), by its key relative to the job's storage root."""

    method: Literal["GET", "PUT"]
    key: str = Field(min_length=1, max_length=1024)


class UrlsRequest(RequestModel):
    """URLs for the node's current attempt (`attempt`: the newest it registered; an older one is fenced)."""

    attempt: AttemptId
    objects: list[UrlWanted] = Field(min_length=1, max_length=URL_LIMIT)
    expires_s: int | None = Field(default=None, ge=1, le=12 * 3600, description="default: the service's")


class SignedUrl(BaseModel):
    """A URL and the headers to send with it (a create-only write: `If-None-Match: *`, which it signs)."""

    method: Literal["GET", "PUT"]
    key: str
    url: str
    headers: dict[str, str] = Field(default_factory=dict)


class SignedUrls(BaseModel):
    expires_at: float  # seconds since the epoch; ask again before then
    urls: list[SignedUrl]
