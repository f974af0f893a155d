"""Restore the newest intact copy: the newest position that every node of the job can verify.

With the service (docs/design.md, "Restore"): ask for the resume position; read this node's part
there, nearest tier first, newest attempt first, every byte verified before anything is assigned (or,
in one pass, as it is assigned: `fall_back`);
mark each copy that fails (`corrupt` / `missing`, with the reason) so the judge demotes the
position and no later restart trips on it; report where this attempt resumed and what it skipped;
then wait until every expected node reported the same position (the restore agreement) — if
another node demoted it meanwhile, move to the position the judge answers now.
Without the service: the newest position on any tier whose copy verifies, the same way.
When no position is left, the error names every copy tried and why it failed; nothing is ever
started from scratch silently.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Protocol, TypeVar

from ckptstore import Position, Store
from ckptstore.agreement import disagreement_of
from ckptstore.client.service.rest import ServiceClient
from ckptstore.copies import NoIntactCopyError, Restored, Skipped, read_nearest_intact
from ckptstore.copykey import CopyKey
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    CorruptCheckpointError,
    ServiceUnavailableError,
    StorageUnavailableError,
)
from ckptstore.names import Tier
from ckptstore.wire.schema import LastGood, SkippedCopy

__all__ = ["Restorer", "NothingToRestoreError", "AGREEMENT_WAIT_S", "restore_in_one_pass"]

log = logging.getLogger("ckptstore.client")
T = TypeVar("T")
AGREEMENT_WAIT_S = 20.0  # how long one agreement request waits at the service (under proxies' read timeouts)
AGREEMENT_POLL_S = (0.2, 2.0)  # the first wait between two agreement polls, and the longest


def agreement_poll_s(polls: int) -> float:
    """With a service that answers the agreement at once (one older than `?wait_s=`), the wait before
    the next poll after `polls` of them: from 0.2 s growing to 2 s, each ±50 % at random, so that the
    nodes of a job restarting together do not poll in lockstep."""
    first, longest = AGREEMENT_POLL_S
    return min(longest, first * 1.5**polls) * random.uniform(0.5, 1.5)


class OnePassStart(Protocol):
    """What `restore_in_one_pass` needs of a node (`ckptstore.client.engine.node.NodeCheckpointer`)."""

    def start(self, *, one_pass: bool = False) -> Restored | None: ...

    def fall_back(self, failed: Restored, error: CorruptCheckpointError) -> Restored: ...


def restore_in_one_pass(node: OnePassStart, use: Callable[[Restored], T]) -> tuple[Restored, T] | None:
    """Start `node` and `use` the copy it restores, each tensor checked as `use` reads it (one pass, where
    the node takes it: `NodeCheckpointer.start`); when one fails, `use` the next intact copy instead —
    so `use` must overwrite everything a failed call reached, or read into new memory only. None on a
    fresh job; NothingToRestoreError when no intact copy is left."""
    restored = node.start(one_pass=True)
    while restored is not None:
        try:
            return restored, use(restored)
        except CorruptCheckpointError as exc:
            restored = node.fall_back(restored, exc)
    return None


class NothingToRestoreError(CheckpointNotFoundError):
    """Checkpoints exist, but no position has an intact copy of this node's part."""


