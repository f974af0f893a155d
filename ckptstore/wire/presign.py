"""The wire schema of the presigned data path: a node asks the service for short-lived URLs to its own
objects (`POST /v1/jobs/{job}/nodes/{node}/urls`) and moves the bytes itself."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from ckptstore.wire.schema import AttemptId, RequestModel

__all__ = ["URL_LIMIT", "UrlMethod", "UrlWanted", "UrlsRequest", "SignedUrl", "SignedUrls"]

URL_LIMIT = 1000  # URLs one request may ask for
UrlMethod = Literal["GET", "HEAD", "PUT", "DELETE", "LIST", "POST"]


class UrlWanted(RequestModel):
    """One request to sign, by its key relative to the job's storage root.

    GET, HEAD, PUT, DELETE: one object. LIST: the objects under the folder `key` (`delimiter`: one
    level; `continuation`: the page after the one that gave this token). A multipart upload of `key`:
    POST without `upload_id` starts it, PUT with `upload_id` and `part` sends a part, POST with
    `upload_id` completes it, DELETE with `upload_id` aborts it.
    """

    method: UrlMethod
    key: str = Field(min_length=1, max_length=1024)
    upload_id: str | None = Field(default=None, min_length=1, max_length=1024)
    part: int | None = Field(default=None, ge=1, le=10_000)
    delimiter: bool = False
    continuation: str | None = Field(default=None, min_length=1, max_length=4096)

    @model_validator(mode="after")
    def _consistent(self) -> UrlWanted:
        if (self.part is not None) != (self.method == "PUT" and self.upload_id is not None):
            raise ValueError("`part` goes with a PUT of a multipart upload (`upload_id`), and only there")
        if self.upload_id is not None and self.method not in ("PUT", "POST", "DELETE"):
            raise ValueError(f"`upload_id` has no meaning for {self.method}")
        if (self.delimiter or self.continuation is not None) and self.method != "LIST":
            raise ValueError("`delimiter` and `continuation` are LIST's")
        return self


class UrlsRequest(RequestModel):
    """URLs for the node. `attempt`: its current attempt (the newest it registered; an older one is
    fenced: 409), needed for every write; reads and the node's storage probe need none."""

    attempt: AttemptId | None = None
    objects: list[UrlWanted] = Field(min_length=1, max_length=URL_LIMIT)
    expires_s: int | None = Field(default=None, ge=1, le=12 * 3600, description="default: the service's")


class SignedUrl(BaseModel):
    """A URL and the headers to send with it (a create-only write: `If-None-Match: *`, which it signs)."""

    method: UrlMethod
    key: str
    url: str
    headers: dict[str, str] = Field(default_factory=dict)


class SignedUrls(BaseModel):
    expires_at: float  # seconds since the epoch; ask again before then
    expires_s: int  # the same, as a life from the answer (independent of the clocks' skew)
    urls: list[SignedUrl]  # in the order asked for
