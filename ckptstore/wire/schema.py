"""The wire schema: JSON bodies the service and its clients exchange (pydantic v2 models) — jobs,
checkpoints, attempts and their answers, and what nodes report besides commits: storage health
(cp_accessible, replication lag) and timing statistics (`/health`, `/stats`).

Both sides import these, so a field can only change in one place. Request models forbid unknown
fields; names, attempts and positions are validated with the same rules as storage keys.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from ckptstore.copykey import CopyKey
from ckptstore.names import ACCEPTED_ATTEMPT_LIMIT, NAME_JSON_SCHEMA, Tier, validate_attempt, validate_name
from ckptstore.position import POSITION_LIMIT, Position
from ckptstore.retention import RetentionPolicy

__all__ = [
    "BlobServerInfo",
    "BlobServerRegistration",
    "PEER_SCHEME",
    "peer_holder",
    "CheckpointRequestBody",
    "CheckpointRequestInfo",
    "RequestModel",
    "Name",
    "AttemptId",
    "Count",
    "PositionBody",
    "RetentionSpec",
    "ForkPoint",
    "JobSpec",
    "JobInfo",
    "Lineage",
    "AttemptRequest",
    "AttemptInfo",
    "ResumeAudit",
    "CommitRequest",
    "NodeCommit",
    "CommitBatch",
    "CommitOutcome",
    "COMMIT_BATCH_LIMIT",
    "CheckpointRecord",
    "MarkRequest",
    "MarkCause",
    "RETENTION_CAUSES",
    "DELETED_ON_PURPOSE",
    "NodeLocation",
    "NotGood",
    "LastGood",
    "StoredCopy",
    "StartRequest",
    "NodeStart",
    "PlannedDeletion",
    "RetentionPlan",
    "ErrorBody",
    "CheckpointState",
    "MarkState",
    "SkippedCopy",
    "ResumeReport",
    "ResumeAgreement",
    "CopyInfo",
    "Advice",
    "HealthReport",
    "ReplicationLag",
    "NodeHealth",
    "ProbeResult",
    "JobHealth",
    "StatsAction",
    "StatsReport",
    "StatsRow",
    "StatsSummary",
]

Name = Annotated[
    str, Field(min_length=1, max_length=128, json_schema_extra=NAME_JSON_SCHEMA), AfterValidator(validate_name)
]
# One attempt type on the wire: the canonical string ("3", or "3-1a2b3c4d" offline); requests may send
# a service attempt as a JSON number, never as a boolean.
AttemptId = Annotated[
    str,
    BeforeValidator(validate_attempt),
    Field(json_schema_extra={"pattern": r"^[1-9][0-9]{0,9}(-[0-9a-f]{8})?$"}),
]
Count = Annotated[int, Field(ge=0, lt=POSITION_LIMIT, strict=True)]
Finite = Annotated[float, Field(allow_inf_nan=False)]  # JSON has no NaN or Infinity: refuse, never store null
CheckpointState = Literal["committed", "corrupt", "missing", "deleted"]
MarkState = Literal["corrupt", "missing", "deleted"]
# Which part of ckptstore marked a copy: retention and gc deletions are `retention.deleted` events,
# `agreement` marks (replicas that disagree at a save) `replicas.disagreed` ones, every other mark a
# `copy.marked` one; `operator` is anyone calling the API by hand.
MarkCause = Literal["retention", "gc", "fit_finished", "restore", "verify", "replication", "agreement", "operator"]
RETENTION_CAUSES: tuple[MarkCause, ...] = ("retention", "gc")
DELETED_ON_PURPOSE: tuple[MarkCause, ...] = (*RETENTION_CAUSES, "fit_finished")  # nothing went wrong there
MAX_NODES = 4096


class RequestModel(BaseModel):
    """What a client sends: an unknown field is refused, not ignored."""

    model_config = ConfigDict(extra="forbid")


class PositionBody(RequestModel):
    epoch: Count
    batch: Count | None = None

    def to_position(self) -> Position:
        return Position(self.epoch, self.batch)

    @classmethod
    def of(cls, position: Position | None) -> PositionBody | None:
        return None if position is None else cls(epoch=position.epoch, batch=position.batch)


class RetentionSpec(RequestModel):
    keep_last: int | None = Field(default=None, ge=1, le=10**6)
    keep_every: int | None = Field(default=None, ge=1, le=10**6)
    keep_best: int | None = Field(default=None, ge=1, le=10**6)
    best_metric: str | None = Field(default=None, min_length=1, max_length=128)
    best_mode: Literal["min", "max"] = "min"
    grace_seconds: float = Field(default=3600.0, ge=0, le=10**8, allow_inf_nan=False)

    @model_validator(mode="after")
    def _best_pair(self) -> RetentionSpec:
        self.to_policy()
        return self

    def to_policy(self) -> RetentionPolicy:
        return RetentionPolicy(**self.model_dump())


class ForkPoint(RequestModel):
    """A checkpoint a job was forked from: its job and position."""

    job: Name
    position: PositionBody

    def __str__(self) -> str:
        """As `fork_from=` takes it: `job@epoch` or `job@epoch.bBATCH`."""
        batch = "" if self.position.batch is None else f".b{self.position.batch}"
        return f"{self.job}@{self.position.epoch}{batch}"


class JobSpec(RequestModel):
    nodes: list[Name] = Field(min_length=1, max_length=MAX_NODES)
    parent: ForkPoint | None = Field(
        default=None, description="the checkpoint this job was forked from (set once; null keeps what is set)"
    )
    storage_root: str | None = Field(default=None, min_length=1, max_length=1024)
    local_root: str | None = Field(
        default=None, min_length=1, max_length=1024, description="the nodes' local tier (a path on each node)"
    )
    retention: RetentionSpec = Field(default_factory=RetentionSpec)

    @model_validator(mode="after")
    def _unique_nodes(self) -> JobSpec:
        if len({node.casefold() for node in self.nodes}) != len(self.nodes):
            raise ValueError(
                "nodes must be unique, also ignoring case (on case-insensitive storage they share a folder)"
            )
        return self


class JobInfo(BaseModel):
    job: str
    nodes: list[str]
    storage_root: str
    local_root: str | None
    retention: RetentionSpec
    last_good_epoch: int | None
    durable_epoch: int | None
    resume: PositionBody | None
    created_at: float
    updated_at: float
    parent: ForkPoint | None = None


class Lineage(BaseModel):
    """A job's ancestry: the checkpoint it was forked from, that job's own parent and so on (nearest
    first), and the jobs forked from it (with the position each was forked at)."""

    job: str
    parent: ForkPoint | None
    ancestors: list[ForkPoint]
    children: list[ForkPoint]


class AttemptRequest(RequestModel):
    resumed_from: PositionBody | None = None
    at_least: int | None = Field(
        default=None,
        ge=1,
        lt=ACCEPTED_ATTEMPT_LIMIT,
        strict=True,
        description="number this attempt at least so (reindex raises a counter in one request)",
    )


class SkippedCopy(RequestModel):
    """A copy a restore passed over, and why (the restart history shows it)."""

    epoch: Count
    batch: Count | None = None
    attempt: AttemptId
    tier: Tier
    state: Literal["corrupt", "missing"]
    reason: str = Field(max_length=1000)


class ResumeReport(RequestModel):
    """Where a process resumed from, after verifying its part there, and what it skipped on the way."""

    resumed_from: PositionBody | None
    skipped: list[SkippedCopy] = Field(default_factory=list, max_length=1000)


class ResumeAudit(RequestModel):
    """A restore's audit (ckptstore.fingerprint): the saved run's fingerprint against the live one —
    `exact` (declared and proven: the first batch and counters after the restore were the saved
    run's next); `resharded` (another world size, the data order continued globally: the differences
    say from what to what); `drift` with every difference named; or `unverified` (the data could not
    be observed: the differences say what was not)."""

    position: PositionBody | None
    verdict: Literal["exact", "resharded", "drift", "unverified"]
    differences: list[Annotated[str, Field(max_length=1000)]] = Field(default_factory=list, max_length=200)

    @model_validator(mode="after")
    def _verdict_follows_the_differences(self) -> ResumeAudit:
        if (self.verdict == "exact") != (not self.differences):
            raise ValueError("an audit is exact exactly when it names no difference")
        return self


class AttemptInfo(BaseModel):
    job: str
    node: str
    attempt: AttemptId
    resumed_from: PositionBody | None
    skipped: list[SkippedCopy] = Field(default_factory=list)
    started_at: float
    resumed_at: float | None = None
    audit: ResumeAudit | None = None


class ResumeAgreement(BaseModel):
    """Whether every expected node verified its part of the resume position in this restart; the nodes
    still waited for (the first 100 named, all counted)."""

    job: str
    resume: PositionBody | None
    agreed: bool
    waiting: list[str]
    waiting_count: int = 0


class CommitRequest(RequestModel):
    epoch: Count
    batch: Count | None = None
    attempt: AttemptId
    step: Count | None = None
    location: str = Field(min_length=1, max_length=2048)
    bytes: int = Field(ge=0, lt=2**62, strict=True)
    checksums: dict[Annotated[str, Field(max_length=256)], Annotated[str, Field(max_length=64)]] = Field(
        default_factory=dict, max_length=100_000
    )
    metrics: dict[Annotated[str, Field(max_length=128)], Finite] = Field(default_factory=dict, max_length=256)
    tier: Tier = "durable"

    @property
    def position(self) -> Position:
        return Position(self.epoch, self.batch)


class CheckpointRecord(BaseModel):
    job: str
    node: str
    epoch: int
    batch: int | None
    attempt: AttemptId
    step: int | None
    location: str
    bytes: int
    checksums: dict[str, str]
    metrics: dict[str, float]
    tier: Tier
    state: CheckpointState
    reason: str | None = None
    cause: str | None = None  # who marked it (a MarkCause), when it is marked
    created_at: float

    @property
    def key(self) -> CopyKey:
        return CopyKey(self.job, self.node, Position(self.epoch, self.batch), self.attempt, self.tier)


COMMIT_BATCH_LIMIT = 256


class NodeCommit(CommitRequest):
    """One commit of a batch: a `CommitRequest` that names its node."""

    node: Name


class CommitBatch(RequestModel):
    """Several commits of one job in one request (re-posting after an outage, reindex)."""

    commits: list[NodeCommit] = Field(min_length=1, max_length=COMMIT_BATCH_LIMIT)


class CommitOutcome(BaseModel):
    """One commit's answer within a batch: the status it would have had alone, and its record or error."""

    status: int
    record: CheckpointRecord | None = None
    error: ErrorBody | None = None


