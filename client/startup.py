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
- Starting fresh (`refuse_fresh_start`): a node that would start from scratch while committed copies
  of its job exist raises `ResumeRefusedError` naming them and why none qualifies when the job's
  declaration is the cause, unless `fresh_start=True`; otherwise (copies left incomplete by an
  interrupted first save) it says so. A node that resumes behind its own newer copies says why
  (`explain_resume`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pydantic import ValidationError

from ckptstore import CheckpointRef, Position, Store
from ckptstore.errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    ConfigurationError,
    FencedError,
    ResumeRefusedError,
    ServiceUnavailableError,
    StorageUnavailableError,
)
from ckptstore.names import Tier
from ckptstore.schema import JobInfo, LastGood, NodeStart, NotGood, StartRequest, StoredCopy
from client.identity import NodeIdentity
from client.operations import iter_attempts, iter_records
from client.options import CheckpointOptions
from client.service import ServiceClient
from client.wire import Commit

if TYPE_CHECKING:  # the node calls in here; nothing here calls the node's methods
    from ckptstore.copies import Restored
    from client.node import NodeCheckpointer

__all__ = [
    "check_job",
    "check_resume",
    "fresh_anyway",
    "declare_job",
    "declare_first",
    "declaration_changes",
    "register_start",
    "start_in_one_request",
    "probe_tiers",
    "record_unknown_copies",
    "refuse_fresh_start",
    "explain_resume",
    "same_root",
    "highest_attempt_on_storage",
]

log = logging.getLogger("ckptstore.client")
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
    tiers: Mapping[Tier, Store],
    local_root: str | None,
) -> tuple[JobInfo, str, LastGood | None]:
    """Make this start known to the service: the job as declared now, this start's attempt, and the
    node's part of the last-good answer when the start took one request (`start_in_one_request`: the
    job is declared as this process would declare it — `known`, read at construction — so nothing has
    to change first); else the long way — declare or check the job, record the node's unknown copies,
    register."""
    node, durable = identity.checkpoint_node, tiers["durable"].url
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


def probe_tiers(tiers: Mapping[Tier, Store]) -> None:
    """Write, read and delete a probe on every tier: raise ConfigurationError for a permanent failure,
    warn once for a transient one (saves will retry, training goes on)."""
    for tier, store in tiers.items():
        report = store.accessible(timeout=30)
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
        print(
            f"ckptstore: {job}/{node}: {recorded} checkpoint copies found on storage that the service did not know "
            "(written while it was away) are now recorded",
            file=sys.stderr,
            flush=True,
        )
    return recorded


def _reasons(not_good: list[NotGood]) -> str:
    parts = []
    for entry in not_good[:5]:
        where = Position(entry.epoch, entry.batch)
        why = [f"{', '.join(entry.missing)} did not commit it"] if entry.missing else []
        why += [f"{', '.join(entry.corrupt)}'s copy is corrupt"] if entry.corrupt else []
        why += [f"{', '.join(entry.deleted)}'s copy was deleted"] if entry.deleted else []
        parts.append(f"{where}: {'; '.join(why) or 'not good'}")
    return "; ".join(parts)


