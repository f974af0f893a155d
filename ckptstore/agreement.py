"""Replica agreement: data-parallel replicas (DDP) must hold bit-identical model and optimizer state.

At each save of replicated state the writing rank's copy records, per tensor, the CRC32C its writer
computes anyway (the manifest's `crc32c`); every other rank hashes its own tensors the same way
(off the training path: client/torch/replicas.py), and the writer gets those hashes in one small
gather before its manifest is written and keeps them in the copy's metadata (`replica_agreement`:
the value most other ranks hold per tensor, the ranks that differ from it, the tensors' names).
Whether the replicas agreed is then a pure function of the manifest (`disagreement_of`): the
writer's process marks a disagreeing copy not good after its commit (`replicas disagree: rank R,
tensor T`), restore and replication pass over it by its manifest alone. With ≥ 3 replicas the
minority is named per tensor; with 2 (no majority) rank 0, the writer, is the reference. A
preemption's save gathers nothing (a collective could hang while other ranks are not saving) and its
copy says so (`checked: false`).

Sharded state (DCP): every rank holding a copy of the same tensor or shard (a plain tensor: every
rank; a DTensor shard replicated over a mesh dimension: HSDP's replica groups) hashes it, and the
coordinator's copy keeps the groups that disagree with every member's hash (`replica_groups`,
`groups_disagreement`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ckptstore.format.crc import checksum, format_crc
from ckptstore.format.manifest import Manifest

__all__ = [
    "AGREEMENT_KEY",
    "hashes",
    "disagreement",
    "agreement_metadata",
    "replica_groups",
    "groups_disagreement",
    "unchecked_metadata",
    "disagreement_of",
]

AGREEMENT_KEY = "replica_agreement"  # in a copy's manifest metadata
TENSORS_NAMED = 3  # a reason names this many tensors at most, then how many more


def hashes(views: Mapping[str, np.ndarray]) -> dict[str, str]:
    """Each tensor's CRC32C as a manifest records it, by its key in the checkpoint."""
    return {key: format_crc(checksum(np.ascontiguousarray(view))) for key, view in views.items()}


def _outliers(values: Mapping[int, str | None], reference: int | None) -> list[int]:
    """The ranks whose value is not the one most ranks hold; with no majority, those that differ
    from `reference`'s value (every rank, with no reference)."""
    majority, votes = Counter(values.values()).most_common(1)[0]
    if votes * 2 <= len(values):
        if reference is None:
            return sorted(values)
        majority = values[reference]
    return sorted(rank for rank, value in values.items() if value != majority)


def _reason(differing: Mapping[str, list[int]], names: Mapping[str, str] | None) -> str | None:
    """`replicas disagree: rank R, tensor T` for the tensors whose replicas differ (None: none do)."""
    if not differing:
        return None
    ranks = sorted({rank for named in differing.values() for rank in named})
    shown = [(names or {}).get(key, key) for key in differing]
    tensors = ", ".join(shown[:TENSORS_NAMED])
    if len(shown) > TENSORS_NAMED:
        tensors += f" and {len(shown) - TENSORS_NAMED} more"
    who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    return f"replicas disagree: {who}, tensor {tensors}"


def disagreement(by_rank: Sequence[Mapping[str, str | None]], names: Mapping[str, str] | None = None) -> str | None:
    """None when every rank holds the same tensors with the same hashes; else the reason a save is not
    good: `replicas disagree: rank R, tensor T` (per differing tensor the ranks outside its majority,
    rank 0's value as the reference where no value has one; tensors by `names` where given)."""
    differing: dict[str, list[int]] = {}
    for key in sorted(set().union(*by_rank)):
        values = {rank: ranked.get(key) for rank, ranked in enumerate(by_rank)}
        if len(set(values.values())) > 1:
            differing[key] = _outliers(values, reference=0)
    return _reason(differing, names)


