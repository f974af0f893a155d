"""Whole-job operations behind the command line: verify, gc, reindex and copy.

Each one works on real storage and the service and returns what it found and did; the command
line only prints. Storage credentials and endpoints come from the environment the way fsspec's
backends read them (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `GOOGLE_APPLICATION_CREDENTIALS`, ...).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from ckptstore import CheckpointRef, CopyKey, Store, VerifyReport
from ckptstore.client.engine.retention import DELETED_BECAUSE, delete_copy
from ckptstore.client.peers.blob_server import HELD
from ckptstore.client.peers.filesystem import peer_store
from ckptstore.client.service.rest import ServiceClient
from ckptstore.client.service.wire import Commit
from ckptstore.errors import CheckpointNotFoundError, CorruptCheckpointError, FencedError, StorageUnavailableError
from ckptstore.format.layout import parse_position_dirname
from ckptstore.names import ACCEPTED_ATTEMPT_LIMIT, Tier, attempt_number, attempt_sort_key, validate_name
from ckptstore.retention import Candidate, RetentionPolicy, plan_deletions
from ckptstore.wire.schema import (
    AttemptInfo,
    CheckpointRecord,
    CheckpointState,
    JobInfo,
    LastGood,
    MarkState,
    PlannedDeletion,
    peer_holder,
)

__all__ = [
    "Checked",
    "JobIndex",
    "Copied",
    "iter_records",
    "iter_attempts",
    "verify_job",
    "apply_retention",
    "reindex",
    "copy",
    "split_location",
    "prestage",
]

Progress = Callable[[int], object]
PAGE = 1000
log = logging.getLogger("ckptstore.client")
T = TypeVar("T")


def iter_records(
    client: ServiceClient,
    job: str,
    *,
    node: str | None = None,
    epoch: int | None = None,
    state: CheckpointState | None = None,
) -> Iterator[CheckpointRecord]:
    """Every checkpoint record of a job matching the filters, page by page."""
    return _pages(
        lambda offset: client.list_checkpoints(job, node=node, epoch=epoch, state=state, limit=PAGE, offset=offset)
    )


def iter_attempts(client: ServiceClient, job: str, *, node: str | None = None) -> Iterator[AttemptInfo]:
    """Every attempt of a job (of one node), page by page."""
    return _pages(lambda offset: client.list_attempts(job, node=node, limit=PAGE, offset=offset))


def _pages(fetch: Callable[[int], list[T]]) -> Iterator[T]:
    offset = 0
    while True:
        page = fetch(offset)
        yield from page
        if len(page) < PAGE:
            return
        offset += PAGE


# -- verify ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Checked:
    """One committed copy's record, what verifying its bytes found, and the state marked in the service."""

    record: CheckpointRecord
    report: VerifyReport
    marked: str | None  # "corrupt" or "missing" when the service was told


def verify_job(
    client: ServiceClient,
    job: str,
    records: list[CheckpointRecord],
    *,
    tier: Tier = "durable",
    progress: Progress = lambda n: None,
) -> list[Checked]:
    """Verify every shard and tensor checksum of the given committed records of a job on one tier
    (`iter_records(client, job, state="committed")` for all of them; the local tier only on its node).

    A copy that fails is marked `corrupt` (or `missing` when its files are gone) in the service, so
    the judge re-decides its position.
    """
    info = client.get_job(job)
    root = info.storage_root if tier == "durable" else info.local_root
    if root is None:
        raise ValueError(f"job {job!r} has no local tier")
    store = Store(root, tier=tier)
    checked = []
    for record in (r for r in records if r.tier == tier):
        report = store.verify_copy(record.key)
        progress(record.bytes)
        marked: MarkState | None = None
        if not report.ok:
            marked = "missing" if report.state == "missing" else "corrupt"
            detail = "; ".join(p.detail for p in report.problems) or "not on storage"
            client.mark(record.key, marked, cause="verify", reason=f"verify: {detail}"[:500])
        checked.append(Checked(record, report, marked))
    return checked


# -- retention ---------------------------------------------------------------------------------


