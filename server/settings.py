"""Service configuration from `CKPTSTORE_*` environment variables (pydantic-settings)."""

from __future__ import annotations

import os
from functools import cached_property
from typing import Any

from platformdirs import user_data_dir
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ckptstore.names import validate_name
from ckptstore.server.http.origin import LOOPBACK_NAMES

__all__ = ["Settings", "root_is_allowed", "is_local_path", "MIN_TOKEN_LENGTH"]

MIN_TOKEN_LENGTH = 16


def _data_dir() -> str:
    return user_data_dir("ckptstore", appauthor=False)


def _segments(url: str) -> tuple[str, list[str]]:
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "file", url
    return scheme.lower(), [part for part in rest.split("/") if part]


def root_is_allowed(root: str, allowed: list[str]) -> bool:
    """Whether `root` lies under one of `allowed`, compared by whole path segments.

    `s3://ckpt-evil` is not under `s3://ckpt`; `..` and `.` segments are never allowed.
    """
    scheme, parts = _segments(root)
    if any(part in ("..", ".") for part in parts) or "\x00" in root or "\\" in root or "%" in root:
        return False
    path = root.partition("://")[2] if "://" in root else root
    if "//" in path.rstrip("/") or (scheme == "file" and not root.startswith(("/", "file:///"))):
        return False  # `s3://b//jobs` is not `s3://b/jobs`; a relative path would be the service's cwd
    for candidate in allowed:
        allowed_scheme, allowed_parts = _segments(candidate)
        if scheme == allowed_scheme and parts[: len(allowed_parts)] == allowed_parts:
            return True
    return False


def is_local_path(root: str) -> bool:
    """Whether `root` names a path on a node's own disk: absolute (or file://), without '..' or '.'."""
    scheme, parts = _segments(root)
    absolute = root.startswith("/") or root.startswith("file:///")
    return scheme == "file" and absolute and not any(part in ("..", ".") for part in parts) and "\x00" not in root


