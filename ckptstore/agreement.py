"""Replica agreement: data-parallel replicas (DDP) must hold bit-identical model and optimizer state.
At each save every rank hashes its state (CRC32C per tensor, the checksum the writer records), the
hashes go to the writing rank in the collective that already gathers every rank's RNG, and a
difference makes that save not good: its copy is marked `corrupt` with the reason
`replicas disagree: rank R, tensor T` (the service emits `replicas.disagreed`), so a resume goes to
the newest position where the replicas agreed. With ≥ 3 replicas the minority is named per tensor;
with 2, the rank that is not the writer. A preemption's save gathers nothing (a collective could
hang while other ranks are not saving) and its copy says so (`checked: false`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ckptstore.format.crc import checksum

__all__ = ["AGREEMENT_KEY", "hashes", "disagreement", "agreement_metadata", "disagreement_of"]

AGREEMENT_KEY = "replica_agreement"  # in a copy's manifest metadata
TENSORS_NAMED = 3  # a reason names this many tensors at most, then how many more


def hashes(views: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Each tensor's CRC32C, by its name in the checkpoint."""
    return {name: checksum(np.ascontiguousarray(view)) for name, view in views.items()}


def disagreement(by_rank: Sequence[Mapping[str, int]]) -> str | None:
    """None when every rank holds the same tensors with the same hashes; else the reason a save is not
    good: `replicas disagree: rank R, tensor T` (the minority ranks of each differing tensor, the
    writer's majority as the reference with two ranks)."""
    differing: dict[str, list[int]] = {}
    for name in sorted(set().union(*by_rank)):
        values = [ranked.get(name) for ranked in by_rank]
        if len(set(values)) == 1:
            continue
        counts = Counter(values)
        majority, votes = counts.most_common(1)[0]
        if votes * 2 <= len(values):  # no majority (two ranks, or a tie): the writer, rank 0, is the reference
            majority = values[0]
        differing[name] = [rank for rank, value in enumerate(values) if value != majority]
    if not differing:
        return None
    ranks = sorted({rank for named in differing.values() for rank in named})
    names = list(differing)
    shown = ", ".join(names[:TENSORS_NAMED]) + (
        f" and {len(names) - TENSORS_NAMED} more" if len(names) > TENSORS_NAMED else ""
    )
    rank_words = (
        "rank " + ", ".join(str(r) for r in ranks) if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    )
    return f"replicas disagree: {rank_words}, tensor {shown}"


def agreement_metadata(ranks: int, *, checked: bool, reason: str | None) -> dict[str, Any]:
    """What a copy's manifest says of its replicas' agreement."""
    return {AGREEMENT_KEY: {"ranks": ranks, "checked": checked, "disagree": reason}}


def disagreement_of(metadata: Mapping[str, Any]) -> str | None:
    """The disagreement a copy's manifest records (None: the replicas agreed, or it was not checked)."""
    agreement = metadata.get(AGREEMENT_KEY)
    if not isinstance(agreement, Mapping):
        return None
    reason = agreement.get("disagree")
    return reason if isinstance(reason, str) else None