class MarkRequest(RequestModel):
    """Mark one attempt (default: the newest) of a node's position; on one tier, or on every tier."""

    epoch: Count
    batch: Count | None = None
    attempt: AttemptId | None = None
    tier: Tier | None = None
    state: MarkState
    cause: MarkCause = Field(default="operator", description="which part of ckptstore marks it (sets the event type)")
    reason: str | None = Field(default=None, max_length=1000)


class CopyInfo(BaseModel):
    tier: Tier
    location: str
    state: CheckpointState


class NodeLocation(BaseModel):
    """Where a node's part of a position is: the durable copy's location when it has one, and every copy."""

    location: str
    attempt: AttemptId
    copies: list[CopyInfo] = Field(default_factory=list)


class NotGood(BaseModel):
    """A position newer than the answer that is not good: which nodes' parts are missing, corrupt or
    deleted, and why, by node, where a reason was recorded (`replicas disagree: rank 1, tensor …`)."""

    epoch: int
    batch: int | None
    missing: list[str]
    corrupt: list[str]
    deleted: list[str] = Field(default_factory=list)
    reasons: dict[str, str] = Field(default_factory=dict)


PEER_SCHEME = "peer://"  # a peer copy's location: peer://<holding node>/<job>/<node>/<position>/<attempt>


