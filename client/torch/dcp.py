"""PyTorch Distributed Checkpoint (DCP) on ckptstore: a `StorageWriter` and a `StorageReader` that
keep DCP's planning and resharding and put the bytes in ckptstore's layout.

    writer = CkptstoreWriter(storage="s3://ckpt/jobs", job="lm", epoch=3, service="http://…")
    torch.distributed.checkpoint.save(state_dict, storage_writer=writer)
    reader = CkptstoreReader(storage="s3://ckpt/jobs", job="lm")          # the last good position
    torch.distributed.checkpoint.load(state_dict, storage_reader=reader)

Every rank is a node (`node-<rank>`) and commits its items as one checkpoint (safetensors shards,
CRC32C, manifest last) at the position; rank 0 (the coordinator) commits its own items together
with DCP's metadata once every rank has written, so a position whose metadata is readable had every
rank's part committed first. With a service, each rank registers an attempt (fencing a zombie) and
records its commit; the position becomes good once every rank's is in. Loading reads only the
byte ranges the plan needs, verified, from the attempts the metadata names; DCP reshards to any
number of ranks. A rank's part that fails verification is never loaded: the load raises, and with
a service that copy is marked, so loading again resumes from the previous good position. DCP's metadata is a pickle, as in DCP's own FileSystemReader: load only from
storage you trust.
"""

from __future__ import annotations

import io
import pickle
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import (
    LoadPlan,
    LoadPlanner,
    Metadata,
    SavePlan,
    SavePlanner,
    StorageReader,
    StorageWriter,
)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckptstore import CheckpointRef, Position, Store
from ckptstore.deferred import VerifiedTensors
from ckptstore.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckptstore.schema import MarkState
from client.service import ServiceClient
from client.torch.state import BITS, host_array

__all__ = ["CkptstoreWriter", "CkptstoreReader", "METADATA_KEY"]

METADATA_KEY = "dcp/metadata"
COORDINATOR = "node-0"


@dataclass(frozen=True)
class _Stored:
    """Where one DCP item lies: the node's checkpoint (attempt) and the array's name in it."""

    node: str
    attempt: str
    key: str
    dtype: str | None  # the torch dtype of a tensor (None: bytes)


def _whole_tensor_view(
    arrays: Mapping[str, np.ndarray], item: Any, stored: _Stored, target: torch.Tensor
) -> np.ndarray | None:
    """The target's memory as bytes, where a whole stored tensor can be read straight into it: a
    verified local copy, the item covering the stored tensor, a contiguous CPU target of its shape and dtype."""
    if not isinstance(arrays, VerifiedTensors) or any(item.storage_offsets):
        return None
    shape, dtype = arrays.spec(stored.key)
    if tuple(item.lengths) != shape or target.device.type != "cpu" or not target.is_contiguous():
        return None
    view = host_array(target)  # a view of the target's memory (bfloat16 and float8 as integers, as stored)
    return view if view.nbytes and view.shape == shape and view.dtype == dtype else None


def _rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class CkptstoreWriter(StorageWriter):
    """Writes one DCP checkpoint at (epoch, batch) of `job` under `storage` (see module docstring)."""

    def __init__(
        self,
        storage: str,
        job: str,
        epoch: int,
        *,
        batch: int | None = None,
        service: str | list[str] | None = None,
        storage_options: dict[str, Any] | None = None,
    ):
        super().__init__()
        self.store = Store(storage, storage_options=storage_options)
        self.job, self.position = job, Position(epoch, batch)
        self.client = ServiceClient(service) if service else None
        self.rank, self.world = _rank()
        self.node = f"node-{self.rank}"
        self.attempt = ""
        self._held: dict[str, np.ndarray] = {}  # the coordinator's items, committed with the metadata

    def reset(self, checkpoint_id: Any = None) -> None:
        self._held = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return checkpoint_id is None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if self.client is not None:
            nodes = [f"node-{r}" for r in range(self.world)]
            try:
                self.client.get_job(self.job)
            except CheckpointNotFoundError:
                self.client.put_job(self.job, nodes, storage_root=self.store.url)
            self.attempt = self.client.start_attempt(self.job, self.node)
        else:
            self.attempt = self.store.next_attempt(self.job, self.node)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        arrays: dict[str, np.ndarray] = {}
        results = []
        for number, item in enumerate(plan.items):
            data = planner.resolve_data(item)
            key = f"dcp/{number:06d}"
            # Views, not copies: `dcp.save` blocks until `finish` (and `dcp.async_save` hands the writer
            # a staged copy of its own), so nothing changes the tensors while they are written.
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                arrays[key] = np.frombuffer(data.getvalue(), np.uint8)
                dtype = None
            else:
                assert isinstance(data, torch.Tensor)
                arrays[key] = host_array(data)
                dtype = str(data.dtype).removeprefix("torch.")
            stored = _Stored(self.node, self.attempt, key, dtype)
            results.append(WriteResult(index=item.index, size_in_bytes=arrays[key].nbytes, storage_data=stored))
        if self.is_coordinator:
            self._held = arrays  # committed in `finish`, with the metadata, after every rank's part
        else:
            self._commit(arrays)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {result.index: result.storage_data for rank in results for result in rank}
        self._held[METADATA_KEY] = np.frombuffer(pickle.dumps(metadata), np.uint8)
        self._commit(self._held)
        self._held = {}

    def _commit(self, arrays: dict[str, np.ndarray]) -> CheckpointRef:
        ref = self.store.save(
            self.job,
            self.node,
            self.position.epoch,
            arrays,
            batch=self.position.batch,
            attempt=self.attempt,
            metadata={"format": "torch.distributed.checkpoint", "ranks": self.world},
        )
        if self.client is not None:
            self.client.commit(ref)
        return ref

    def storage_meta(self) -> Any:
        return None


