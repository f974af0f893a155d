"""A restart never trains a batch it had already committed unless it says so (issue 28), as a property:
random sequences of runs killed at random batches, the service going away and coming back, a corrupt
newest copy, and the job's node set changed by hand — real processes (tests/counter_job.py), a real
service, real storage. After every run: if it started behind the newest intact copy on storage, its
stderr says why (a refusal, a skipped copy, a resume behind newer copies, a start from scratch)."""

from __future__ import annotations

import os
import re
import subprocess
import uuid

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore import Position, Store
from ckptstore.errors import CkptStoreError, CorruptCheckpointError
from tests.conftest import service_settings
from tests.live import LiveService
from tests.test_resume_truth import counter_job

EPOCHS, BATCHES = 3, 8
SAID = re.compile(
    r"ResumeRefusedError|ConfigurationError|; skipped |behind its own newer copies|starts from scratch|"
    r"could not be recorded|NothingToRestoreError"
)
ACTIONS = st.one_of(
    st.tuples(
        st.just("train"), st.one_of(st.none(), st.tuples(st.integers(0, EPOCHS - 1), st.integers(0, BATCHES - 1)))
    ),
    st.tuples(st.just("service"), st.booleans()),
    st.tuples(st.just("corrupt"), st.none()),
    st.tuples(st.just("declare"), st.sampled_from([("n0",), ("n0", "n1")])),
)


class World:
    """A service that can be stopped and started again on its port, and its storage root."""

    def __init__(self, tmp: str):
        self.settings = service_settings(tmp, f"sqlite:///{tmp}/svc.db")
        self.storage = self.settings.default_storage
        self.live: LiveService | None = LiveService(self.settings)
        self.port = self.live.port
        self.url = self.live.url

    def up(self, wanted: bool) -> None:
        if wanted and self.live is None:
            self.live = LiveService(self.settings, port=self.port)
        elif not wanted and self.live is not None:
            self.live.stop()
            self.live = None


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    world = World(str(tmp_path_factory.mktemp("restarts")))
    yield world
    world.up(False)


def resume_point(store: Store, job: str) -> tuple[int, int]:
    """Where a run should start: after the newest position whose copy verifies (epoch, batch)."""
    for position in reversed(store.list_positions(job, "n0")):
        try:
            store.read(job, "n0", position)
        except CorruptCheckpointError:
            continue
        return (position.epoch + 1, 0) if position.batch is None else (position.epoch, position.batch)
    return (0, 0)


def corrupt_newest(store: Store, job: str) -> None:
    positions = store.list_positions(job, "n0")
    if not positions:
        return
    newest = max(store.copies(job, "n0", positions[-1]), key=lambda k: k.attempt_order)
    try:
        manifest = store.manifest(newest)
    except CkptStoreError:
        return  # an uncommitted leftover or an already damaged manifest: nothing more to damage
    shard = store._storage.path(manifest.shards[0].key(newest.relpath))
    with open(shard, "r+b") as handle:
        handle.seek(os.path.getsize(shard) - 4)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.slow  # a long run: scripts/test.sh -m slow runs it (the default run stays near 30 minutes)
@settings(
    max_examples=int(os.environ.get("CKPTSTORE_RESTART_EXAMPLES", "8")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(actions=st.lists(ACTIONS, min_size=2, max_size=7))
def test_a_restart_never_trains_committed_batches_again_without_saying_so(world, tmp_path, actions):
    job = f"prop-{uuid.uuid4().hex[:8]}"
    store = Store(world.storage)
    args = ["--service", world.url, "--epochs", str(EPOCHS), "--batches", str(BATCHES)]
    world.up(True)
    try:
        for action, value in actions:
            if action == "service":
                world.up(value)
            elif action == "corrupt":
                corrupt_newest(store, job)
            elif action == "declare" and world.live is not None:
                httpx.put(f"{world.url}/v1/jobs/{job}", json={"nodes": list(value), "storage_root": world.storage})
            elif action == "train":
                expected = resume_point(store, job)
                kill = [] if value is None else ["--kill-at", f"{value[0]}.{value[1]}"]
                try:
                    result, trained = counter_job(tmp_path, world.storage, job, *args, *kill, timeout=90)
                except subprocess.TimeoutExpired as exc:
                    raise AssertionError(f"{actions}: a run hung:\n{exc.stderr}") from None
                said = SAID.search(result.stderr) is not None
                if result.returncode not in (0, -9):
                    assert said and not trained, f"a failed start says why:\n{result.stderr[-2000:]}"
                elif trained and trained[0][:2] < expected:
                    assert said, f"{actions}: started at {trained[0][:2]}, committed up to {expected}:\n{result.stderr}"
    finally:
        world.up(True)


def test_the_property_sees_a_silent_restart_from_scratch(world, tmp_path):
    """The check above can fail: a run that ignores what storage holds (a fresh storage view) is caught."""
    job = f"prop-{uuid.uuid4().hex[:8]}"
    store = Store(world.storage)
    result, _ = counter_job(tmp_path, world.storage, job, "--kill-at", "1.5")
    assert result.returncode == -9 and resume_point(store, job) == (1, 3)
    fresh, trained = counter_job(tmp_path, world.storage, f"{job}-other", "--epochs", "1")
    assert fresh.returncode == 0 and trained[0][:2] == (0, 0) < resume_point(store, job)
    assert SAID.search(fresh.stderr) is None, "a silent start looks like this: the property would flag it"
    assert Position(1, 3) in store.list_positions(job, "n0")