class Restorer:
    """One node's restore over its tiers, with the service as the judge when there is one."""

    def __init__(
        self,
        *,
        job: str,
        node: str,
        tiers: Mapping[Tier, Store],
        client: ServiceClient | None,
        attempt: str | None,
        timeout_s: float,
        answered: LastGood | None = None,
        one_pass: bool = False,
    ):
        self.job, self.node, self.tiers = job, node, tiers
        self.client, self.attempt, self.timeout_s = client, attempt, timeout_s
        self.answered = answered  # the service's answer the start brought: the first position asked is answered
        # A local copy's bytes checked as they are read into place (`fall_back`): only where the copy it falls
        # back to overwrites every target (a strict restore) and no other node waits for this one (one node).
        self.one_pass = one_pass
        self.skipped: list[Skipped] = []
        self._failed: set[CopyKey] = set()  # copies found damaged while read into place

    def restore(self) -> Restored | None:
        """The verified checkpoint to resume from (with every copy skipped on the way), or None on a fresh job."""
        if self.client is not None:
            try:
                return self._with_service(self.client)
            except ServiceUnavailableError as exc:
                log.warning("service unreachable (%s): finding the newest intact copy on storage", exc)
        return self._from_storage()

    def fall_back(self, failed: Restored, error: CorruptCheckpointError) -> Restored:
        """The next copy to restore, after `failed` was found damaged while its tensors were read into place
        (one pass): it is marked and passed over like a copy that failed its check, and the search
        goes on. The caller overwrites every target from the copy returned, or raises; NothingToRestoreError
        when no intact copy is left. Without one pass the copy was checked whole before and changed underneath:
        `error` is raised (its targets hold a mix and no fallback is safe here)."""
        if not self.one_pass:
            raise error
        skipped = Skipped(failed.copy, "missing" if error.missing else "corrupt", str(error))
        self._failed.add(failed.copy)
        self.skipped.append(skipped)
        log.warning("restore skipped %s", skipped)
        if self.client is not None:
            try:
                self._mark_one(self.client, skipped)
            except ServiceUnavailableError as exc:
                log.warning("service unreachable (%s): %s stays unmarked for now", exc, failed.copy)
        restored = self.restore()
        if restored is None:
            raise self._nothing_left()
        return restored

    def preview(self) -> Restored | None:
        """The copy `restore` would take now, verified, changing nothing: nothing is marked or
        reported, and no other node is waited for (a dry run: `check_restore`)."""
        if self.client is not None:
            try:
                position = self._resume_position(self.client)
            except ServiceUnavailableError as exc:
                log.warning("service unreachable (%s): finding the newest intact copy on storage", exc)
            else:
                if position is None:
                    return None
                return read_nearest_intact(self.tiers, self.job, self.node, position, deferred=True)
        return self._from_storage()

    # -- with the service ------------------------------------------------------------------------

    def _with_service(self, client: ServiceClient) -> Restored | None:
        deadline = time.monotonic() + self.timeout_s
        failed: set[Position] = set()
        while True:
            position = self._resume_position(client)
            if position is None:
                if self.skipped:
                    raise self._nothing_left()
                self._report(client, None)
                return None
            if position in failed:
                raise CkptStoreError(f"the service still answers {position} after {self.node}'s part was marked bad")
            try:
                restored = self._read(position)
            except NoIntactCopyError as exc:
                self._mark(client, position, exc.skipped, whole_part=True)
                failed.add(position)
                continue
            self._mark(client, position, restored.skipped, whole_part=False)
            self._report(client, position)
            if self._agreed(client, position, deadline):
                return replace(restored, skipped=tuple(self.skipped))

    def _resume_position(self, client: ServiceClient) -> Position | None:
        answered, self.answered = self.answered, None
        try:
            resume = (answered or client.last_good_epoch(self.job, node=self.node)).resume
        except CheckpointNotFoundError:
            return None  # the job is not declared yet: a fresh start
        return None if resume is None else resume.to_position()

    def _mark(
        self, client: ServiceClient, position: Position, skipped: tuple[Skipped, ...], *, whole_part: bool
    ) -> None:
        """Tell the service about every copy that failed, so the judge demotes what it must; when no
        copy of the part verified (`whole_part`), the copies it records that storage lacks are missing too."""
        self.skipped.extend(skipped)
        for passed in skipped:
            log.warning("restore skipped %s", passed)
            self._mark_one(client, passed)
        if not whole_part:
            return
        tried = {s.copy for s in skipped}
        for record in client.list_checkpoints(self.job, node=self.node, epoch=position.epoch, state="committed"):
            if record.key.position == position and record.key not in tried:
                gone = Skipped(record.key, "missing", "recorded, but not on storage")
                self.skipped.append(gone)
                log.warning("restore skipped %s", gone)
                self._mark_one(client, gone)

    @staticmethod
    def _mark_one(client: ServiceClient, skipped: Skipped) -> None:
        try:
            client.mark(skipped.copy, skipped.state, cause="restore", reason=f"restore: {skipped.reason}")
        except CheckpointNotFoundError:
            pass  # a copy the service never recorded (a leftover on storage)

    def _report(self, client: ServiceClient, position: Position | None) -> None:
        if self.attempt is None or "-" in self.attempt:
            return  # processes that do not write, and offline attempts, have nothing to report
        skipped = [
            SkippedCopy(
                epoch=s.copy.position.epoch,
                batch=s.copy.position.batch,
                attempt=s.copy.attempt,
                tier=s.copy.tier,
                state=s.state,
                reason=s.reason[:1000],
            )
            for s in self.skipped
        ]
        client.report_resume(self.job, self.node, self.attempt, resumed_from=position, skipped=skipped)

    def _agreed(self, client: ServiceClient, position: Position, deadline: float) -> bool:
        """Wait until every expected node verified `position` (True), or the judge moved on (False). The
        service holds each request until then (up to AGREEMENT_WAIT_S); one that answers at once (an
        older service) is asked again after `agreement_poll_s`."""
        polls = 0
        while True:
            asked = time.monotonic()
            wait_s = max(0.0, min(AGREEMENT_WAIT_S, deadline - asked))
            agreement = client.resume_agreement(self.job, wait_s=wait_s)
            current = None if agreement.resume is None else agreement.resume.to_position()
            if current != position:
                return False
            if agreement.agreed:
                return True
            if time.monotonic() > deadline:
                unnamed = agreement.waiting_count - len(agreement.waiting)
                names = ", ".join(agreement.waiting) + (f" and {unnamed} more" if unnamed > 0 else "")
                raise CkptStoreError(
                    f"nodes {names} of job {self.job!r} did not verify {position} within "
                    f"{self.timeout_s:g} s: resuming without them could start the nodes from different positions"
                )
            if time.monotonic() - asked < wait_s / 2:
                time.sleep(agreement_poll_s(polls))
                polls += 1

    # -- without the service ---------------------------------------------------------------------

    def _from_storage(self) -> Restored | None:
        said, found = len(self.skipped), set[Position]()
        for tier, store in self.tiers.items():
            try:  # positions with a manifest: which of them verify, reading nearest-first tells
                found.update(key.position for key in store.manifest_keys(self.job, self.node))
            except StorageUnavailableError as exc:
                log.warning("the %s tier is away (%s): restoring from the others", tier, exc)
        positions = sorted(found, reverse=True)
        for position in positions:
            try:
                restored = self._read(position)
            except NoIntactCopyError as exc:
                self.skipped.extend(exc.skipped)
                continue
            disagree = disagreement_of(restored.checkpoint.manifest)
            if disagree is not None:  # the service would have it marked: without one, its manifest says so
                self.skipped.append(Skipped(restored.copy, "corrupt", disagree))
                continue
            self.skipped.extend(restored.skipped)
            for passed in self.skipped[said:]:
                log.warning("restore skipped %s", passed)
            return replace(restored, skipped=tuple(self.skipped))
        if self.skipped:
            raise self._nothing_left()
        return None

    def _read(self, position: Position) -> Restored:
        return read_nearest_intact(
            self.tiers, self.job, self.node, position, deferred=True, one_pass=self.one_pass, exclude=self._failed
        )

    def _nothing_left(self) -> NothingToRestoreError:
        tried = "; ".join(str(s) for s in self.skipped)
        return NothingToRestoreError(f"no intact copy of {self.job}/{self.node} is left to resume from: {tried}")
