"""What a start says or refuses about where it resumes, once its restore is done: a restart is right or loud.

A node that would start from scratch while committed copies
of its job exist raises `ResumeRefusedError` naming them and why none qualifies when the job's
declaration is the cause, unless `fresh_start=True`; otherwise (copies left incomplete by an
interrupted first save) it says so. A node that resumes behind its own newer copies says why
(`explain_resume`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from ckptstore import Position, Store
from ckptstore.client.engine.options import CheckpointOptions
from ckptstore.client.service.operations import iter_attempts
from ckptstore.client.service.rest import ServiceClient
from ckptstore.errors import (
    CheckpointNotFoundError,
    ResumeRefusedError,
    ServiceUnavailableError,
    StorageUnavailableError,
)
from ckptstore.names import Tier
from ckptstore.wire.schema import JobInfo, NotGood

if TYPE_CHECKING:
    from ckptstore.copies import Restored

__all__ = [
    "StartingNode",
    "check_resume",
    "refuse_fresh_start",
    "explain_resume",
    "fresh_anyway",
    "start_without_durable",
    "copies_unseen",
]

log = logging.getLogger("ckptstore.client")


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


class StartingNode(Protocol):
    """What `check_resume` reads of a node (`ckptstore.client.engine.node.NodeCheckpointer`)."""

    job: str
    node: str
    writes: bool
    options: CheckpointOptions
    client: ServiceClient | None
    declared: JobInfo | None

    @property
    def tiers(self) -> Mapping[Tier, Store]: ...

    @property
    def start_tiers(self) -> Mapping[Tier, Store]: ...


def check_resume(node: StartingNode, restored: Restored | None) -> None:
    """After a node's restore: a fresh start while committed copies of its job exist is refused (unless
    `fresh_start`); a resume behind the node's own newer copies is said."""
    client = node.client if node.client is not None and node.declared is not None else None
    if restored is None:
        expected = None if node.declared is None else node.declared.nodes
        try:
            refuse_fresh_start(node.job, node.node, node.start_tiers, client, expected)
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
            explain_resume(client, node.job, node.node, restored.copy.position, node.start_tiers)
        except (ServiceUnavailableError, StorageUnavailableError) as exc:
            log.debug("could not compare the resume position with this node's copies: %s", exc)


def start_without_durable(node: StartingNode, error: str) -> bool:
    """The durable tier did not answer at start: whether this start may go on at once without seeing
    the copies there (said so): when an answering local tier holds copies of the node (restored from),
    with `fresh_start`, or when the service says the job has no checkpoint yet (a new job). Otherwise
    (False) the start waits for the tier, then refuses (`copies_unseen`): starting over copies it
    cannot see would retrain the job's progress without a word."""
    durable, local = node.tiers["durable"], node.tiers.get("local")
    if local is not None:
        try:
            if any(found.committed for found in local.list_checkpoints(node.job, node.node)):
                print(
                    f"ckptstore: {node.job}/{node.node}: {durable.url} does not answer ({error}): resuming from the "
                    "local tier; replication retries until it answers",
                    file=sys.stderr,
                    flush=True,
                )
                return True
        except StorageUnavailableError:
            pass
    if node.options.fresh_start:
        fresh_anyway(node.job, node.node, f"{durable.url} does not answer ({error})")
        return True
    if node.client is None:
        return False
    try:
        new = not node.client.list_checkpoints(node.job, limit=1)
    except CheckpointNotFoundError:
        new = True
    except ServiceUnavailableError:
        return False
    if new:
        print(
            f"ckptstore: {node.job}/{node.node}: a new job (the service holds no checkpoint of it) starts while "
            f"{durable.url} does not answer ({error}); its saves retry until it does",
            file=sys.stderr,
            flush=True,
        )
    return new


def copies_unseen(node: StartingNode, error: str, waited_s: float) -> ResumeRefusedError:
    """The refusal of a start whose durable tier still does not answer after `waited_s`."""
    through = " (reached through URLs the service signs: neither answers now)" if node.options.presigned else ""
    return ResumeRefusedError(
        f"{node.job}/{node.node} cannot see its copies: {node.tiers['durable'].url}{through} does not answer "
        f"({error}), after waiting {waited_s:g} s (storage_wait_s). Not starting from scratch over copies that may "
        "be there: start again once it answers, or pass fresh_start=True to train from scratch"
    )
