"""A hypothesis state machine over save / crash mid-save / corrupt / gc / restore on local storage:
restoring always gives the newest fully committed, intact position, bit-exact, never a partial."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ckptstore import CopyKey, Position, Store, commit
from ckptstore.errors import CorruptCheckpointError
from ckptstore.retention import Candidate, RetentionPolicy, plan_deletions
from ckptstore.storage.filesystem import Storage


class Killed(BaseException):
    """Stands for SIGKILL: the process is gone, nothing after this point runs."""


class CheckpointMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="ckpt-sm-")
        self.store = Store(self.root, shard_size=4096)
        self.epoch = 0
        self.attempt = 1
        self.saved: dict[int, dict[str, np.ndarray]] = {}  # every committed position's arrays
        self.pristine: dict[str, bytes] = {}  # each damaged blob's bytes before the damage
        self.files: dict[int, set[str]] = {}  # the blobs each committed position's copy points into

    def _committed(self, epoch: int, arrays: dict[str, np.ndarray]) -> None:
        key = self._copy_of(epoch)
        self.saved[epoch] = arrays
        self.files[epoch] = {shard.key(key.relpath) for shard in self.store.manifest(key).shards}

    def _damaged(self) -> set[str]:
        """Blobs whose bytes differ from before their damage now (a later save that wrote the same blob
        anew — same content, so the same name — healed it for every copy pointing into it)."""
        damaged = set()
        for file, before in self.pristine.items():
            path = os.path.join(self.root, file)
            if os.path.exists(path) and open(path, "rb").read() != before:
                damaged.add(file)
        return damaged

    @property
    def intact(self) -> dict[int, dict[str, np.ndarray]]:
        damaged = self._damaged()
        return {e: arrays for e, arrays in self.saved.items() if not self.files[e] & damaged}

    @property
    def corrupt(self) -> set[int]:
        return set(self.saved) - set(self.intact)

    def teardown(self):
        shutil.rmtree(self.root, ignore_errors=True)

    @rule(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=4), seed=st.integers(0, 2**16))
    def save(self, sizes, seed):
        rng = np.random.default_rng(seed)
        arrays = {f"t{i}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate(sizes)}
        self.store.save("job", "n0", self.epoch, arrays, attempt=str(self.attempt))
        self._committed(self.epoch, arrays)
        self.epoch += 1

    @rule(writes_before_kill=st.integers(0, 6), sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=4))
    def crash_mid_save(self, writes_before_kill, sizes):
        """Killed after some shard writes: nothing is cleaned up; the next process is a new attempt."""
        original_write, original_discard = Storage.write_object, commit.discard_uncommitted
        budget = {"left": writes_before_kill}

        def write(storage, relpath, chunks, *size):
            if budget["left"] == 0:
                raise Killed()
            budget["left"] -= 1
            original_write(storage, relpath, chunks, *size)

        Storage.write_object, commit.discard_uncommitted = write, lambda *a: None
        try:
            arrays = {f"t{i}": np.ones(n, np.float32) for i, n in enumerate(sizes)}
            self.store.save("job", "n0", self.epoch, arrays, attempt=str(self.attempt))
            self._committed(self.epoch, arrays)  # the kill came after the last shard: it committed
            self.epoch += 1
        except Killed:
            pass
        finally:
            Storage.write_object, commit.discard_uncommitted = original_write, original_discard
        self.attempt += 1

    @precondition(lambda self: self.intact)
    @rule(data=st.data())
    def corrupt_a_shard(self, data):
        epoch = data.draw(st.sampled_from(sorted(self.intact)))
        shard = data.draw(st.sampled_from(sorted(self.files[epoch])))
        path = os.path.join(self.root, shard)
        self.pristine.setdefault(shard, open(path, "rb").read())
        with open(path, "r+b") as handle:
            handle.seek(data.draw(st.integers(0, os.path.getsize(path) - 1)))
            byte = handle.read(1)
            handle.seek(-1, os.SEEK_CUR)
            handle.write(bytes([byte[0] ^ 0xFF]))

    @rule(keep=st.integers(1, 3))
    def gc(self, keep):
        infos = self.store.list_checkpoints("job", "n0")
        candidates = [Candidate(i.key, i.committed, i.modified) for i in infos]
        good = {Position(e) for e in self.intact}
        policy = RetentionPolicy(keep_last=keep, grace_seconds=0)
        for deletion in plan_deletions(candidates, good=good, policy=policy, now=time.time() + 1):
            epoch = deletion.key.position.epoch
            self.store.delete_copy(deletion.key)
            if deletion.reason == "retention":
                self.saved.pop(epoch, None)

    def _copy_of(self, epoch: int) -> CopyKey:
        committed = [
            i for i in self.store.list_checkpoints("job", "n0") if i.key.position.epoch == epoch and i.committed
        ]
        return committed[-1].key

    @invariant()
    def restore_gives_the_newest_intact_position_bit_exact(self):
        positions = self.store.list_positions("job", "n0")
        assert {p.epoch for p in positions} == set(self.intact) | self.corrupt, "committed = saved, never partial"
        restored = None
        for position in reversed(positions):
            try:
                restored = (position.epoch, self.store.load("job", "n0", position.epoch))
                break
            except CorruptCheckpointError:
                assert position.epoch in self.corrupt
        if not self.intact:
            assert restored is None
            return
        epoch, arrays = restored
        assert epoch == max(self.intact)
        want = self.intact[epoch]
        assert set(arrays) == set(want) and all(arrays[k].tobytes() == want[k].tobytes() for k in want)


CheckpointMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("CKPTSTORE_SM_EXAMPLES", "30")),
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCheckpointMachine = CheckpointMachine.TestCase
