"""The resume proof: what the resumed run does, checked against what the saved run would have done next.

The audit (client/audit/declared.py) compares what the code declares — types, shapes, seeds, loader
settings. That is not a proof: a pipeline that replays another order, a loop that skips an epoch,
an iterator that was never put back all declare the same. So each save also records, in its
fingerprint under PROOF_KEY, what the run would do next: the ids of the samples each data object
would hand out next (where ckptstore can see them), and the framework's counters for the next step
(epoch, batch, global step). After a restore the adapter watches the live run: each watched data
object reports the ids it hands out first, the adapter the counters its first step runs with, and
the proof settles —

- `exact` (or the audit's `resharded`) only when everything recorded was seen, and matched;
- `drift` when anything seen differs, each difference named;
- `unverified` when the data could not be observed (said why): never `exact`.

Where a save cannot tell what comes next — an epoch's end whose order is drawn only as the next
iterator is made (torchdata's shuffling loader, Keras' `fit`, Lightning's and HF's loaders), a custom
loop that shows its batches (`LoopManager.observe_batch`) — the saved run records it late: what it drew
first after the save is kept beside the copy (client/audit/late_record.py; the store's
`record_drawn_next`, written once the copy is committed), and a resume from that copy checks its first
draws against it. A run killed before it drew after the save left no record: its resume is `unverified`.

Settled once: said on a line of its own, kept with the attempt (`resume.audited`), and under
resume_check="raise" a drift refuses before the first batch trains (`ResumeDriftError`); an
unverified mid-epoch resume is refused at the restore, before anything is assigned.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ckptstore.client.audit.declared import AuditedNode, refuse_drift, said
from ckptstore.fingerprint import FINGERPRINT_KEY
from ckptstore.wire.schema import ResumeAudit

__all__ = [
    "PROOF_KEY",
    "recorded",
    "ResumeProof",
    "GLOBAL_ORDER",
    "BATCH_BEFORE",
    "FIRST_BATCH",
    "start_proof",
]

PROOF_KEY = "proof"
GLOBAL_ORDER = "global"  # a data object's next ids in the global order of every rank (resharded: any world size)
BATCH_BEFORE = "batch_before"  # the digest of the batch trained last before a mid-epoch save (Keras' fit)
FIRST_BATCH = "first_batch"  # the digest of the first batch trained after a save (Keras' fit, a custom loop; late)
_SHOWN = 6  # ids shown of a batch that differs


def recorded(
    *, counters: Mapping[str, int | None] | None = None, next_ids: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """What a save records for the proof: the counters of the next step (None: not known, not
    compared) and, per data object, the ids of the samples it would hand out next — a list for this
    rank, or {GLOBAL_ORDER: [...]} for a global order the ranks share round-robin — or, where the
    samples have no ids, {BATCH_BEFORE: digest} of the batch trained last (its resume draws it again)."""
    return {
        "counters": {key: value for key, value in (counters or {}).items() if value is not None},
        "next": dict(next_ids or {}),
    }


def _shown(ids: Sequence[int]) -> str:
    more = ", …" if len(ids) > _SHOWN else ""
    return "[" + ", ".join(str(i) for i in ids[:_SHOWN]) + more + "]"


class ResumeProof:
    """One restore's proof (see the module docstring). `declared` is its audit (exact or resharded);
    `saved` the checkpoint's PROOF_KEY record (None: an older copy); `watched` the data objects the
    adapter watches; `counting` whether it reports the first step's counters; `unobservable` why
    the data cannot be seen, when the adapter cannot watch it at all."""

    def __init__(
        self,
        declared: ResumeAudit,
        saved: Mapping[str, Any] | None,
        node: AuditedNode,
        resume_check: str,
        *,
        mid_epoch: bool,
        world: tuple[int, int] = (1, 0),
        watched: Iterable[str] = (),
        counting: bool = False,
        unobservable: str | None = None,
        late: Callable[[], Mapping[str, Any] | None] | None = None,
        hint: str | None = None,
    ):
        self.declared, self.node, self.resume_check, self.mid_epoch = declared, node, resume_check, mid_epoch
        self.world = world
        saved = saved if isinstance(saved, Mapping) else {}
        self.counters: dict[str, Any] = dict(saved.get("counters") or {}) if counting else {}
        expected = dict(saved["next"]) if isinstance(saved.get("next"), Mapping) else None
        watched = set(watched)
        if expected is not None and unobservable is None and late is not None and watched - set(expected):
            expected |= self._recorded_late(late(), watched - set(expected))
        self.expected = {name: ids for name, ids in (expected or {}).items() if name in watched}
        self.unseen: list[str] = []
        if expected is None:
            self.unseen.append(
                "checkpoint: written before resume proofs (an older ckptstore): nothing recorded to check"
            )
        elif unobservable is not None:
            self.unseen.append(f"data: {unobservable}")
        elif not watched:
            self.unseen.append(
                "data: no data loader or sampler in objects, so the batches this run draws are not checked (put "
                "the DataLoader or sampler in objects)"
            )
        else:
            self.unseen += [
                f"data ({name}): what it would hand out next could not be told at the save (an epoch's end whose "
                "order is drawn as the next iterator is made, or a sampler ckptstore cannot follow), and the saved "
                "run recorded nothing it drew after it (it ended or was killed first, or another rank drew it)"
                + (f"; {hint}" if hint else "")
                for name in sorted(watched - set(expected))
            ]
            self.unseen += [
                f"data ({name}): recorded, but not in objects now" for name in sorted(set(expected) - watched)
            ]
        self.seen: dict[str, int] = {}
        self.evidence: dict[str, str] = {}  # what was seen of each data object, said with the verdict
        self.found: list[str] = []
        self.result: ResumeAudit | None = None
        self.said_counters = ""
        self.stepped = False  # the first step began (its counters compared)

    def _recorded_late(self, record: Mapping[str, Any] | None, names: set[str]) -> dict[str, Any]:
        """What the saved run drew first after the save (client/audit/late_record.py), of the data objects in `names`:
        only where this process is the one that drew it (the same world and rank), else nothing."""
        if not isinstance(record, Mapping) or not isinstance(record.get("next"), Mapping):
            return {}
        if list(record.get("world") or []) != list(self.world):
            return {}
        return {name: ids for name, ids in record["next"].items() if name in names}

    @property
    def awaiting_first_batch(self) -> set[str]:
        """The data objects checked by the hash of their first batch after the restore (FIRST_BATCH: Keras'
        `fit` from an epoch's end, reported once it trained; a custom loop's, as it shows it), not yet
        reported: the proof settles once they are."""
        return {
            name
            for name, record in self.expected.items()
            if isinstance(record, Mapping) and FIRST_BATCH in record and not self.seen.get(name)
        }

    @property
    def settled(self) -> bool:
        return self.result is not None

    @property
    def observable(self) -> bool:
        """Whether anything is left to watch — else the proof settles at the restore, as it does when
        it can no longer pass under resume_check="raise" (unverified, mid-epoch)."""
        refused = bool(self.unseen) and self.mid_epoch and self.resume_check == "raise"
        return bool(self.expected or self.counters) and not refused

    def _expected_ids(self, name: str) -> list[int]:
        record = self.expected[name]
        if isinstance(record, Mapping):  # a global order: this rank's share of it on the live world
            size, rank = self.world
            return list(record.get(GLOBAL_ORDER, []))[rank::size]
        return list(record)

    def drawn(self, name: str, ids: Sequence[int]) -> None:
        """The live data object `name` hands out `ids` (in order, following any already reported):
        compared with what the saved run would have drawn; a difference settles the proof as drift."""
        if self.settled or name not in self.expected:
            return
        record = self.expected[name]
        if isinstance(record, Mapping) and FIRST_BATCH in record:
            self._first_batch(name, int(ids[0]), record[FIRST_BATCH])
            return
        if isinstance(record, Mapping) and BATCH_BEFORE in record:
            saved = record[BATCH_BEFORE]  # a batch's ids, or the digest of its values
            self._batch_before(name, [int(i) for i in ids] if isinstance(saved, list) else int(ids[0]), saved)
            return
        expected, start = self._expected_ids(name), self.seen.get(name, 0)
        ids = [int(i) for i in ids][: max(0, len(expected) - start)]
        if ids != expected[start : start + len(ids)]:
            self.found.append(
                f"data ({name}): the first samples drawn after the restore are {_shown(ids)}; the saved run's "
                f"next were {_shown(expected[start : start + len(ids)])} (not the saved run's data stream)"
            )
            self.settle()
            return
        self.seen[name] = start + len(ids)
        self.evidence[name] = f"the first {self.seen[name]} sample ids {name} handed out"

    def remade(self, name: str) -> None:
        """The data object `name` made another iterator after its first ids were seen, before the first
        step: the batches trained may not be the ones seen (a loop that drew once, then began again)."""
        if not self.settled:
            self.unseen.append(
                f"data ({name}): another iterator was made after its first ids were seen and before the first "
                "step, so the batches trained may not be the ones checked (a loop that drew from the loader, "
                "then began again)"
            )

    def _batch_before(self, name: str, drawn: Any, saved: Any) -> None:
        """The batch before the resumed position, drawn again after the restore, against the saved run's."""
        said = (
            f"samples {_shown(drawn)}, saved {_shown(saved)}"
            if isinstance(saved, list)
            else f"digest {drawn}, saved {saved}"
        )
        self._one_batch(
            name,
            drawn == saved,
            f"the batch before the resumed position, drawn again to skip it, is not the saved run's ({said})",
            "batch before the position (drawn again to skip it)",
        )

    def _first_batch(self, name: str, drawn: int, saved: Any) -> None:
        """The first batch trained after the restore, against the one the saved run trained after the save."""
        matched = self._one_batch(
            name,
            drawn == saved,
            f"the first batch trained after the restore (digest {drawn}) is not the one the saved run trained "
            f"after the save (digest {saved})",
            "first batch (the one the saved run trained after the save)",
        )
        if matched and self.stepped and not self.awaiting_first_batch:
            self.settle()

    def _one_batch(self, name: str, same: bool, differs: str, seen: str) -> bool:
        """One batch of `name` checked (`same`): a difference settles the proof as drift, said as
        `differs`; a match is evidence, said as `seen`. Returns whether it matched."""
        if not same:
            self.found.append(f"data ({name}): {differs}: the resumed epoch does not draw the saved run's order")
            self.settle()
            return False
        self.seen[name] = 1
        self.evidence[name] = f"{name}'s {seen}"
        return True

    def step(self, counters: Mapping[str, int | None]) -> None:
        """The first step after the restore begins with `counters` (before it trains): compared with the
        saved run's next step, and the proof settles on what was seen."""
        if self.settled:
            return
        compared = [key for key in self.counters if counters.get(key) is not None]
        if compared:
            self.said_counters = ", ".join(f"{key} {counters[key]}" for key in compared)
        differ = [key for key in compared if counters[key] != self.counters[key]]
        if differ:
            now = ", ".join(f"{key} {counters[key]}" for key in differ)
            then = ", ".join(f"{key} {self.counters[key]}" for key in differ)
            self.found.append(
                f"counters: the first step after the restore runs at {now}; the saved run's next was {then}"
            )
        self.stepped = True
        if self.found or not self.awaiting_first_batch:
            self.settle()

    def settle(self, why_unseen: str | None = None) -> ResumeAudit:
        """The verdict on what was seen (`why_unseen`: why a watched object reported nothing, e.g. no
        batch was drawn): said, kept with the attempt, and under resume_check="raise" a drift — or an
        unverified mid-epoch resume — raises."""
        if self.result is not None:
            return self.result
        unseen = list(self.unseen)
        for name in sorted(self.expected):
            if not self.seen.get(name) and not self.found:
                unseen.append(f"data ({name}): {why_unseen or 'drew nothing before the first step'}")
        if self.found:
            result = ResumeAudit(position=self.declared.position, verdict="drift", differences=self.found)
        elif unseen:  # what was declared different (another world size) stays said
            differences = [*self.declared.differences, *unseen]
            result = ResumeAudit(position=self.declared.position, verdict="unverified", differences=differences)
        else:
            result = self.declared
        self.result = result
        self.node.report_audit(result)
        if self.observable or self.found:
            print(
                f"ckptstore: {self.node.job}/{self.node.node} {self._proof_line(result)}", file=sys.stderr, flush=True
            )
        if self.resume_check == "raise" and (
            result.verdict == "drift" or (result.verdict == "unverified" and self.mid_epoch)
        ):
            self.node.reports.drain(timeout=5)
            refuse_drift(result, self.node.job, self.node.node)
        return result

    def _proof_line(self, result: ResumeAudit) -> str:
        seen = [self.evidence[name] for name in sorted(self.evidence)]
        if self.said_counters:
            seen.append(f"the first step's counters ({self.said_counters})")
        line = said(result).removeprefix("; ")
        if not seen or result.verdict == "drift":
            return line
        checked = f"{' and '.join(seen)} match the saved run's"
        if result.verdict == "unverified":
            head, _, rest = line.partition(":\n")
            return f"{head} ({checked}; not the data):\n{rest}"
        return f"{line} — proven: {checked}"


def start_proof(
    declared: ResumeAudit | None, metadata: Mapping[str, Any], node: AuditedNode, resume_check: str, **watching: Any
) -> ResumeProof | None:
    """The proof of a restore whose declared audit is `declared` (None, or a drift: nothing to prove),
    of the copy with `metadata`, `watching` as `ResumeProof` takes it (mid_epoch, world, watched,
    counting, unobservable, late, hint). With nothing the run can watch it settles at once — `unverified`,
    refused under resume_check="raise" from a mid-epoch position, before anything is assigned."""
    if declared is None or declared.verdict == "drift":
        return None
    fingerprint = metadata.get(FINGERPRINT_KEY)
    saved = fingerprint.get(PROOF_KEY) if isinstance(fingerprint, Mapping) else None
    proof = ResumeProof(declared, saved, node, resume_check, **watching)
    if not proof.observable:
        proof.settle()
    return proof
