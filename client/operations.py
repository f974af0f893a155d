"""Whole-job operations behind the command line: verify, gc, reindex and copy.

Each one works on real storage and the service and returns what it found and did; the command
line only prints. Storage credentials and endpoints come from the environment the way fsspec's
backends read them (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `GOOGLE_APPLICATION_CREDENTIALS`, ...).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ckptstore import CheckpointRef, Position, Store, VerifyReport
from ckptstore.errors import CheckpointNotFoundError, FencedError
from ckptstore.layout import parse_position_dirname
from ckptstore.names import attempt_sort_key, validate_attempt, validate_name
from ckptstore.retention import Candidate, RetentionPolicy, plan_deletions
from ckptstore.schema import CheckpointRecord, JobInfo
from client.service import ServiceClient

__all__ = [
    "Checked",
    "Removal",
    "JobIndex",
    "Copied",
    "iter_records",
    "verify_job",
    "collect_garbage",
    "reindex",
    "copy",
    "split_location",
]

Progress = Callable[[int], object]
PAGE = 1000


def iter_records(client: ServiceClient, job: str, **filters: object) -> Iterator[CheckpointRecord]:
    """Every checkpoint record of a job matching `filters`, page by page."""
    offset = 0
    while True:
        page = client.list_checkpoints(job, limit=PAGE, offset=offset, **filters)
        yield from page
        if len(page) < PAGE:
            return
        offset += PAGE


# -- verify ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Checked:
    """One committed record, what verifying its bytes found, and whether the service was told."""

    record: CheckpointRecord
    report: VerifyReport
    marked_corrupt: bool


def verify_job(
    client: ServiceClient, job: str, records: list[CheckpointRecord], *, progress: Progress = lambda n: None
) -> list[Checked]:
    """Verify every shard and tensor checksum of the given committed records of a job
    (`iter_records(client, job, state="committed")` for all of them).

    A checkpoint that fails is marked corrupt in the service, so its position stops counting as good.
    """
    store = Store(client.get_job(job).storage_root)
    checked = []
    for record in records:
        try:
            report = store.verify(job, record.node, record.epoch, batch=record.batch, attempt=record.attempt)
        except CheckpointNotFoundError:
            report = VerifyReport(record.location, Position(record.epoch, record.batch), record.attempt, False)
        progress(record.bytes)
        marked = False
        if not report.ok:
            detail = "; ".join(p.detail for p in report.problems) or "not on storage"
            client.mark(
                job, record.node, report.position, "corrupt", attempt=record.attempt, reason=f"verify: {detail}"[:500]
            )
            marked = True
        checked.append(Checked(record, report, marked))
    return checked


# -- gc ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Removal:
    """One checkpoint attempt gc deleted (or would delete, on a dry run), and why."""

    node: str
    position: Position
    attempt: str
    reason: str
    location: str


def collect_garbage(
    client: ServiceClient, job: str, *, dry_run: bool = False, now: float | None = None
) -> list[Removal]:
    """Execute the service's gc-plan for every node, then remove what only storage knows of:
    uncommitted leftovers and superseded attempts older than the job's grace period."""
    info = client.get_job(job)
    store = Store(info.storage_root)
    now = time.time() if now is None else now
    plan = client.gc_plan(job)
    removals = [Removal(d.node, Position(d.epoch, d.batch), d.attempt, d.reason, d.location) for d in plan.deletions]
    planned = {(r.node, r.position, r.attempt) for r in removals}
    policy = RetentionPolicy(grace_seconds=info.retention.grace_seconds)
    for node in info.nodes:
        infos = {(i.position, i.attempt): i for i in store.list_checkpoints(job, node)}
        candidates = [
            Candidate(node, i.position, i.attempt, committed=i.committed, modified=i.modified) for i in infos.values()
        ]
        for d in plan_deletions(candidates, good=(), policy=policy, now=now):
            if (node, d.position, d.attempt) not in planned:
                location = infos[(d.position, d.attempt)].location
                removals.append(Removal(node, d.position, d.attempt, d.reason, location))
    if not dry_run:
        for removal in removals:
            _remove(client, store, job, removal)
    return removals


def _remove(client: ServiceClient, store: Store, job: str, removal: Removal) -> None:
    position = removal.position
    try:
        store.delete(job, removal.node, position.epoch, batch=position.batch, attempt=removal.attempt)
    except CheckpointNotFoundError:
        pass  # already gone: only the record is left to mark
    try:
        client.mark(job, removal.node, position, "deleted", attempt=removal.attempt, reason=f"gc: {removal.reason}")
    except CheckpointNotFoundError:
        pass  # storage-only leftovers have no record


# -- reindex -----------------------------------------------------------------------------------


@dataclass
class JobIndex:
    """What reindex found for one job under a root: differences between storage and the service,
    and (unless checking) what it changed to remove them."""

    job: str
    created: bool = False
    missing_in_service: list[CheckpointRef] = field(default_factory=list)
    missing_on_storage: list[CheckpointRecord] = field(default_factory=list)
    counters_behind: dict[str, tuple[int, int]] = field(default_factory=dict)  # node → (service, storage)
    applied: bool = False

    @property
    def differences(self) -> int:
        return (
            int(self.created) + len(self.missing_in_service) + len(self.missing_on_storage) + len(self.counters_behind)
        )


