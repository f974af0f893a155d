"""PyTorch Distributed Checkpoint (DCP) on ckptstore: a `StorageWriter` and a `StorageReader` that
keep DCP's planning and resharding and put the bytes in ckptstore's layout.

    writer = CkptstoreWriter(storage="s3://ckpt/jobs", job="lm", epoch=3, service="http://…")
    torch.distributed.checkpoint.save(state_dict, storage_writer=writer)
    reader = CkptstoreReader(storage="s3://ckpt/jobs", job="lm")          # the last good position
    torch.distributed.checkpoint.load(state_dict, storage_reader=reader)

Every rank is a node (`node-<rank>`) and commits its items as one checkpoint (safetensors shards,
CRC32C, manifest last) at the position, through the same node checkpointer as the loop managers
(`ckptstore.client.engine.node`): options are `CheckpointOptions`' (service, token, local_storage, storage_options,
max_to_keep, …), with a service each rank registers an attempt (fencing a zombie) and its commit is
queued and retried like any other; the position becomes good once every rank's is in. Rank 0 (the
coordinator) commits its own items together with DCP's metadata once every rank has written, so a
position whose metadata is readable had every rank's part committed first. A save that cannot be
written raises (DCP must not believe it saved). Tensors more than one rank holds (plain tensors,
DTensor shards a mesh replicates: HSDP) are compared across their holders at each save; a
disagreement is said on every rank and makes the position not good (ckptstore/agreement.py). Loading reads only the byte ranges the plan needs,
verified, from the attempts the metadata names, on the durable tier; DCP reshards to any number of
ranks. A rank's copy that fails verification is marked and never loaded: the load raises, so
loading again resumes from the previous good position. DCP's metadata is a pickle (as in DCP's
own FileSystemReader), but it is loaded by an unpickler that admits DCP's metadata classes and
nothing else: whoever can write to storage cannot make a load run code (a CRC32C is a checksum,
not a signature).
"""

from __future__ import annotations

import io
import logging
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
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckptstore import Position
from ckptstore.agreement import disagreement_of, groups_disagreement, replica_groups
from ckptstore.client.engine.identity import NodeIdentity
from ckptstore.client.engine.node import NodeCheckpointer
from ckptstore.client.engine.options import CheckpointOptions
from ckptstore.client.torch.state import BITS, host_array
from ckptstore.deferred import VerifiedTensors
from ckptstore.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckptstore.format.crc import checksum, format_crc
from ckptstore.wire.schema import MarkState

__all__ = ["CkptstoreWriter", "CkptstoreReader", "METADATA_KEY"]

log = logging.getLogger("ckptstore.client")
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


def _fill(arrays: Mapping[str, np.ndarray], items: list[tuple[Any, _Stored]], planner: LoadPlanner) -> None:
    """Load each item from one copy's arrays: bytes through the planner, whole tensors straight into their
    targets where the arrays allow it, the rest copied from the stored tensor's slice."""
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


def _replica_key(index: MetadataIndex) -> str:
    """A replicated shard's name in the comparison: the tensor's path, and its offset when sharded."""
    offset = tuple(index.offset or ())
    return index.fqn if not any(offset) else f"{index.fqn}{list(offset)}"


def _replica_hashes(planner: SavePlanner, items: list[WriteItem]) -> dict[str, str]:
    """The CRC32C of each tensor this rank holds that other ranks hold too: a plain tensor (DCP takes
    it as every rank's), a DTensor's shard where the mesh replicates it (HSDP). Shards of a DTensor
    sharded on every dimension are this rank's alone: nothing to compare."""
    from torch.distributed.tensor import DTensor

    state = getattr(planner, "state_dict", None)
    if not isinstance(state, Mapping):
        raise TypeError(f"{type(planner).__name__} keeps no state_dict to hash")
    hashes = {}
    for item in items:
        held = state.get(item.index.fqn)
        if isinstance(held, DTensor):
            mesh = held.device_mesh
            if not any(p.is_replicate() and mesh.size(d) > 1 for d, p in enumerate(held.placements)):
                continue
        elif not isinstance(held, torch.Tensor):
            continue
        data = planner.resolve_data(item)
        assert isinstance(data, torch.Tensor)
        hashes[_replica_key(item.index)] = format_crc(checksum(host_array(data)))
    return hashes