def refuse_fresh_start(
    job: str, node: str, tiers: Mapping[Tier, Store], client: ServiceClient | None, expected: list[str] | None
) -> None:
    """A node about to start from scratch although it has committed copies of its own: raise
    ResumeRefusedError when the job's declaration is why none qualifies — an expected node never
    started under the job, so no position can become good — else say, on one line, that this start
    trains from scratch and which copies it leaves behind (the other nodes' parts are incomplete: a
    save interrupted on some nodes). A node without copies of its own loses nothing: it starts.

    The verdict rests on what the service holds for the whole job (which nodes ever registered an
    attempt, why positions are not good), so the nodes of a restarting job reach the same one."""
    found = sorted(
        (i.key for store in tiers.values() for i in store.list_checkpoints(job, node) if i.committed),
        key=lambda k: (k.position, k.attempt_order),
        reverse=True,
    )
    if not found:
        return
    where = f"{len(found)} committed copies of its own (newest: {', '.join(str(k) for k in found[:3])})"
    if client is None or expected is None:
        _starts_fresh(job, node, f"it has {where}, but none verifies or no service can say which are good")
        return
    ran = {attempt.node for attempt in iter_attempts(client, job)}
    never_ran = [n for n in expected if n not in ran and n != node]
    why = _reasons(client.last_good_epoch(job).not_good) or "no position has a copy from every expected node"
    if not never_ran:
        _starts_fresh(job, node, f"it has {where}, but no position is good ({why}): they are not resumed")
        return
    raise ResumeRefusedError(
        f"{job}/{node} would start from scratch although it has {where}: none qualifies to resume from because "
        f"expected nodes {', '.join(never_ran[:8])} never started under this job ({why}). Name the processes after "
        f"the job's nodes [{', '.join(expected[:8])}] or declare the nodes that really train (nodes=[…], ckptstore "
        "jobs declare); or pass fresh_start=True (CKPTSTORE_FRESH_START=1) to train from scratch anyway",
        copies=tuple(found),
    )


def _starts_fresh(job: str, node: str, why: str) -> None:
    print(f"ckptstore: {job}/{node} starts from scratch: {why}", file=sys.stderr, flush=True)


def explain_resume(client: ServiceClient, job: str, node: str, resumed: Position, tiers: Mapping[Tier, Store]) -> None:
    """Say so when this node resumes behind newer copies of its own (they are not good: another node
    lacks them, or one is corrupt): those batches are trained again."""
    listed = {key.position for store in tiers.values() for key in store.manifest_keys(job, node)}  # no manifest read
    newer = sorted(p for p in listed if p > resumed)
    if not newer:
        return
    reasons = _reasons([n for n in client.last_good_epoch(job).not_good if Position(n.epoch, n.batch) in newer])
    print(
        f"ckptstore: {job}/{node} resumes from {resumed}, behind its own newer copies ({', '.join(map(str, newer[-3:]))}): "
        f"they are not good — {reasons or 'not every expected node has them'}; their batches are trained again",
        file=sys.stderr,
        flush=True,
    )


def fresh_anyway(job: str, node: str, why: str) -> None:
    """Say that this start trains from scratch although it would otherwise have been refused."""
    print(f"ckptstore: {job}/{node} starts from scratch as asked (fresh_start): {why}", file=sys.stderr, flush=True)


def check_resume(node: NodeCheckpointer, restored: Restored | None) -> None:
    """After a node's restore: a fresh start while committed copies of its job exist is refused (unless
    `fresh_start`); a resume behind the node's own newer copies is said."""
    client = node.client if node.client is not None and node.declared is not None else None
    if restored is None:
        expected = None if node.declared is None else node.declared.nodes
        try:
            refuse_fresh_start(node.job, node.node, node.tiers, client, expected)
        except StorageUnavailableError as exc:
            if node.options.presigned and not node.options.fresh_start:  # no service, no storage: nothing known
                raise ResumeRefusedError(
                    f"{node.job}/{node.node} cannot list its copies: the durable tier is reached through URLs the "
                    f"service signs, and neither answers now ({exc}). Not starting from scratch over copies that may "
                    "exist: start again once the service answers, or pass fresh_start=True to train from scratch"
                ) from exc
            _starts_fresh(node.job, node.node, f"storage cannot be listed now ({exc}): copies there are not resumed")
        except ResumeRefusedError as exc:
            if not node.options.fresh_start:
                raise
            fresh_anyway(node.job, node.node, str(exc))
    elif client is not None and node.writes:
        try:
            explain_resume(client, node.job, node.node, restored.copy.position, node.tiers)
        except (ServiceUnavailableError, StorageUnavailableError) as exc:
            log.debug("could not compare the resume position with this node's copies: %s", exc)


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