class CkptstoreReader(StorageReader):
    """Reads a DCP checkpoint of `job`: at (epoch, batch), or the last good position (the service's
    resume position; without a service, the newest position whose metadata was committed)."""

    def __init__(
        self,
        storage: str,
        job: str,
        epoch: int | None = None,
        *,
        batch: int | None = None,
        service: str | list[str] | None = None,
        storage_options: dict[str, Any] | None = None,
    ):
        super().__init__()
        self.store = Store(storage, storage_options=storage_options)
        self.job = job
        self.client = ServiceClient(service) if service else None
        self.position = None if epoch is None else Position(epoch, batch)
        self.metadata: Metadata | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        self.metadata = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return checkpoint_id is None

    def _resume_position(self) -> Position:
        if self.client is not None:
            resume = self.client.last_good_epoch(self.job).resume
            if resume is None:
                raise CheckpointNotFoundError(f"job {self.job!r} has no good position yet")
            return resume.to_position()
        positions = self.store.list_positions(self.job, COORDINATOR)
        if not positions:
            raise CheckpointNotFoundError(f"no DCP checkpoint of job {self.job!r} under {self.store.url}")
        return max(positions)

    def read_metadata(self) -> Metadata:
        if self.position is None:
            self.position = self._resume_position()
        arrays = self.store.load(
            self.job, COORDINATOR, self.position.epoch, batch=self.position.batch, names=[METADATA_KEY]
        )
        self.metadata = pickle.loads(arrays[METADATA_KEY].tobytes())
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.metadata is not None and self.position is not None, "read_metadata runs first"
        storage = self.metadata.storage_data
        by_checkpoint: dict[tuple[str, str], list[Any]] = defaultdict(list)
        for item in plan.items:
            stored: _Stored = storage[item.storage_index]
            by_checkpoint[(stored.node, stored.attempt)].append((item, stored))
        for (node, attempt), items in by_checkpoint.items():
            arrays = self._load(node, attempt, sorted({stored.key for _, stored in items}))
            in_place: dict[str, np.ndarray] = {}
            filled: list[tuple[Any, torch.Tensor]] = []
            for item, stored in items:
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(arrays[stored.key].tobytes()))
                    continue
                target = planner.resolve_tensor(item).detach()
                view = _whole_tensor_view(arrays, item, stored, target)
                if view is not None:
                    in_place[stored.key] = view
                    filled.append((item, target))
                    continue
                tensor = torch.from_numpy(np.array(arrays[stored.key]))
                dtype = getattr(torch, stored.dtype or "uint8")
                if dtype in BITS:
                    tensor = tensor.view(dtype)
                for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                    tensor = tensor.narrow(dim, offset, length)
                target.copy_(tensor)
                planner.commit_tensor(item, target)
            if in_place:
                assert isinstance(arrays, VerifiedTensors)
                arrays.read_into(in_place)
            for item, target in filled:
                planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _load(self, node: str, attempt: str, names: list[str]) -> Mapping[str, np.ndarray]:
        """The named arrays of one rank's checkpoint, verified: on local disk the whole copy is
        verified and its tensors read where they go (`VerifiedTensors`); on object stores only the
        named byte ranges are fetched, each checked. A copy that fails verification or is gone is
        marked in the service, so the next load resumes from the previous good position."""
        assert self.position is not None
        epoch, batch = self.position.epoch, self.position.batch
        try:
            if self.store.is_local:
                return self.store.read_attempt(
                    self.job, node, epoch, batch=batch, attempt=attempt, deferred=True
                ).arrays
            return self.store.load(self.job, node, epoch, batch=batch, attempt=attempt, names=names)
        except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
            if self.client is None:
                raise
            state: MarkState = "corrupt" if isinstance(exc, CorruptCheckpointError) else "missing"
            self.client.mark(self.job, node, self.position, state, attempt=attempt, reason=str(exc))
            raise type(exc)(f"{exc} (marked {state}: the next load resumes from the previous good position)") from exc
