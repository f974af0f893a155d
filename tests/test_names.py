"""Hostile names and positions are refused before any storage call."""

from __future__ import annotations

import numpy as np
import pytest

from ckptstore import InvalidNameError, Position, Store
from ckptstore.names import validate_attempt, validate_name

BAD_NAMES = [
    "..",
    ".",
    "a/..",
    "../etc",
    "a/b",
    "a\\b",
    "%2e%2e",
    "%252e%252e",
    "%25252e%25252e",
    "job%2Fx",
    "a..b",
    "",
    "a\x00b",
    "x" * 129,
    "-lead",
    ".hidden",
    "a#b",
    "a?b",
    "a b",
    "é",
    "/abs",
    "C:\\x",
    None,
    5,
    b"job",
]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_bad_names_are_refused(name):
    with pytest.raises(InvalidNameError):
        validate_name(name)


@pytest.mark.parametrize("name", ["a", "worker-0", "Job_1.v2", "x" * 128, "0"])
def test_good_names_pass(name):
    assert validate_name(name) == name


@pytest.mark.parametrize("attempt", [0, -1, "01", "3-XYZ", "3-abc", "1/..", True, 10**10, "3-1a2b3c4d5"])
def test_bad_attempts_are_refused(attempt):
    with pytest.raises(InvalidNameError):
        validate_attempt(attempt)


@pytest.mark.parametrize(
    ("epoch", "batch"), [(-1, None), (10**10, None), (0, -1), (0, 10**10), (True, None), (1.0, None)]
)
def test_bad_positions_are_refused(epoch, batch):
    with pytest.raises(InvalidNameError):
        Position(epoch, batch)


class NoStorage:
    """A filesystem stand-in that fails the test on any use: proves validation comes first."""

    calls: list[str] = []

    def __getattr__(self, name):
        NoStorage.calls.append(name)
        raise AssertionError(f"storage was called ({name}) for a bad name")


def _guarded_store(tmp_path) -> Store:
    store = Store(str(tmp_path))
    store._storage.fs = NoStorage()
    store._storage.is_local = False
    return store


OPERATIONS = {
    "save": lambda s, job, node: s.save(job, node, 0, {"x": np.zeros(1)}),
    "load": lambda s, job, node: s.load(job, node, 0),
    "list_positions": lambda s, job, node: s.list_positions(job, node),
    "latest": lambda s, job, node: s.latest(job, node),
    "verify": lambda s, job, node: s.verify(job, node, 0),
    "delete": lambda s, job, node: s.delete(job, node, 0),
    "next_attempt": lambda s, job, node: s.next_attempt(job, node),
}


@pytest.mark.parametrize("operation", OPERATIONS)
@pytest.mark.parametrize("bad", ["..", "%2e%2e", "%252e%252e", "a/b", "a\\b", "a\x00", ""], ids=repr)
def test_no_storage_call_reaches_the_filesystem_for_a_bad_name(tmp_path, operation, bad):
    store = _guarded_store(tmp_path)
    for job, node in ((bad, "node"), ("job", bad)):
        with pytest.raises(InvalidNameError):
            OPERATIONS[operation](store, job, node)
    assert NoStorage.calls == []


@pytest.mark.parametrize("operation", ["save", "load", "verify", "delete"])
def test_bad_position_or_attempt_reaches_no_storage(tmp_path, operation):
    store = _guarded_store(tmp_path)
    calls = {
        "save": lambda: store.save("j", "n", -1, {"x": np.zeros(1)}),
        "load": lambda: store.load("j", "n", 0, attempt="../1"),
        "verify": lambda: store.verify("j", "n", 0, batch=-5),
        "delete": lambda: store.delete("j", "n", 0, attempt="0"),
    }
    with pytest.raises(InvalidNameError):
        calls[operation]()
    assert NoStorage.calls == []


def test_bad_tensor_names_and_dtypes_are_refused_before_writing(tmp_path):
    store = _guarded_store(tmp_path)
    for arrays, error in [
        ({"": np.zeros(1)}, ValueError),
        ({"__metadata__": np.zeros(1)}, ValueError),
        ({"a\x00": np.zeros(1)}, ValueError),
        ({"obj": np.array([object()])}, TypeError),
        ({"str": np.array(["a"])}, TypeError),
    ]:
        with pytest.raises(error):
            store.save("j", "n", 0, arrays, attempt=1)
    with pytest.raises(ValueError):
        store.save("j", "n", 0, {"x": np.zeros(1)}, attempt=1, metadata={"bad": float("nan")})
    assert NoStorage.calls == []
