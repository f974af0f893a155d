"""The wire schema: JSON bodies the service and its clients exchange (pydantic v2 models).

Both sides import these, so a field can only change in one place. Request models forbid unknown
fields; names, attempts and positions are validated with the same rules as storage keys.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from ckptstore.names import NAME_JSON_SCHEMA, validate_attempt, validate_name
from ckptstore.position import POSITION_LIMIT, Position
from ckptstore.retention import RetentionPolicy

__all__ = [
    "Name",
    "AttemptId",
    "Count",
    "PositionBody",
    "RetentionSpec",
    "JobSpec",
    "JobInfo",
    "AttemptRequest",
    "AttemptInfo",
    "CommitRequest",
    "CheckpointRecord",
    "MarkRequest",
    "NodeLocation",
    "NotGood",
    "LastGood",
    "HealthReport",
    "NodeHealth",
    "ProbeResult",
    "JobHealth",
    "StatsReport",
    "StatsRow",
    "StatsSummary",
    "GcDeletion",
    "GcPlan",
    "ErrorBody",
    "CheckpointState",
]

Name = Annotated[
    str, Field(min_length=1, max_length=128, json_schema_extra=NAME_JSON_SCHEMA), AfterValidator(validate_name)
]
AttemptId = Annotated[str | int, AfterValidator(validate_attempt)]
Count = Annotated[int, Field(ge=0, lt=POSITION_LIMIT, strict=True)]
CheckpointState = Literal["committed", "corrupt", "deleted"]
MAX_NODES = 4096


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PositionBody(_Request):
    epoch: Count
    batch: Count | None = None

    def to_position(self) -> Position:
        return Position(self.epoch, self.batch)

    @classmethod
    def of(cls, position: Position | None) -> PositionBody | None:
        return None if position is None else cls(epoch=position.epoch, batch=position.batch)


class RetentionSpec(_Request):
    keep_last: int | None = Field(default=None, ge=1, le=10**6)
    keep_every: int | None = Field(default=None, ge=1, le=10**6)
    keep_best: int | None = Field(default=None, ge=1, le=10**6)
    best_metric: str | None = Field(default=None, min_length=1, max_length=128)
    best_mode: Literal["min", "max"] = "min"
    grace_seconds: float = Field(default=3600.0, ge=0, le=10**8)

    @model_validator(mode="after")
    def _best_pair(self) -> RetentionSpec:
        self.to_policy()
        return self

    def to_policy(self) -> RetentionPolicy:
        return RetentionPolicy(**self.model_dump())


class JobSpec(_Request):
    nodes: list[Name] = Field(min_length=1, max_length=MAX_NODES)
    storage_root: str | None = Field(default=None, min_length=1, max_length=1024)
    retention: RetentionSpec = Field(default_factory=RetentionSpec)

    @model_validator(mode="after")
    def _unique_nodes(self) -> JobSpec:
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError("nodes must be unique")
        return self


class JobInfo(BaseModel):
    job: str
    nodes: list[str]
    storage_root: str
    retention: RetentionSpec
    last_good_epoch: int | None
    resume: PositionBody | None
    created_at: float
    updated_at: float


class AttemptRequest(_Request):
    resumed_from: PositionBody | None = None


class AttemptInfo(BaseModel):
    job: str
    node: str
    attempt: int
    resumed_from: PositionBody | None
    started_at: float


class CommitRequest(_Request):
    epoch: Count
    batch: Count | None = None
    attempt: AttemptId
    step: Count | None = None
    location: str = Field(min_length=1, max_length=2048)
    bytes: int = Field(ge=0, lt=2**62, strict=True)
    checksums: dict[Annotated[str, Field(max_length=256)], Annotated[str, Field(max_length=64)]] = Field(
        default_factory=dict, max_length=100_000
    )
    metrics: dict[Annotated[str, Field(max_length=128)], float] = Field(default_factory=dict, max_length=256)

    @property
    def position(self) -> Position:
        return Position(self.epoch, self.batch)


class CheckpointRecord(BaseModel):
    job: str
    node: str
    epoch: int
    batch: int | None
    attempt: str
    step: int | None
    location: str
    bytes: int
    checksums: dict[str, str]
    metrics: dict[str, float]
    state: CheckpointState
    created_at: float


class MarkRequest(_Request):
    epoch: Count
    batch: Count | None = None
    attempt: AttemptId | None = None
    state: Literal["corrupt", "deleted"]
    reason: str | None = Field(default=None, max_length=1000)


class NodeLocation(BaseModel):
    location: str
    attempt: str


class NotGood(BaseModel):
    epoch: int
    batch: int | None
    missing: list[str]
    corrupt: list[str]


class LastGood(BaseModel):
    job: str
    epoch: int | None
    resume: PositionBody | None
    nodes: dict[str, NodeLocation]
    not_good: list[NotGood]


class HealthReport(_Request):
    cp_accessible: bool
    latency_ms: float | None = Field(default=None, ge=0, le=10**9)
    error: str | None = Field(default=None, max_length=2000)


class NodeHealth(BaseModel):
    node: str
    cp_accessible: bool | None
    latency_ms: float | None
    error: str | None
    reported_at: float | None
    stale: bool


class ProbeResult(BaseModel):
    cp_accessible: bool
    latency_ms: float | None
    error: str | None


class JobHealth(BaseModel):
    job: str
    nodes: list[NodeHealth]
    probe: ProbeResult | None = None


class StatsReport(_Request):
    node: Name
    action: Literal["save", "load", "restore", "verify", "delete", "blocked"]
    seconds: float = Field(ge=0, le=10**7)
    bytes: int | None = Field(default=None, ge=0, lt=2**62)


class StatsRow(BaseModel):
    action: str
    node: str
    count: int
    mean: float
    p50: float
    p95: float
    max: float
    bytes: int


class StatsSummary(BaseModel):
    job: str
    rows: list[StatsRow]


class GcDeletion(BaseModel):
    node: str
    epoch: int
    batch: int | None
    attempt: str
    location: str
    reason: str


class GcPlan(BaseModel):
    job: str
    last_good_epoch: int | None
    resume: PositionBody | None
    deletions: list[GcDeletion]


class ErrorBody(BaseModel):
    error: Literal[
        "invalid", "not_found", "conflict", "fenced", "unauthorized", "forbidden", "too_large", "unavailable"
    ]
    detail: str
    extra: dict[str, Any] | None = None
