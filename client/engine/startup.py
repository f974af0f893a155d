"""What a node checks and records before it resumes, so that a restart is right or loud.

- The job as declared (`check_job`): this process's node is one of the job's expected nodes and its
  `storage=` is the job's root; otherwise `ConfigurationError` at once, never a warning per save.
- Storage as configured (`probe_tiers`): a write, read and delete of a probe object on every tier; a
  permanent failure (a missing bucket, a root under a file, access denied, another region) raises
  `ConfigurationError` naming the fix, whatever `on_error` says; a transient one is said once and
  training goes on.
- Storage is the truth (`record_unknown_copies`): copies of this node that the service does not know
  (written while it was away, or by a process it never heard from) are recorded — idempotent
  re-posts of their manifests — before the service judges where to resume.
- One request when nothing has to change (`start_in_one_request`): with the job declared as this
  process would declare it and every copy on its storage recorded, the service registers the attempt
  and answers the node's resume position at once (a restart storm's cost); otherwise it declines,
  changing nothing, and the steps above run one request at a time (`register_start`).

What a start then says or refuses about the position it resumed: `ckptstore.client.engine.fresh_start`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping

from pydantic import ValidationError

from ckptstore import CheckpointRef, Store
from ckptstore.client.engine.identity import NodeIdentity
from ckptstore.client.engine.options import CheckpointOptions
from ckptstore.client.service.operations import iter_records
from ckptstore.client.service.rest import ServiceClient
from ckptstore.client.service.wire import Commit
from ckptstore.errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    ConfigurationError,
    FencedError,
    ServiceUnavailableError,
    StorageUnavailableError,
)
from ckptstore.names import Tier
from ckptstore.wire.schema import JobInfo, LastGood, NodeStart, StartRequest, StoredCopy

__all__ = [
    "check_job",
    "declare_job",
    "declare_first",
    "declaration_changes",
    "register_start",
    "start_in_one_request",
    "probe_tiers",
    "wait_for_tier",
    "PROBE_TIMEOUT_S",
    "record_unknown_copies",
    "same_root",
    "highest_attempt_on_storage",
]

log = logging.getLogger("ckptstore.client")
PROBE_TIMEOUT_S = 10.0  # a start's probe of one tier: an endpoint that does not answer costs this, not minutes
WAIT_STEP_S = 5.0
_FIX = {
    "denied": "check the credentials this process uses (AWS_ACCESS_KEY_ID / AWS_PROFILE, "
    "GOOGLE_APPLICATION_CREDENTIALS, storage_options) and the bucket's permissions",
    "misconfigured": "check the storage URL: the bucket must exist (create it first), the root must not lie under a "
    "regular file, and the region or endpoint must be the bucket's (AWS_DEFAULT_REGION, AWS_ENDPOINT_URL)",
}


def same_root(a: str, b: str) -> bool:
    """Whether two storage roots name the same place (trailing slashes, `file://` and relative local paths aside)."""

    def canonical(root: str) -> str:
        root = root.removeprefix("file://")
        return os.path.abspath(root) if "://" not in root else root.rstrip("/")

    return canonical(a) == canonical(b)


def check_job(info: JobInfo, *, identity: NodeIdentity, nodes: list[str], storage: str) -> None:
    """Refuse a process that cannot take part in the job as declared (`nodes`: the set it will have)."""
    job, node = info.job, identity.checkpoint_node
    if not same_root(info.storage_root, storage):
        raise ConfigurationError(
            f"job {job!r} keeps its checkpoints under {info.storage_root} (its declared storage root), but this "
            f"process saves to {storage}: pass storage={info.storage_root!r}, or declare the job with this root "
            f"(ckptstore jobs declare {job} --nodes {','.join(info.nodes)} --storage-root {storage})"
        )
    if node not in nodes:
        shown = ", ".join(nodes[:8]) + (f", … ({len(nodes)} nodes)" if len(nodes) > 8 else "")
        raise ConfigurationError(
            f"node {node!r} (from {identity.source}) is not one of job {job!r}'s expected nodes [{shown}]: give each "
            "process one of those names (node=…, CKPTSTORE_NODE, or RANK=i for node-i), or declare the job's "
            f"nodes as they are (nodes=[…], or ckptstore jobs declare {job} --nodes NAME,NAME…)"
        )


def declare_job(
    client: ServiceClient,
    options: CheckpointOptions,
    identity: NodeIdentity,
    storage: str,
    local_root: str | None,
    *,
    known: JobInfo | None = None,
) -> JobInfo:
    """Declare the job on its first start (its expected nodes, retention, tiers); or check that this
    process can take part in the job as declared (`check_job`) and bring the job in line with what the
    process says explicitly: `nodes=` replaces the expected nodes (never grown behind the user's back),
    `max_to_keep` the retention, `local_storage` the local tier. Returns the job as declared now.
    `known`: the job as this process just read it (one request less per node in a restart storm)."""
    try:
        info = known or client.get_job(options.job)
    except CheckpointNotFoundError:
        keep_last = options.max_to_keep
        return client.put_job(
            options.job,
            options.expected_nodes(identity.checkpoint_node),
            storage_root=storage,
            local_root=local_root,
            retention={"keep_last": keep_last} if keep_last else None,
            parent=options.parent,
            parent_token=options.fork_token,
        )
    changes = declaration_changes(info, options, identity, storage, local_root)
    if changes is None:
        return info
    nodes, local_root = changes
    retention = info.retention.model_dump() | {"keep_last": options.max_to_keep}
    return client.put_job(
        options.job,
        nodes,
        storage_root=info.storage_root,
        local_root=local_root,
        retention=retention,
        parent=options.parent,
        parent_token=options.fork_token,
    )


def declare_first(
    client: ServiceClient, options: CheckpointOptions, identity: NodeIdentity, storage: str, local_root: str | None
) -> JobInfo | None:
    """Declare the job before anything touches storage: a node on the presigned data path reads and
    writes only through URLs the service signs, and it signs only for a job it knows. None while the
    service is away (the storage is then out of reach as well, and said so by the probe)."""
    try:
        return declare_job(client, options, identity, storage, local_root)
    except ServiceUnavailableError as exc:
        log.warning("service unreachable (%s): the job is declared at start", exc)
        return None


def declaration_changes(
    info: JobInfo, options: CheckpointOptions, identity: NodeIdentity, storage: str, local_root: str | None
) -> tuple[list[str], str | None] | None:
    """Check that this process can take part in the job as declared (`check_job`, the fork's parent);
    None when the declaration already says what the process does, else the expected nodes and local
    root to declare it with."""
    nodes = options.expected_nodes(identity.checkpoint_node) if options.nodes is not None else info.nodes
    check_job(info, identity=identity, nodes=nodes, storage=storage)
    parent = options.parent
    if parent is not None and info.parent is not None and parent != info.parent:
        raise ConfigurationError(f"job {options.job!r} was forked from {info.parent}, not {parent} (fork_from=)")
    wanted = (sorted(nodes), local_root or info.local_root, options.max_to_keep)
    if wanted == (sorted(info.nodes), info.local_root, info.retention.keep_last) and (parent is None or info.parent):
        return None
    return nodes, wanted[1]


def register_start(
    client: ServiceClient,
    options: CheckpointOptions,
    identity: NodeIdentity,
    known: JobInfo | None,
    durable: str,
    tiers: Mapping[Tier, Store],
    local_root: str | None,
) -> tuple[JobInfo, str, LastGood | None]:
    """Make this start known to the service: the job as declared now, this start's attempt, and the
    node's part of the last-good answer when the start took one request (`start_in_one_request`: the
    job is declared as this process would declare it — `known`, read at construction — so nothing has
    to change first); else the long way — declare or check the job, record the node's unknown copies,
    register. `durable`: the durable tier's root; `tiers`: the tiers this start reads."""
    node = identity.checkpoint_node
    if known is not None and declaration_changes(known, options, identity, durable, local_root) is None:
        started = start_in_one_request(client, known, node, tiers)
        if started is not None and started.attempt is not None:
            return known, started.attempt.attempt, started.resume
    declared = declare_job(client, options, identity, durable, local_root, known=known)
    record_unknown_copies(client, options.job, node, tiers)
    return declared, client.start_attempt(options.job, node), None


def start_in_one_request(
    client: ServiceClient, declared: JobInfo, node: str, tiers: Mapping[Tier, Store]
) -> NodeStart | None:
    """Register this start and get the node's part of the last-good answer in one request (what keeps a
    restart storm short): the service registers only while `declared` is still the job's declaration
    and it records every copy on this node's storage. None: the long way is to be taken — as with a
    service older than the start route, or one that declined (it then changed nothing)."""
    try:
        keys = [key for store in tiers.values() for key in store.manifest_keys(declared.job, node)]
    except StorageUnavailableError:
        return None  # the long way says which tier is away
    stored = [StoredCopy(epoch=k.position.epoch, batch=k.position.batch, attempt=k.attempt, tier=k.tier) for k in keys]
    try:
        started = client.start_node(declared.job, node, StartRequest(declared_at=declared.updated_at, stored=stored))
    except (CheckpointNotFoundError, ValidationError):  # an older service; more copies than a request lists
        return None
    if started.attempt is None:
        log.info("%s/%s starts the long way: %s", declared.job, node, started.refused)
        return None
    return started


def probe_tiers(tiers: Mapping[Tier, Store]) -> dict[Tier, str]:
    """Write, read and delete a probe on every tier: raise ConfigurationError for a permanent failure,
    warn once for a transient one (saves will retry, training goes on). Returns the tiers that did
    not answer, with why."""
    silent: dict[Tier, str] = {}
    for tier, store in tiers.items():
        report = store.accessible(timeout=PROBE_TIMEOUT_S)
        if report.ok:
            continue
        if report.permanent:
            assert report.failure is not None
            raise ConfigurationError(
                f"the {tier} tier {store.url} cannot be used ({report.failure}): {report.error}; {_FIX[report.failure]}"
            )
        log.warning(
            "the %s tier %s does not answer now (%s): saves will be retried or skipped until it does; training goes on",
            tier,
            store.url,
            report.error,
        )
        silent[tier] = report.error or "no answer"
    return silent


def wait_for_tier(store: Store, job: str, node: str, *, wait_s: float, error: str) -> str | None:
    """Probe a tier that did not answer again, every few seconds, for at most `wait_s` (said once): None
    once it answers, else why it still does not."""
    if wait_s <= 0:
        return error
    print(
        f"ckptstore: {job}/{node}: {store.url} does not answer ({error}); waiting up to {wait_s:g} s for it "
        "before deciding where to resume",
        file=sys.stderr,
        flush=True,
    )
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(WAIT_STEP_S, left))
        report = store.accessible(timeout=min(PROBE_TIMEOUT_S, max(left, 1.0)))
        if report.ok:
            print(f"ckptstore: {job}/{node}: {store.url} answers again", file=sys.stderr, flush=True)
            return None
        error = report.error or error
    return error


