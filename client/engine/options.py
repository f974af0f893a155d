"""The options of a training process's checkpointing, declared once and resolved once.

`BackupAndRestore`, `CheckpointManager` and the node checkpointer take the same keyword options;
`CheckpointOptions.resolve(**options)` fills what is not given from the `CKPTSTORE_*` variables,
checks every value, and returns one frozen object that the layers below share. Unknown names
raise TypeError, as a mistyped keyword argument would.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import fsspec
import httpx

from ckptstore.client.engine.fork import parse_fork_point
from ckptstore.format.codec import Codec, check_codec
from ckptstore.names import validate_name
from ckptstore.wire.schema import ForkPoint

__all__ = [
    "CheckpointOptions",
    "OnError",
    "service_url_from_env",
    "service_urls",
    "check_service_url",
    "check_storage_url",
]

OnError = Literal["warn", "raise"]
ResumeCheck = Literal["warn", "raise", "off"]
_NONE_IS_A_VALUE = frozenset({"max_to_keep"})


def service_url_from_env() -> str | None:
    """The service URL from CKPTSTORE_URL (None when unset or empty): the one place it is read."""
    return os.environ.get("CKPTSTORE_URL") or None


def check_storage_url(url: str) -> str:
    """`url` unless it looks like a URL mistyped — a slash missing (`s3:/ckpt/jobs` would otherwise
    become a local folder named `s3:`) or the colon (`s3//ckpt/jobs`, a relative folder `s3/` whose
    name is a storage protocol's); ValueError in one line."""
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]+):(?!//)", url)
    if scheme is None:
        scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]+)//", url)
        if scheme is not None and scheme.group(1) not in fsspec.available_protocols():
            scheme = None
    if scheme is not None:
        raise ValueError(f"storage URL {url!r} is not a URL (did you mean '{scheme.group(1)}://…'?) nor a local path")
    return url


def service_urls(value: str | Sequence[str] | None) -> list[str]:
    """The service URLs of `service=` / CKPTSTORE_URL: one, a comma-separated list, or a sequence."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [item.strip() for item in items if item.strip()]


def check_service_url(url: str) -> str:
    """`url` if it is an http(s) URL with a host; ValueError in one line otherwise (a URL without
    `http://` would otherwise look like a service that never answers)."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise ValueError(f"invalid service URL {url!r}: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"invalid service URL {url!r}: expected http://host:port or https://host")
    if parsed.path not in ("", "/") or parsed.query or parsed.fragment:
        raise ValueError(
            f"invalid service URL {url!r}: give the service's root (http://host:port), without a path such as "
            f"{parsed.path!r}: ckptstore adds /v1/… itself"
        )
    return url