def peer_holder(location: str) -> str | None:
    """The node that holds the peer copy at `location` (None: not a peer copy's location)."""
    if not location.startswith(PEER_SCHEME):
        return None
    return location.removeprefix(PEER_SCHEME).split("/", 1)[0]


class BlobServerRegistration(RequestModel):
    """Where a training process's peer blob server answers (`ckptstore.client.peers`), and the token it asks
    of readers: a secret of that process, handed only to those who may read the job on the service."""

    url: str = Field(pattern=r"^https?://[^/\s]+$", max_length=512)
    token: str = Field(min_length=16, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")


class BlobServerInfo(BaseModel):
    """A node's registered blob server (`PUT …/nodes/{node}/blob-server`)."""

    node: str
    url: str
    token: str
    registered_at: float


class CheckpointRequestBody(RequestModel):
    """Ask every running node of a job to save at its next step (`POST …/checkpoint-requests`)."""

    reason: str | None = Field(default=None, max_length=500)


class CheckpointRequestInfo(BaseModel):
    """A checkpoint request: the event that carries it (`id`), each expected node's newest committed
    position when it was made (`nodes`; None: none yet), and the nodes that have not committed a newer
    one since (`pending`). `coalesced`: this answer is an earlier request still pending, not a new one."""

    id: int
    job: str
    requested_at: float
    reason: str | None = None
    nodes: dict[str, PositionBody | None]
    pending: list[str]
    coalesced: bool = False


class LastGood(BaseModel):
    job: str
    epoch: int | None
    durable_epoch: int | None = None
    resume: PositionBody | None
    nodes: dict[str, NodeLocation]
    not_good: list[NotGood]


class StoredCopy(RequestModel):
    """A committed copy that a starting node found on its own storage."""

    epoch: Count
    batch: Count | None = None
    attempt: AttemptId
    tier: Tier = "durable"


class StartRequest(RequestModel):
    """A node's start in one request: the job's declaration as the node checked it (its `updated_at`)
    and the committed copies it holds on storage. The service registers a new attempt only while that
    declaration is the job's and it knows every copy listed; else it changes nothing and says why."""

    declared_at: Finite
    stored: list[StoredCopy] = Field(default_factory=list, max_length=100_000)


class NodeStart(BaseModel):
    """The answer to a start: the new attempt and the node's part of the last-good answer — or, with
    `attempt` null, why nothing was registered (`unknown`: the listed copies the service lacks)."""

    attempt: AttemptInfo | None
    refused: str | None = None
    unknown: list[StoredCopy] = Field(default_factory=list)
    resume: LastGood | None = None


class PlannedDeletion(BaseModel):
    node: str
    epoch: int
    batch: int | None
    attempt: AttemptId
    tier: Tier = "durable"
    location: str
    reason: str

    def key(self, job: str) -> CopyKey:
        """The copy to delete, of `job` (the plan's)."""
        return CopyKey(job, self.node, Position(self.epoch, self.batch), self.attempt, self.tier)


class RetentionPlan(BaseModel):
    job: str
    last_good_epoch: int | None
    resume: PositionBody | None
    deletions: list[PlannedDeletion]


class ErrorBody(BaseModel):
    error: Literal[
        "invalid",
        "not_found",
        "conflict",
        "fenced",
        "unauthorized",
        "forbidden",
        "too_large",
        "too_many",
        "unavailable",
    ]
    detail: str
    extra: dict[str, Any] | None = None


class HealthReport(RequestModel):
    cp_accessible: bool
    latency_ms: float | None = Field(default=None, ge=0, le=10**9, allow_inf_nan=False)
    error: str | None = Field(default=None, max_length=2000)


class ReplicationLag(BaseModel):
    """A node's local copies not yet on the durable tier: how many, and how long the oldest has waited."""

    pending: int
    oldest_pending_seconds: float | None
    newest_local: PositionBody | None
    newest_durable: PositionBody | None


class NodeHealth(BaseModel):
    node: str
    cp_accessible: bool | None
    latency_ms: float | None
    error: str | None
    reported_at: float | None
    stale: bool
    replication: ReplicationLag | None = None


class ProbeResult(BaseModel):
    cp_accessible: bool
    latency_ms: float | None
    error: str | None


class JobHealth(BaseModel):
    job: str
    nodes: list[NodeHealth]
    probe: ProbeResult | None = None


StatsAction = Literal["save", "load", "restore", "verify", "delete", "blocked"]


class StatsReport(RequestModel):
    node: Name
    action: StatsAction
    seconds: float = Field(ge=0, le=10**7, allow_inf_nan=False)
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


class Advice(BaseModel):
    """A job's goodput and recommended checkpoint interval from its own records (server/records/advice.py);
    null where its history is too short to say."""

    job: str
    goodput: float | None = None
    wall_seconds: float | None = None
    lost_seconds: float | None = None
    blocked_seconds: float | None = None
    failures: int = 0
    mtbf_seconds: float | None = None
    save_cost_seconds: float | None = None
    interval_seconds: float | None = None
    interval_steps: int | None = None
    note: str | None = None
