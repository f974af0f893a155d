"""The resume audit on the client: the checkpoint's fingerprint against the live run's
(ckptstore.fingerprint), what `resume_check` makes of drift, and how the verdict is said.

The verdict is said where a user looks — the one resume line, every difference on a line of its
own under it — kept with the attempt on the service (`resume.audited`), and under
resume_check="raise" a drift refuses the restore before anything is assigned.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ckptstore import Position
from ckptstore.client.engine.reports import Reports
from ckptstore.errors import ResumeDriftError
from ckptstore.fingerprint import FINGERPRINT_KEY, differences, verdict
from ckptstore.wire.schema import PositionBody, ResumeAudit

if TYPE_CHECKING:
    from ckptstore.copies import Restored

__all__ = [
    "AuditedNode",
    "audit",
    "judged",
    "audit_restored",
    "refuse_drift",
    "said",
    "declared_data",
]


class AuditedNode(Protocol):
    """What the audit needs of a node (`ckptstore.client.engine.node.NodeCheckpointer`): where its audit goes."""

    job: str
    node: str
    reports: Reports

    def report_audit(self, audit: ResumeAudit) -> None: ...


def declared_data(loop: str, data: Mapping[str, Any] | None) -> dict[str, Any]:
    """The fingerprint's data part for a loop that picks its batches from (epoch, batch) and says how
    (`data=`: seed, batch_size, length, shuffle, …): recorded with every save, compared at every resume."""
    return {} if data is None else {"loop": {"type": loop, **json.loads(json.dumps(dict(data)))}}


def audit(position: Position, metadata: Mapping[str, Any], live: Mapping[str, Any]) -> ResumeAudit:
    """The audit of resuming at `position` from a checkpoint with `metadata` into the `live` run. A
    checkpoint written before fingerprints existed has nothing to compare: that is drift, said so."""
    saved = metadata.get(FINGERPRINT_KEY)
    if not isinstance(saved, Mapping):
        found = ["checkpoint: written without a fingerprint (an older ckptstore): nothing to compare"]
    else:
        found = differences(saved, live)
    found = [f[:1000] for f in found[:200]]
    return ResumeAudit(position=PositionBody.of(position), verdict=verdict(found, live), differences=found)


def judged(
    report: ResumeAudit, checkpointer: AuditedNode, resume_check: str, *, mid_epoch: bool = False
) -> ResumeAudit:
    """Keep the restore's audit with the attempt; under resume_check="raise" a drift — or an
    unverified resume from a `mid_epoch` position — refuses, once its audit is on record, before
    anything is assigned."""
    checkpointer.report_audit(report)
    if resume_check == "raise" and (report.verdict == "drift" or (report.verdict == "unverified" and mid_epoch)):
        checkpointer.reports.drain(timeout=5)
        refuse_drift(report, checkpointer.job, checkpointer.node)
    return report


def audit_restored(
    restored: Restored, checkpointer: AuditedNode, resume_check: str, live: Callable[[], Mapping[str, Any]]
) -> ResumeAudit | None:
    """The declared audit of a restored copy against the live run's fingerprint (`live`, taken only when
    the check is on); a drift is `judged` at once (the proof has nothing to add); None under
    resume_check="off"."""
    if resume_check == "off":
        return None
    report = audit(restored.copy.position, restored.checkpoint.manifest.metadata, live())
    return judged(report, checkpointer, resume_check) if report.verdict == "drift" else report


def refuse_drift(report: ResumeAudit, job: str, node: str) -> None:
    """resume_check="raise": a drift (or an unverified mid-epoch resume) stops the restore, naming
    every difference."""
    if report.verdict in ("drift", "unverified"):
        found = "drift" if report.verdict == "drift" else "a mid-epoch resume it cannot verify"
        raise ResumeDriftError(
            f"{job}/{node}: the resume audit found {found} (resume_check='raise'; no batch was trained on the "
            f"restored state):{said(report)}",
            differences=tuple(report.differences),
        )


def said(report: ResumeAudit, *, pending: bool = False) -> str:
    """The verdict as the resume line ends: `resume audit: exact`, or the differences, one per line;
    `pending`: the declared state matches and the proof is made at the first step."""
    if pending:
        return "; resume audit: the declared state matches, proof at the first step"
    if report.verdict == "exact":
        return "; resume audit: exact"
    lines = "".join(f"\n  - {difference}" for difference in report.differences)
    if report.verdict == "resharded":
        return (
            "; resume audit: resharded — each rank goes on with the saved global order of samples on this "
            f"world size (not bit-exact: the ranks and their random streams changed):{lines}"
        )
    if report.verdict == "unverified":
        return f"; resume audit: unverified, not shown to be exact:{lines}"
    return f"; resume audit: DRIFT, not an exact resume ({len(report.differences)} difference(s)):{lines}"