@dataclass(frozen=True)
class CheckpointOptions:
    """How this process checkpoints.

    job: the job name (default CKPTSTORE_JOB; the Keras callback falls back to "keras").
    storage: the storage root — the durable tier —, any fsspec URL (default CKPTSTORE_STORAGE; required).
    local_storage: a fast local tier on this node (default CKPTSTORE_LOCAL_STORAGE; None: none): saves
        commit there and are replicated to `storage` in the background.
    local_max_to_keep: positions kept on the local tier (older ones go once they are on the durable tier);
        also the copies of each node kept as peer replicas.
    peer_replicas: keep each committed local copy on the local tiers of this many other nodes of the job
        too — the next ones in the declared node order (default CKPTSTORE_PEER_REPLICAS, else 0): a node back on
        a new machine restores from a peer's disk, not the durable tier. Needs `local_storage` and
        `service` (docs/operations.md, "Peer replicas").
    service: the service URL, or several replicas' (a list, or comma-separated; default CKPTSTORE_URL;
        None: storage only): a replica that fails is skipped for the next.
    node: this process's node name (default: CKPTSTORE_NODE, TF_CONFIG, RANK, …, the host name).
    storage_options: options for the fsspec filesystem (endpoint_url, key, …).
    presigned: the durable tier without storage credentials: every read and write goes through
        short-lived URLs the service signs for this node (default CKPTSTORE_PRESIGNED; needs `service` and
        an s3:// or gs:// `storage`; docs/operations.md, "Presigned URLs").
    token: bearer token for the service (default CKPTSTORE_TOKEN).
    on_error: "warn" skips a save that storage refuses and goes on; "raise" stops training.
    async_save: write in the background (the save returns once the state is copied to host memory).
    max_to_keep: the job's retention keep_last (newest positions kept, mid-epoch ones counted; the last
        good epoch is kept besides); applied to the job on start, declared by hand or not. None: keep all.
    nodes: the job's expected nodes, declared on first start: a list of names, or a count (nodes
        `node-0` … `node-{N-1}`, the names RANK gives). Default: WORLD_SIZE when the node name comes
        from RANK, else just this node.
    strict: restore refuses a checkpoint that does not fit every variable (False: what fits).
    fresh_start: when intact copies of the job exist but none qualifies to resume from, train from
        scratch instead of raising ResumeRefusedError (default CKPTSTORE_FRESH_START; a position that
        qualifies is still resumed).
    resume_check: what a restore does when its audit finds drift — the live run differs from the saved
        one (docs/pytorch.md, "Resume audit"): "warn" says every difference once, loudly; "raise"
        refuses with ResumeDriftError before anything is assigned; "off" audits nothing
        (default CKPTSTORE_RESUME_CHECK, else "warn").
    save_timeout_s: how long one save may retry a storage that fails now before it is given up
        (skipped and counted); meanwhile later saves are skipped, never waited for. A synchronous
        save (async_save=False) holds training, so it retries 10 s at most.
    preemption_budget_s: how long a SIGTERM may take to checkpoint before the process exits.
    restore_timeout_s: how long a restore waits for every node of the job to verify the same position.
    storage_wait_s: how long a start waits for a durable tier that does not answer before it decides
        (default CKPTSTORE_STORAGE_WAIT_S, else 60 s):
        a job with checkpoints (or one the service cannot vouch for) is then refused with
        ResumeRefusedError rather than started over copies it cannot see (unless `fresh_start`); a new
        job starts and says so; copies on an answering local tier are resumed from.
    codec: store the durable tier's blobs encoded, "bytegroup-zstd" (default CKPTSTORE_CODEC; None: plain
        safetensors): lossless, about 1.46× smaller bf16 weights and 1.19× fp32 optimizer moments, at
        about 0.3 GB/s a stream to encode here — worth it only where the durable tier is slower than
        that (a remote object store over a modest link); with `local_storage`, replication encodes in
        the background and the local tier stays plain. A blob that would not shrink is stored plain.
    fork_from: start this job from another job's checkpoint, "job@epoch" or "job@epoch.bBATCH" (default
        CKPTSTORE_FORK_FROM), while it has none of its own: each node resumes from the parent's copy of
        the same node there, and its first save writes only what changed (`ckptstore.client.engine.fork`).
    fork_token: the parent job's token (default CKPTSTORE_FORK_TOKEN), when this job's `token` is a job
        token: declaring a fork reads the parent's checkpoints, which a job token alone may not.
    """

    job: str
    storage: str
    local_storage: str | None = None
    local_max_to_keep: int = 2
    peer_replicas: int = 0
    service: str | list[str] | None = None
    node: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    presigned: bool = False
    token: str | None = None
    on_error: OnError = "warn"
    async_save: bool = True
    max_to_keep: int | None = 5
    nodes: int | list[str] | None = None
    strict: bool = True
    fresh_start: bool = False
    resume_check: ResumeCheck = "warn"
    save_timeout_s: float = 120.0
    preemption_budget_s: float = 30.0
    restore_timeout_s: float = 600.0
    storage_wait_s: float = 60.0
    fork_from: str | None = None
    fork_token: str | None = None
    codec: Codec | None = None

    @classmethod
    def resolve(cls, *, default_job: str | None = None, **options: Any) -> CheckpointOptions:
        """Options from keyword arguments, then CKPTSTORE_* variables, then defaults; checked."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unexpected option(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        # None means "not given", but for max_to_keep, where it means "keep all".
        given = {name: value for name, value in options.items() if value is not None or name in _NONE_IS_A_VALUE}
        given.setdefault("job", os.environ.get("CKPTSTORE_JOB") or default_job)
        given.setdefault("storage", os.environ.get("CKPTSTORE_STORAGE"))
        given.setdefault("local_storage", os.environ.get("CKPTSTORE_LOCAL_STORAGE") or None)
        given.setdefault("service", service_url_from_env())
        given.setdefault("token", os.environ.get("CKPTSTORE_TOKEN") or None)
        given.setdefault("fork_from", os.environ.get("CKPTSTORE_FORK_FROM") or None)
        given.setdefault("fork_token", os.environ.get("CKPTSTORE_FORK_TOKEN") or None)
        given.setdefault("codec", os.environ.get("CKPTSTORE_CODEC") or None)
        given.setdefault("resume_check", os.environ.get("CKPTSTORE_RESUME_CHECK") or "warn")
        given.setdefault("fresh_start", _flag("CKPTSTORE_FRESH_START"))
        given.setdefault("presigned", _flag("CKPTSTORE_PRESIGNED"))
        if os.environ.get("CKPTSTORE_PEER_REPLICAS"):
            given.setdefault("peer_replicas", int(os.environ["CKPTSTORE_PEER_REPLICAS"]))
        if os.environ.get("CKPTSTORE_STORAGE_WAIT_S"):
            given.setdefault("storage_wait_s", float(os.environ["CKPTSTORE_STORAGE_WAIT_S"]))
        if not given["job"]:
            raise ValueError("no job: pass job= or set CKPTSTORE_JOB")
        if not given["storage"]:
            raise ValueError("no storage: pass storage= (backup_dir= for Keras) or set CKPTSTORE_STORAGE")
        resolved = cls(**given)
        resolved._check()
        return resolved

    def expected_nodes(self, node: str) -> list[str]:
        """The node names to declare the job with (`node` is this process's)."""
        nodes = self.nodes
        if nodes is None and os.environ.get("WORLD_SIZE", "").isdigit() and node.startswith("node-"):
            nodes = int(os.environ["WORLD_SIZE"])
        if nodes is None:
            return [node]
        return [f"node-{i}" for i in range(nodes)] if isinstance(nodes, int) else list(nodes)

    @property
    def parent(self) -> ForkPoint | None:
        """The checkpoint this job forks from (`fork_from`, parsed)."""
        return None if self.fork_from is None else parse_fork_point(self.fork_from)

    def _check(self) -> None:
        validate_name(self.job, kind="job")
        if self.parent is not None and self.parent.job == self.job:
            raise ValueError(f"fork_from {self.fork_from!r} names this job itself")
        if self.node is not None:
            validate_name(self.node, kind="node")
        if isinstance(self.nodes, bool) or (isinstance(self.nodes, int) and not 1 <= self.nodes <= 4096):
            raise ValueError(f"nodes must be a list of names or a count from 1 to 4096, got {self.nodes!r}")
        if isinstance(self.nodes, list):
            for name in self.nodes:
                validate_name(name, kind="node")
        for url in (self.storage, self.local_storage):
            if url is not None:
                check_storage_url(url)
        for url in service_urls(self.service):
            check_service_url(url)
        check_codec(self.codec)
        if self.presigned and (not self.service or not self.storage.startswith(("s3://", "gs://"))):
            raise ValueError("presigned=True needs the service (it signs the URLs) and an s3:// or gs:// storage root")
        if self.on_error not in ("warn", "raise"):
            raise ValueError(f"on_error must be 'warn' or 'raise', got {self.on_error!r}")
        if self.resume_check not in ("warn", "raise", "off"):
            raise ValueError(f"resume_check must be 'warn', 'raise' or 'off', got {self.resume_check!r}")
        if self.max_to_keep is not None and (
            isinstance(self.max_to_keep, bool) or not isinstance(self.max_to_keep, int) or self.max_to_keep < 1
        ):
            raise ValueError(f"max_to_keep must be a positive integer or None, got {self.max_to_keep!r}")
        if min(self.preemption_budget_s, self.restore_timeout_s, self.save_timeout_s, self.storage_wait_s) < 0:
            raise ValueError(
                "preemption_budget_s, restore_timeout_s, save_timeout_s and storage_wait_s must not be negative"
            )
        if isinstance(self.local_max_to_keep, bool) or not isinstance(self.local_max_to_keep, int):
            raise ValueError(f"local_max_to_keep must be a positive integer, got {self.local_max_to_keep!r}")
        if self.local_max_to_keep < 1:
            raise ValueError(f"local_max_to_keep must be a positive integer, got {self.local_max_to_keep!r}")
        if isinstance(self.peer_replicas, bool) or not isinstance(self.peer_replicas, int) or self.peer_replicas < 0:
            raise ValueError(f"peer_replicas must be a non-negative integer, got {self.peer_replicas!r}")
        if self.peer_replicas and (self.local_storage is None or not self.service):
            raise ValueError(
                "peer_replicas needs local_storage (the copies peers keep are local copies) and the service "
                "(where the nodes' blob servers and the copies they hold are recorded)"
            )


def _flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")