def _rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _MetadataUnpickler(pickle.Unpickler):
    """Loads DCP's metadata and refuses anything else a pickle could name (a planted pickle runs code
    through the first callable it names: `os.system`, `builtins.eval`, ...)."""

    _NAMED = frozenset(
        {
            ("ckptstore.client.torch.dcp", "_Stored"),
            ("torch", "Size"),
            ("torch.serialization", "_get_layout"),
            ("collections", "OrderedDict"),
            ("builtins", "set"),
            ("builtins", "frozenset"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._NAMED:
            return super().find_class(module, name)
        if module == "torch.distributed.checkpoint.metadata":  # the classes defined there, nothing it imports
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == module:
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which DCP metadata never does: refused")


def _node(options: CheckpointOptions, rank: int, *, writes: bool) -> NodeCheckpointer:
    """Rank `rank`'s node checkpointer (`node-<rank>`); a reader's does not write (it reads the durable
    tier, whatever number of ranks it has: DCP reshards)."""
    return NodeCheckpointer(options, identity=NodeIdentity(f"node-{rank}", writes, "torch.distributed"))


class CkptstoreWriter(StorageWriter):
    """Writes one DCP checkpoint at (epoch, batch) of `job` under `storage` (see module docstring)."""

    def __init__(self, storage: str | None, job: str | None, epoch: int, *, batch: int | None = None, **options: Any):
        super().__init__()
        self.rank, self.world = _rank()
        self.options = CheckpointOptions.resolve(
            storage=storage, job=job, nodes=self.world, on_error="raise", async_save=False, **options
        )
        self.position = Position(epoch, batch)
        self.node: NodeCheckpointer | None = None
        self._held: dict[str, np.ndarray] = {}  # the coordinator's items, committed with the metadata
        self._held_items: list[WriteItem] = []  # this rank's tensors before DCP drops the replicas others write
        self._agreement: dict[str, Any] = {}  # the replicas' comparison (ckptstore/agreement.py)

    def reset(self, checkpoint_id: Any = None) -> None:
        self._held = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return checkpoint_id is None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.node = _node(self.options, self.rank, writes=True)
        self.node.register()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._held_items = [item for item in plan.items if item.type != WriteItemType.BYTE_IO]
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def _compare_replicas(self, planner: SavePlanner) -> None:
        """Every rank hashes the replicated tensors it holds — before DCP's deduplication dropped the
        copies other ranks write: plain tensors (every rank's) and DTensor shards replicated over a
        mesh dimension (HSDP's replica groups) — and every rank gets every rank's hashes (one small
        all-gather), so each can say a disagreement; the coordinator keeps them with its part."""
        import torch.distributed as dist

        if self.world == 1:
            return
        try:
            hashes: dict[str, str] | None = _replica_hashes(planner, self._held_items)
        except Exception as exc:  # the other ranks wait in the gather: never leave them there
            log.warning(
                "ckptstore: rank %d could not hash its replicas (%s): this save is not compared", self.rank, exc
            )
            hashes = None
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, hashes)
        self._agreement = replica_groups(gathered)
        disagree = groups_disagreement(self._agreement)
        if disagree is not None:
            log.warning("%s: the DCP save at %s is kept but not good", disagree, self.position)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assert self.node is not None and self.node.attempt is not None, "set_up_storage_writer runs first"
        self._compare_replicas(planner)
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
            stored = _Stored(self.node.node, self.node.attempt, key, dtype)
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
        self._commit(self._held, self._agreement)
        self._held = {}

    def _commit(self, arrays: dict[str, np.ndarray], agreement: Mapping[str, Any] | None = None) -> None:
        """Save this rank's part (synchronously: it raises if it cannot), its records sent, then let the
        node go. The coordinator's part carries the replicas' comparison: a disagreement marks it, and
        so the position, not good."""
        assert self.node is not None
        metadata = {"format": "torch.distributed.checkpoint", "ranks": self.world, **(agreement or {})}
        try:
            self.node.save(self.position, arrays, metadata=metadata)
        finally:
            self.node.close()

    def storage_meta(self) -> Any:
        return None


class CkptstoreReader(StorageReader):
    """Reads a DCP checkpoint of `job`: at (epoch, batch), or the last good position (the service's
    resume position; without a service, the newest position whose metadata was committed)."""

    def __init__(
        self,
        storage: str | None,
        job: str | None,
        epoch: int | None = None,
        *,
        batch: int | None = None,
        **options: Any,
    ):
        super().__init__()
        rank, _ = _rank()
        self.node = _node(CheckpointOptions.resolve(storage=storage, job=job, **options), rank, writes=False)
        self.job = self.node.job
        self.position = None if epoch is None else Position(epoch, batch)
        self.metadata: Metadata | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        self.metadata = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return checkpoint_id is None

    def _resume_position(self) -> Position:
        if self.node.client is not None:
            resume = self.node.client.last_good_epoch(self.job).resume
            if resume is None:
                raise CheckpointNotFoundError(f"job {self.job!r} has no good position yet")
            return resume.to_position()
        positions = {p for store in self.node.tiers.values() for p in store.list_positions(self.job, COORDINATOR)}
        for position in sorted(positions, reverse=True):
            disagree = self._disagreement_at(position)
            if disagree is None:
                return position
            log.warning("%s: passing over the DCP save at %s", disagree, position)
        raise CheckpointNotFoundError(f"no DCP checkpoint of job {self.job!r} under {self.node.store.url}")

    def _disagreement_at(self, position: Position) -> str | None:
        """The replicas' disagreement the coordinator's newest committed copy at `position` records."""
        store = self.node.store
        for key in reversed(store.copies(self.job, COORDINATOR, position)):
            try:
                return disagreement_of(store.manifest(key))
            except (CheckpointNotFoundError, CorruptCheckpointError):
                continue
        return None

    def read_metadata(self) -> Metadata:
        if self.position is None:
            self.position = self._resume_position()
        arrays = self.node.store.load(
            self.job, COORDINATOR, self.position.epoch, batch=self.position.batch, names=[METADATA_KEY]
        )
        try:
            self.metadata = _MetadataUnpickler(io.BytesIO(arrays[METADATA_KEY].tobytes())).load()
        except pickle.UnpicklingError as exc:
            raise CorruptCheckpointError(
                f"the DCP metadata of {self.job} at {self.position} is not DCP metadata: {exc}"
            ) from None
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
            self._read_part(node, attempt, items, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_part(self, node: str, attempt: str, items: list[tuple[Any, _Stored]], planner: LoadPlanner) -> None:
        """Fill the plan's items stored in one rank's copy, verified, nearest tier first: on local disk the
        copy's sizes are checked and each tensor is checked where it lands, in one pass (`VerifiedTensors`);
        on object stores only the named byte ranges are fetched, each checked. A copy found damaged,
        before or while its tensors are read, is marked in the service and the next tier's copy fills every
        item again; with none left the load raises (its targets may hold part of the damaged copy: the
        caller must not train on them), and the next load resumes from the previous good position."""
        assert self.position is not None
        names = sorted({stored.key for _, stored in items})
        failures: list[str] = []
        marked: list[str] = []
        for store in self.node.tiers.values():
            copy = store.key(self.job, node, self.position, attempt)
            try:
                if store.is_local:
                    arrays = store.read_copy(copy, deferred=True, one_pass=True).arrays
                else:
                    arrays = store.read(self.job, node, self.position, attempt=attempt, names=names).arrays
                _fill(arrays, items, planner)
                return
            except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                state: MarkState = "corrupt" if isinstance(exc, CorruptCheckpointError) else "missing"
                failures.append(f"{copy} {state}: {exc}")
                if self.node.client is not None and (state == "corrupt" or copy.tier == "durable"):
                    self.node.client.mark(copy, state, cause="restore", reason=f"restore: {exc}")
                    marked.append(f"{copy.tier} copy marked {state}")
        outcome = f" ({', '.join(marked)}: the next load resumes from the previous good position)" if marked else ""
        raise CorruptCheckpointError(
            f"no intact copy of {node}'s part at {self.position} attempt {attempt}: {'; '.join(failures)}{outcome}"
        )