class Settings(BaseSettings):
    """Everything the service reads from its environment; docs/configuration.md lists each variable."""

    model_config = SettingsConfigDict(env_prefix="CKPTSTORE_", extra="ignore")

    db_url: str = Field(default="", description="SQLAlchemy URL; default: SQLite in the user's data directory")
    host: str = Field(default="127.0.0.1", description="address to listen on (0.0.0.0 in a container)")
    port: int = Field(default=8080, ge=0, le=65535, description="TCP port")
    workers: int = Field(default=1, ge=1, le=64, description="uvicorn worker processes")
    token: SecretStr | None = Field(
        default=None,
        description="bearer token every route but /healthz and /readyz requires (prefer the variable: flags show in ps)",
    )
    job_tokens: dict[str, SecretStr] = Field(
        default_factory=dict,
        description='per-job bearer tokens as JSON, {"job": "token"}: each reaches only /v1/jobs/<job>/…',
    )
    storage: str = Field(default="", description="default storage root for jobs that name none")
    storage_roots: str = Field(default="", description="comma-separated roots a job may use")
    storage_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description='per storage root, as JSON: {"s3://bucket": {"endpoint_url": …, "key": …, "secret": …}} '
        "(s3fs's and gcsfs' option names); presigned URLs for that root are signed with them, else with the "
        "AWS_* environment or GOOGLE_APPLICATION_CREDENTIALS",
    )
    url_expiry_seconds: int = Field(
        default=900, ge=1, le=12 * 3600, description="how long a presigned URL lasts unless the request asks less"
    )
    max_body_bytes: int = Field(default=1 << 20, ge=1024, description="largest request body accepted (413 above)")
    trusted_hosts: str = Field(
        default="",
        description="comma-separated Host names accepted, or * for any (400 otherwise); default: loopback names "
        "when bound to loopback with no token, else any",
    )
    trusted_proxies: str = Field(
        default="127.0.0.1",
        description="comma-separated addresses whose X-Forwarded-For/-Proto headers are believed (a load balancer)",
    )
    session_seconds: float = Field(
        default=12 * 3600, gt=0, le=30 * 24 * 3600, description="how long a dashboard sign-in lasts"
    )
    health_stale_seconds: float = Field(
        default=300.0, gt=0, description="a node's health report older than this is shown as stale"
    )
    answer_cache_size: int = Field(default=16384, ge=0, description="last-good answers cached per worker")
    events_keep_seconds: float = Field(default=7 * 24 * 3600, gt=0, description="how long events stay in the log")
    events_keep_rows: int = Field(default=1_000_000, ge=1000, description="at most this many newest events are kept")
    events_keep_undelivered_rows: int = Field(
        default=10_000_000,
        ge=1000,
        description="events a webhook has not been given stay past the window, up to this many in the log",
    )
    events_heartbeat_seconds: float = Field(
        default=15.0, gt=0, le=300, description="an idle event stream sends a heartbeat this often"
    )
    events_window_seconds: float = Field(
        default=0.1,
        gt=0,
        le=1,
        description="under a stream of commits, event streams are sent to at most this often (latency for service CPU)",
    )
    events_max_streams: int = Field(
        default=1000, ge=1, description="event streams one service process serves at once (more: 503)"
    )
    events_max_streams_per_caller: int = Field(
        default=100,
        ge=1,
        description="event streams one caller (a job's token, else a client address) may hold open (more: 429)",
    )
    events_poll_seconds: float = Field(
        default=0.5, gt=0, le=60, description="how often each process looks for events other processes wrote"
    )
    webhook_hosts: str = Field(
        default="", description="comma-separated host or host:port names webhooks may target (none by default)"
    )
    webhook_retry_seconds: float = Field(
        default=24 * 3600, gt=0, description="how long a webhook delivery is retried before it is given up"
    )
    webhook_timeout_seconds: float = Field(
        default=10.0, gt=0, le=120, description="total deadline of one webhook POST (its answer's body is never read)"
    )
    webhook_poll_seconds: float = Field(
        default=0.5, gt=0, le=60, description="how often a process looks for webhook deliveries due"
    )
    log_level: str = Field(default="info", description="debug, info, warning or error")

    @field_validator("job_tokens")
    @classmethod
    def _job_tokens_name_real_jobs(cls, value: dict[str, SecretStr]) -> dict[str, SecretStr]:
        for job, secret in value.items():
            validate_name(job, kind="job")
            if len(secret.get_secret_value()) < MIN_TOKEN_LENGTH:
                raise ValueError(f"the token of job {job!r} is shorter than {MIN_TOKEN_LENGTH} characters")
        return value

    @field_validator("token", mode="before")
    @classmethod
    def _empty_token_is_none(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("token")
    @classmethod
    def _token_long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < MIN_TOKEN_LENGTH:
            raise ValueError(f"CKPTSTORE_TOKEN is shorter than {MIN_TOKEN_LENGTH} characters")
        return value

    @property
    def has_tokens(self) -> bool:
        return self.token is not None or bool(self.job_tokens)

    @cached_property
    def database_url(self) -> str:
        if self.db_url:
            return self.db_url
        os.makedirs(_data_dir(), exist_ok=True)
        return f"sqlite:///{os.path.join(_data_dir(), 'ckptstore.db')}"

    @cached_property
    def default_storage(self) -> str:
        return self.storage or os.path.join(_data_dir(), "checkpoints")

    @cached_property
    def allowed_roots(self) -> list[str]:
        roots = [r.strip() for r in self.storage_roots.split(",") if r.strip()]
        return roots or [self.default_storage]

    @cached_property
    def webhook_host_list(self) -> frozenset[str]:
        return frozenset(h.strip().lower() for h in self.webhook_hosts.split(",") if h.strip())

    @cached_property
    def accepted_hosts(self) -> frozenset[str] | None:
        """The Host names served (None: any). Bound to loopback without a token, loopback names only:
        a DNS name rebound to 127.0.0.1 must not reach an unauthenticated service."""
        names = {h.strip().lower() for h in self.trusted_hosts.split(",") if h.strip()}
        if "*" in names:
            return None
        if names:
            return frozenset(names)
        if self.host in LOOPBACK_NAMES and not self.has_tokens:
            return LOOPBACK_NAMES
        return None
