"""Service configuration from `CKPTSTORE_*` environment variables (pydantic-settings)."""

from __future__ import annotations

import os
from functools import cached_property

from platformdirs import user_data_dir
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ckptstore.names import validate_name

__all__ = ["Settings", "root_is_allowed"]


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
    for candidate in allowed:
        allowed_scheme, allowed_parts = _segments(candidate)
        if scheme == allowed_scheme and parts[: len(allowed_parts)] == allowed_parts:
            return True
    return False


class Settings(BaseSettings):
    """Everything the service reads from its environment; see docs in README "Configuration"."""

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
    max_body_bytes: int = Field(default=1 << 20, ge=1024, description="largest request body accepted (413 above)")
    trusted_hosts: str = Field(default="*", description="comma-separated Host headers accepted (400 otherwise)")
    health_stale_seconds: float = Field(
        default=300.0, gt=0, description="a node's health report older than this is shown as stale"
    )
    answer_cache_size: int = Field(default=16384, ge=0, description="last-good answers cached per worker")
    log_level: str = Field(default="info", description="debug, info, warning or error")

    @field_validator("job_tokens")
    @classmethod
    def _job_tokens_name_real_jobs(cls, value: dict[str, SecretStr]) -> dict[str, SecretStr]:
        for job, secret in value.items():
            validate_name(job, kind="job")
            if len(secret.get_secret_value()) < 8:
                raise ValueError(f"the token of job {job!r} is shorter than 8 characters")
        return value

    @field_validator("token", mode="before")
    @classmethod
    def _empty_token_is_none(cls, value: object) -> object:
        return None if value == "" else value

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
    def trusted_host_list(self) -> list[str]:
        return [h.strip() for h in self.trusted_hosts.split(",") if h.strip()] or ["*"]
