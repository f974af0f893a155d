"""API errors: every failure leaves the service as JSON `{"error": code, "detail": text}`."""

from __future__ import annotations

__all__ = ["ApiError", "STATUS_CODES", "COMMON_ERRORS", "error_responses"]

STATUS_CODES = {
    400: "invalid",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "invalid",
    409: "conflict",
    413: "too_large",
    415: "invalid",
    422: "invalid",
    503: "unavailable",
}


class ApiError(Exception):
    """A refusal with an HTTP status, one of DESIGN.md's error codes, and a human-readable detail."""

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


def error_responses(*statuses: int) -> dict[int | str, dict]:
    """OpenAPI `responses` entries documenting the JSON error body for these statuses."""
    from ckptstore.schema import ErrorBody

    return {status: {"model": ErrorBody, "description": STATUS_CODES.get(status, "error")} for status in statuses}


COMMON_ERRORS = error_responses(400, 401, 404, 413, 422, 503)