def apply_retention(
    client: ServiceClient, job: str, *, dry_run: bool = False, now: float | None = None
) -> list[PlannedDeletion]:
    """Execute the service's retention plan for every node, then remove what only storage knows of:
    uncommitted leftovers, superseded attempts and blobs no copy references, older than the job's
    grace period."""
    info = client.get_job(job)
    store = Store(info.storage_root)
    now = time.time() if now is None else now
    deletions = [d for d in client.retention_plan(job).deletions if d.tier == "durable"]
    planned = {d.key(job) for d in deletions}
    policy = RetentionPolicy(grace_seconds=info.retention.grace_seconds)
    for node in info.nodes:
        infos = {i.key: i for i in store.list_checkpoints(job, node) if not i.foreign}
        candidates = [Candidate(i.key, committed=i.committed, modified=i.modified) for i in infos.values()]
        for leftover in plan_deletions(candidates, good=(), policy=policy, now=now):
            if leftover.key not in planned:
                deletions.append(
                    PlannedDeletion(
                        node=node,
                        epoch=leftover.key.position.epoch,
                        batch=leftover.key.position.batch,
                        attempt=leftover.key.attempt,
                        location=infos[leftover.key].location,
                        reason=leftover.reason,
                    )
                )
    if not dry_run:
        for d in deletions:
            delete_copy(store, d.key(job))
            try:
                client.mark(d.key(job), "deleted", cause="gc", reason=DELETED_BECAUSE[d.reason])
            except CheckpointNotFoundError:
                pass  # a leftover only storage knew of
        for node in info.nodes:
            store.collect_blobs(job, node, grace_seconds=policy.grace_seconds, now=now)
    return deletions


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
    refused: list[str] = field(default_factory=list)  # locations whose attempt id no counter can follow
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
    manifest carries), then raise each node's attempt counter to the highest attempt on storage in
    one request. With `check=True` nothing is written; the differences are returned. Records of
    checkpoints missing on storage are reported, never changed; attempt ids at or above
    `ACCEPTED_ATTEMPT_LIMIT` (numbers a counter must never be pushed to: a planted `…/999999999/`) are
    reported as refused.
    """
    store = Store(root)
    if not store.exists():
        raise CheckpointNotFoundError(f"nothing at {store.url}: no storage root there (a typo in the path or bucket?)")
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
                if attempt_number(found.key.attempt) >= ACCEPTED_ATTEMPT_LIMIT:
                    result.refused.append(found.location)
                    continue
                highest[node] = max(highest.get(node, 0), attempt_number(found.key.attempt))
                if found.manifest is not None:
                    committed.append(CheckpointRef.of(found.location, found.manifest))
        # The root is the job's durable tier: copies on the nodes' local tiers are not its business.
        records = [] if info is None else [r for r in iter_records(client, job) if r.tier == "durable"]
        known = {r.key for r in records}
        on_storage = {c.key for c in committed}
        result.missing_in_service = [c for c in committed if c.key not in known]
        result.missing_on_storage = [r for r in records if r.state == "committed" and r.key not in on_storage]
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
    numbered = [(a.node, attempt_number(a.attempt)) for a in iter_attempts(client, job)]
    numbered += [(r.node, attempt_sort_key(r.attempt)[0]) for r in records]
    for node, number in numbered:
        counters[node] = max(counters.get(node, 0), number)
    return counters


def _apply(
    client: ServiceClient, job: str, nodes: list[str], root: str, info: JobInfo | None, result: JobIndex
) -> None:
    if info is None:
        client.put_job(job, nodes=nodes, storage_root=root)
    refs = sorted(result.missing_in_service, key=lambda r: (r.key.attempt_order, r.key.position, r.key.node))
    answers = client.commit_many(job, [Commit.of(ref) for ref in refs]) if refs else []
    for ref, answer in zip(refs, answers, strict=True):
        if isinstance(answer, FencedError):
            # A newer attempt is registered: this older checkpoint cannot be recorded any more.
            result.missing_in_service.remove(ref)
        elif isinstance(answer, Exception):
            raise answer
    for node, (_, top) in result.counters_behind.items():
        # Commits count as attempts seen: register one only if the counter is still below storage's.
        posted = [attempt_number(r.key.attempt) for r in result.missing_in_service if r.key.node == node]
        if max(posted, default=0) < top:
            client.start_attempt(job, node, at_least=top)
    result.applied = True


# -- copy --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Copied:
    """One checkpoint copied (and verified) at its destination — or, with `error`, not copied: its source
    copy is corrupt or gone (`destination` None)."""

    source: str
    destination: CheckpointRef | None
    error: str | None = None


def split_location(uri: str) -> tuple[str, str, CopyKey | None]:
    """`<root>/<job>/<node>/<position>/<attempt>` → (root, job, the copy's key);
    `<root>/<job>` → (root, job, None)."""
    parts = uri.rstrip("/").rsplit("/", 4)
    if len(parts) == 5 and (position := parse_position_dirname(parts[3])) is not None:
        root, job, node, _, attempt = parts
        return root, validate_name(job, kind="job"), CopyKey(job, node, position, attempt)
    root, _, job = uri.rstrip("/").rpartition("/")
    if not root:
        raise ValueError(f"{uri!r} is neither <root>/<job> nor a checkpoint <root>/<job>/<node>/<position>/<attempt>")
    return root, validate_name(job, kind="job"), None


def copy(source: str, destination_root: str, *, progress: Progress = lambda n: None) -> list[Copied]:
    """Copy one checkpoint, or every committed checkpoint of a job, under another root (any backend).

    Keys stay the same below the root; each copy is verified on arrival. A copy whose source does not
    verify is reported (`Copied.error`) and the others are copied still. Re-running is safe:
    identical copies are skipped.
    """
    root, job, one = split_location(source)
    src, dst = Store(root), Store(destination_root)
    if one is not None:
        wanted = [one]
    else:
        wanted = [
            found.key for node in src.list_nodes(job) for found in src.list_checkpoints(job, node) if found.committed
        ]
        if not wanted:
            raise CheckpointNotFoundError(f"no committed checkpoint of job {job!r} under {src.url}")
    copied = []
    for key in wanted:
        try:
            ref = dst.copy_from(src, key)
        except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
            copied.append(Copied(src.location(key), None, str(exc)))
            continue
        progress(ref.bytes)
        copied.append(Copied(src.location(key), ref))
    return copied


# -- prestage ----------------------------------------------------------------------------------


def _from_peer(
    client: ServiceClient, job: str, node: str, answer: LastGood, local_root: str, errors: list[str]
) -> Copied | None:
    """The resume copy staged from a peer that holds it (peer replicas) and whose blob server answers;
    None when none does (each failure added to `errors`)."""
    held = [c.location for c in answer.nodes[node].copies if c.tier == "peer" and c.state == "committed"]
    servers = client.blob_servers(job) if held else {}
    for location in held:
        _, _, key = split_location(location)
        server = servers.get(peer_holder(location) or "")
        if key is None or server is None:
            errors.append(f"{location}: its holder has no blob server registered")
            continue
        try:
            ref = Store(local_root, tier="local").copy_from(peer_store(server.url, server.token, HELD), key)
        except (CorruptCheckpointError, CheckpointNotFoundError, StorageUnavailableError) as exc:
            errors.append(f"{location}: {exc}")
            continue
        return Copied(location, ref)
    return None


def prestage(
    client: ServiceClient, job: str, node: str, local_root: str, *, progress: Progress = lambda n: None
) -> Copied | None:
    """Copy the copy `node` would resume from — the node's part of the job's resume position — into
    `local_root`, a local tier root, verified on arrival, from the nearest source: a peer that holds it
    (peer replicas), else the durable tier. The training started next with `local_storage=local_root`
    restores from it without reading the durable tier. None when the job has no resume position, or is
    not declared yet (a fresh job: nothing to stage). A copy already there is kept (a no-op)."""
    try:
        answer = client.last_good_epoch(job, node=node)
    except CheckpointNotFoundError:  # not declared yet: its first training declares it
        return None
    where = answer.nodes.get(node)
    if answer.resume is None or where is None:
        return None
    errors: list[str] = []
    staged = _from_peer(client, job, node, answer, local_root, errors)
    if staged is not None:
        progress(staged.destination.bytes if staged.destination else 0)
        return staged
    for error in errors:
        log.warning("prestage: a peer's copy not taken (%s): staging from the durable tier", error)
    # The durable copy, reachable from anywhere (a local copy lives on the disk of the node that wrote it).
    sources = [c.location for c in where.copies if c.tier == "durable" and c.state == "committed"]
    fallback = [] if peer_holder(where.location) else [where.location]
    for location in sources or fallback:
        root, _, key = split_location(location)
        if key is None:
            continue
        try:
            ref = Store(local_root, tier="local").copy_from(Store(root), key)
        except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
            errors.append(f"{location}: {exc}")
            continue
        progress(ref.bytes)
        return Copied(location, ref)
    raise CorruptCheckpointError(f"no intact copy of {job}/{node} at {answer.resume} to prestage: {'; '.join(errors)}")
