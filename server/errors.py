"""API errors: every failure leaves the service as JSON `{"error": code, "detail": text}`, built
from the wire schema's `ErrorBody` by `error_model` — the one place error bodies are made (and
refusals counted); `error_body` is its JSON."""

from __future__ import annotations

from typing import Any

from starlette.types import Send

from ckptstore.server.metrics import METRICS
from ckptstore.wire.schema import ErrorBody

__all__ = ["ApiError", "STATUS_CODES", "COMMON_ERRORS", "error_responses", "error_model", "error_body", "send_error"]

STATUS_CODES = {
    400: "invalid",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "invalid",
    409: "conflict",
    413: "too_large",
    429: "too_many",
    415: "invalid",
    422: "invalid",
    503: "unavailable",
}


class ApiError(Exception):
    """A refusal with an HTTP status, one of the error codes of docs/rest.md, and a human-readable detail."""

    def __init__(self, status: int, code: str, detail: str, *, headers: dict[str, str] | None = None):
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail
        self.headers = headers

    @classmethod
    def not_found(cls, detail: str) -> ApiError:
        return cls(404, "not_found", detail)

    @classmethod
    def invalid(cls, detail: str) -> ApiError:
        return cls(422, "invalid", detail)


def error_model(code: str, detail: str) -> ErrorBody:
    """The body of a refusal with one of the error codes of docs/rest.md; counted in the metrics."""
    METRICS.refused.labels(code).inc()
    return ErrorBody.model_validate({"error": code, "detail": detail})


def error_body(code: str, detail: str) -> bytes:
    """`error_model`'s JSON: what a refused request gets."""
    return error_model(code, detail).model_dump_json(exclude_none=True).encode()


async def send_error(send: Send, status: int, code: str, detail: str, headers: dict[str, str] | None = None) -> None:
    """Answer an error straight from ASGI middleware (before routing)."""
    body = error_body(code, detail)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries documenting the JSON error body for these statuses."""
    return {status: {"model": ErrorBody, "description": STATUS_CODES.get(status, "error")} for status in statuses}


COMMON_ERRORS = error_responses(400, 401, 404, 413, 422, 503)