def reindex(client: ServiceClient, root: str, *, check: bool = False) -> list[JobIndex]:
    """Rebuild the service's records of every job under `root` from the manifests on storage.

    For each job: declare it if the service does not know it (nodes = the node folders found,
    default retention), post every committed checkpoint the service lacks (with the metrics its
    manifest carries), then register attempts until each node's attempt counter is at least the
    highest attempt on storage. With `check=True` nothing is written; the differences are returned.
    Records of checkpoints missing on storage are reported, never changed.
    """
    store = Store(root)
    results = []
    for job in store.list_jobs():
        nodes = store.list_nodes(job)
        result = JobIndex(job)
        try:
            info: JobInfo | None = client.get_job(job)
        except CheckpointNotFoundError:
            info, result.created = None, True
        committed: list[CheckpointRef] = []
        highest: dict[str, int] = {}
        for node in nodes:
            for found in store.list_checkpoints(job, node):
                highest[node] = max(highest.get(node, 0), attempt_sort_key(found.attempt)[0])
                if found.manifest is not None:
                    committed.append(CheckpointRef.of(found.location, found.manifest))
        records = [] if info is None else list(iter_records(client, job))
        known = {(r.node, Position(r.epoch, r.batch), r.attempt) for r in records}
        on_storage = {(c.node, c.position, c.attempt) for c in committed}
        result.missing_in_service = [c for c in committed if (c.node, c.position, c.attempt) not in known]
        result.missing_on_storage = [
            r
            for r in records
            if r.state == "committed" and (r.node, Position(r.epoch, r.batch), r.attempt) not in on_storage
        ]
        counters = _attempt_counters(client, job, records) if info is not None else {}
        for node, top in highest.items():
            if counters.get(node, 0) < top:
                result.counters_behind[node] = (counters.get(node, 0), top)
        if not check and result.differences:
            _apply(client, job, nodes, root, info, result)
        results.append(result)
    return results


def _attempt_counters(client: ServiceClient, job: str, records: list[CheckpointRecord]) -> dict[str, int]:
    """Each node's highest attempt number the service knows, registered or committed."""
    counters: dict[str, int] = {}
    numbered = [(a.node, a.attempt) for a in client.list_attempts(job)]
    numbered += [(r.node, attempt_sort_key(r.attempt)[0]) for r in records]
    for node, number in numbered:
        counters[node] = max(counters.get(node, 0), number)
    return counters


def _apply(
    client: ServiceClient, job: str, nodes: list[str], root: str, info: JobInfo | None, result: JobIndex
) -> None:
    if info is None:
        client.put_job(job, nodes=nodes, storage_root=root)
    for ref in sorted(result.missing_in_service, key=lambda r: (attempt_sort_key(r.attempt), r.position, r.node)):
        try:
            client.commit(ref, metrics=_metrics_of(ref))
        except FencedError:
            # A newer attempt is registered: this older checkpoint cannot be recorded any more.
            result.missing_in_service.remove(ref)
    for node, (service_top, top) in result.counters_behind.items():
        # Commits count as attempts seen: register only what is still missing above them.
        posted = [attempt_sort_key(r.attempt)[0] for r in result.missing_in_service if r.node == node]
        for _ in range(top - max(service_top, *posted, 0)):
            client.start_attempt(job, node)
    result.applied = True


def _metrics_of(ref: CheckpointRef) -> dict[str, float]:
    metrics = ref.manifest.metadata.get("metrics", {}) if isinstance(ref.manifest.metadata, dict) else {}
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


# -- copy --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Copied:
    """One checkpoint copied (and verified) at its destination."""

    source: str
    destination: CheckpointRef


def split_location(uri: str) -> tuple[str, str, tuple[str, Position, str] | None]:
    """`<root>/<job>/<node>/<position>/<attempt>` → (root, job, (node, position, attempt));
    `<root>/<job>` → (root, job, None)."""
    parts = uri.rstrip("/").rsplit("/", 4)
    if len(parts) == 5 and (position := parse_position_dirname(parts[3])) is not None:
        root, job, node, _, attempt = parts
        return (
            root,
            validate_name(job, kind="job"),
            (validate_name(node, kind="node"), position, validate_attempt(attempt)),
        )
    root, _, job = uri.rstrip("/").rpartition("/")
    if not root:
        raise ValueError(f"{uri!r} is neither <root>/<job> nor a checkpoint <root>/<job>/<node>/<position>/<attempt>")
    return root, validate_name(job, kind="job"), None


def copy(source: str, destination_root: str, *, progress: Progress = lambda n: None) -> list[Copied]:
    """Copy one checkpoint, or every committed checkpoint of a job, under another root (any backend).

    Keys stay the same below the root; each copy is verified on arrival. Re-running is safe:
    identical copies are skipped.
    """
    root, job, one = split_location(source)
    src, dst = Store(root), Store(destination_root)
    if one is not None:
        wanted = [one]
    else:
        wanted = [
            (node, found.position, found.attempt)
            for node in src.list_nodes(job)
            for found in src.list_checkpoints(job, node)
            if found.committed
        ]
        if not wanted:
            raise CheckpointNotFoundError(f"no committed checkpoint of job {job!r} under {src.url}")
    copied = []
    for node, position, attempt in wanted:
        ref = dst.copy_from(src, job, node, position.epoch, batch=position.batch, attempt=attempt)
        progress(ref.bytes)
        copied.append(Copied(src.location(job, node, position.epoch, batch=position.batch, attempt=attempt), ref))
    return copied