def replica_groups(by_rank: Sequence[Mapping[str, str] | None]) -> dict[str, Any]:
    """What the coordinator's copy keeps of sharded state's replicas (DCP: a plain tensor is every
    rank's, a DTensor's shard is held by each rank of its replicate dimension — HSDP's replica
    groups): every rank's hash of each replicated shard it holds (`by_rank[r]`, by the shard's key),
    compared within each group of ranks holding the same key. Only disagreeing groups are kept, with
    every member's hash; a rank that could not hash makes the save unchecked."""
    missing = [rank for rank, ranked in enumerate(by_rank) if ranked is None]
    if missing:
        return unchecked_metadata(len(by_rank), f"rank(s) {', '.join(map(str, missing))} could not hash their state")
    held: dict[str, dict[int, str]] = {}
    for rank, ranked in enumerate(by_rank):
        for key, value in (ranked or {}).items():
            held.setdefault(key, {})[rank] = value
    groups = {key: values for key, values in held.items() if len(values) > 1}
    differing = {key: values for key, values in groups.items() if len(set(values.values())) > 1}
    return {
        AGREEMENT_KEY: {
            "ranks": len(by_rank),
            "checked": True,
            "compared": len(groups),
            "groups": {key: {str(rank): value for rank, value in values.items()} for key, values in differing.items()},
        }
    }


def agreement_metadata(others: Sequence[Mapping[str, str]], names: Mapping[str, str]) -> dict[str, Any]:
    """What the writer's copy keeps of the other ranks' hashes (`others[i]` is rank i + 1's): per
    tensor the value most of them hold, and each rank's values that differ from it."""
    keys = sorted(set().union(*others))
    common = {key: Counter(ranked.get(key) for ranked in others).most_common(1)[0][0] for key in keys}
    differing = {
        str(rank): {key: ranked.get(key) for key in keys if ranked.get(key) != common[key]}
        for rank, ranked in enumerate(others, start=1)
    }
    return {
        AGREEMENT_KEY: {
            "ranks": len(others) + 1,
            "checked": True,
            "replicas": common,
            "differing": {rank: values for rank, values in differing.items() if values},
            "names": {key: names.get(key, key) for key in keys},
        }
    }


def unchecked_metadata(ranks: int, why: str) -> dict[str, Any]:
    """What a copy says when its replicas were not compared, and why (a preemption's save, a rank that
    could not hash, a gather that failed)."""
    return {AGREEMENT_KEY: {"ranks": ranks, "checked": False, "why": why}}


def groups_disagreement(metadata: Mapping[str, Any]) -> str | None:
    """The disagreement `replica_groups` recorded (None: the groups agreed, or were not compared):
    per disagreeing group the ranks outside its majority — every member of a group of two, where
    neither can be told right."""
    agreement = metadata.get(AGREEMENT_KEY)
    if not isinstance(agreement, Mapping) or agreement.get("checked") is not True:
        return None
    try:
        groups = {key: {int(rank): str(value) for rank, value in dict(values).items()}
                  for key, values in dict(agreement["groups"]).items()}  # fmt: skip
    except (KeyError, TypeError, ValueError):
        return "replicas disagree: the copy's record of them is malformed"
    if any(not values for values in groups.values()):
        return "replicas disagree: the copy's record of them is malformed"
    return _reason({key: _outliers(values, reference=None) for key, values in groups.items()}, None)


def disagreement_of(manifest: Manifest) -> str | None:
    """The disagreement a copy holds: its writer's tensors (the manifest's CRCs) against the other
    ranks' hashes kept in its metadata. None when they agreed, were not compared, or no record says
    (a copy from a single process); a malformed record is a disagreement (it cannot be trusted)."""
    agreement = manifest.metadata.get(AGREEMENT_KEY)
    if not isinstance(agreement, Mapping) or agreement.get("checked") is not True:
        return None
    if "groups" in agreement:
        return groups_disagreement(manifest.metadata)
    try:
        ranks, common = int(agreement["ranks"]), dict(agreement["replicas"])
        differing = {int(rank): dict(values) for rank, values in dict(agreement.get("differing", {})).items()}
        names = dict(agreement.get("names", {}))
    except (KeyError, TypeError, ValueError, IndexError):
        return "replicas disagree: the copy's record of them is malformed"
    written = {record.name: record.crc32c for record in manifest.tensors}
    by_rank: list[dict[str, str | None]] = [{key: written.get(key) for key in common}]
    by_rank += [{**common, **differing.get(rank, {})} for rank in range(1, ranks)]
    return disagreement(by_rank, names)
