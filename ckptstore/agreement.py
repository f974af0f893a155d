"""Replica agreement: data-parallel replicas (DDP) must hold bit-identical model and optimizer state.

At each save of replicated state the writing rank's copy records, per tensor, the CRC32C its writer
computes anyway (the manifest's `crc32c`); every other rank hashes its own tensors the same way
while the writer captures (they would wait for it at the next all-reduce anyway), and the writer
gets those hashes in one small gather and keeps them in the copy's metadata (`replica_agreement`:
the value most other ranks hold per tensor, the ranks that differ from it, the tensors' names).
Whether the replicas agreed is then a pure function of the manifest (`disagreement_of`): the
writer's process marks a disagreeing copy not good after its commit (`replicas disagree: rank R,
tensor T`), restore and replication pass over it by its manifest alone. With ≥ 3 replicas the
minority is named per tensor; with 2 (no majority) rank 0, the writer, is the reference. A
preemption's save gathers nothing (a collective could hang while other ranks are not saving) and its
copy says so (`checked: false`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ckptstore.format.crc import checksum, format_crc
from ckptstore.format.manifest import Manifest

__all__ = ["AGREEMENT_KEY", "hashes", "disagreement", "agreement_metadata", "unchecked_metadata", "disagreement_of"]

AGREEMENT_KEY = "replica_agreement"  # in a copy's manifest metadata
TENSORS_NAMED = 3  # a reason names this many tensors at most, then how many more


def hashes(views: Mapping[str, np.ndarray]) -> dict[str, str]:
    """Each tensor's CRC32C as a manifest records it, by its key in the checkpoint."""
    return {key: format_crc(checksum(np.ascontiguousarray(view))) for key, view in views.items()}


def disagreement(by_rank: Sequence[Mapping[str, str | None]], names: Mapping[str, str] | None = None) -> str | None:
    """None when every rank holds the same tensors with the same hashes; else the reason a save is not
    good: `replicas disagree: rank R, tensor T` (per differing tensor the ranks outside its majority,
    rank 0's value as the reference where no value has one; tensors by `names` where given)."""
    differing: dict[str, list[int]] = {}
    for key in sorted(set().union(*by_rank)):
        values = [ranked.get(key) for ranked in by_rank]
        if len(set(values)) == 1:
            continue
        majority, votes = Counter(values).most_common(1)[0]
        if votes * 2 <= len(values):
            majority = values[0]
        differing[key] = [rank for rank, value in enumerate(values) if value != majority]
    if not differing:
        return None
    ranks = sorted({rank for named in differing.values() for rank in named})
    shown = [(names or {}).get(key, key) for key in differing]
    tensors = ", ".join(shown[:TENSORS_NAMED])
    if len(shown) > TENSORS_NAMED:
        tensors += f" and {len(shown) - TENSORS_NAMED} more"
    who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    return f"replicas disagree: {who}, tensor {tensors}"


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


def unchecked_metadata(ranks: int) -> dict[str, Any]:
    """What a copy says when its replicas were not compared (a preemption's save)."""
    return {AGREEMENT_KEY: {"ranks": ranks, "checked": False}}


def disagreement_of(manifest: Manifest) -> str | None:
    """The disagreement a copy holds: its writer's tensors (the manifest's CRCs) against the other
    ranks' hashes kept in its metadata. None when they agreed, were not compared, or no record says
    (a copy from a single process); a malformed record is a disagreement (it cannot be trusted)."""
    agreement = manifest.metadata.get(AGREEMENT_KEY)
    if not isinstance(agreement, Mapping) or agreement.get("checked") is not True:
        return None
    try:
        ranks, common = int(agreement["ranks"]), dict(agreement["replicas"])
        differing = {int(rank): dict(values) for rank, values in dict(agreement.get("differing", {})).items()}
        names = dict(agreement.get("names", {}))
    except (KeyError, TypeError, ValueError):
        return "replicas disagree: the copy's record of them is malformed"
    written = {record.name: record.crc32c for record in manifest.tensors}
    by_rank: list[dict[str, str | None]] = [{key: written.get(key) for key in common}]
    by_rank += [{**common, **differing.get(rank, {})} for rank in range(1, ranks)]
    return disagreement(by_rank, names)