def record_unknown_copies(client: ServiceClient, job: str, node: str, tiers: Mapping[Tier, Store]) -> int:
    """Record the committed copies of `node` on `tiers` that the service has no record of; how many
    were recorded. A copy of an attempt older than one the service registered since is a zombie's:
    it is left unrecorded (fencing)."""
    known = {record.key for record in iter_records(client, job, node=node)}
    refs = [
        CheckpointRef.of(info.location, info.manifest, tier)
        for tier, store in tiers.items()
        for info in store.list_checkpoints(job, node, skip=known)
        if info.manifest is not None
    ]
    if not refs:
        return 0
    refs.sort(key=lambda ref: (ref.key.attempt_order, ref.key.position, ref.key.tier != "local"))
    recorded = 0
    for ref, answer in zip(refs, client.commit_many(job, [Commit.of(ref) for ref in refs]), strict=True):
        if isinstance(answer, FencedError):
            log.info("%s stays unrecorded: %s", ref.key, answer)
        elif isinstance(answer, (CommitConflictError, Exception)):
            log.warning("could not record %s found on storage: %s", ref.key, answer)
        else:
            recorded += 1
    if recorded:
        if recorded == 1:
            copies, records, them = "1 checkpoint copy", "its record", "it"
        else:
            copies, records, them = f"{recorded} checkpoint copies", "their records", "them"
        print(
            f"ckptstore: {job}/{node}: {copies} on storage had no record in the service ({records} had not "
            f"reached it: the process that wrote {them} ended first, or the service was away); recorded now",
            file=sys.stderr,
            flush=True,
        )
    return recorded


def highest_attempt_on_storage(tiers: Mapping[Tier, Store], job: str, node: str) -> int:
    """The highest attempt number of `node` on the tiers that answer (numbering an offline attempt:
    its random suffix keeps it unique)."""
    highest = []
    for tier, store in tiers.items():
        try:
            highest.append(store.highest_attempt(job, node))
        except StorageUnavailableError as exc:
            log.warning("the %s tier is away (%s): numbering this offline attempt without it", tier, exc)
    return max(highest, default=0)
