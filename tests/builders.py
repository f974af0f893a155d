"""Builders shared by the tests: arrays, bit-equality, and service request bodies."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np

from ckptstore.format.layout import checkpoint_location
from ckptstore.position import Position


def arrays_for(epoch: int, *, tensors: int = 4, size: int = 40_000) -> dict[str, np.ndarray]:
    """Deterministic float32 arrays for an epoch (≈ 640 KB by default)."""
    rng = np.random.default_rng(epoch)
    return {f"layer{i}": rng.standard_normal(size).astype(np.float32) for i in range(tensors)}


def failed_loads(store, job: str, node: str, epochs, expected) -> tuple[int, int]:
    """(how many of `epochs` fail to load, how many load other bytes than `expected(epoch)`)."""
    unreadable = wrong = 0
    for epoch in epochs:
        try:
            got = store.load(job, node, epoch)
        except Exception:
            unreadable += 1
            continue
        wrong += not bit_equal(got, expected(epoch))
    return unreadable, wrong


def bit_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> bool:
    return set(got) == set(want) and all(got[k].tobytes() == want[k].tobytes() for k in want)


def assert_bit_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """Same names, shapes, dtypes (byte order aside) and bytes."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for name, array in want.items():
        native = array.dtype.newbyteorder("=")
        assert got[name].shape == array.shape, name
        assert got[name].dtype == native, name
        assert got[name].tobytes() == np.ascontiguousarray(array).astype(native).tobytes(), f"{name} differs"


def declare(client: httpx.Client, root: str, job: str, nodes: list[str], **extra: Any) -> dict[str, Any]:
    """PUT the job (nodes, storage root and any other JobSpec fields); asserts it was accepted."""
    response = client.put(f"/v1/jobs/{job}", json={"nodes": nodes, "storage_root": root, **extra})
    assert response.status_code in (200, 201), response.text
    return response.json()


def commit_body(
    root: str, job: str, node: str, epoch: int, batch: int | None = None, attempt: int | str = 1, **extra: Any
) -> dict[str, Any]:
    """A commit record body whose location is the key the service builds."""
    return {
        "epoch": epoch,
        "batch": batch,
        "attempt": attempt,
        "step": epoch * 10,
        "location": checkpoint_location(root, job, node, Position(epoch, batch), attempt),
        "bytes": 100,
        "checksums": {"tensors-00000.safetensors": "crc32c:0000abcd"},
        **extra,
    }
