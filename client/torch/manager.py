"""`CheckpointManager` for PyTorch training loops: the same store, service, tiers, async saves,
fencing and SIGTERM handling as the TensorFlow manager (client/engine/manager.py), for anything with
`state_dict()` / `load_state_dict()` plus the random number generators.

mgr = CheckpointManager(storage=..., service=..., job="lm",
                        objects={"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler})
start = mgr.restore_or_initialize()
for epoch in range(start, EPOCHS):
    for batch, (x, y) in enumerate(loader, start=mgr.first_batch(epoch)):
        ...
        mgr.save(epoch, batch=batch + 1)          # mid-epoch, whenever you like
    mgr.save(epoch)

Under torch.distributed the node is the rank. With `replicated=True` (DDP: every rank holds the
same state) rank 0 writes and every rank restores rank 0's checkpoint; with `replicated=False`
every rank writes its own part and a position is good once every rank committed it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ckptstore import Position
from ckptstore.agreement import unchecked_metadata
from ckptstore.client.audit.late_record import LateRecord
from ckptstore.client.audit.proof import PROOF_KEY, ResumeProof, recorded
from ckptstore.client.engine.cadence import SaveEvery
from ckptstore.client.engine.identity import NodeIdentity
from ckptstore.client.engine.manager import LoopManager
from ckptstore.client.engine.options import CheckpointOptions
from ckptstore.client.torch.distributed import DistributedLoaderPosition, is_distributed_loader
from ckptstore.client.torch.fingerprint import fingerprint, is_data
from ckptstore.client.torch.loaders import (
    NEXT_INDICES,
    generator_states,
    is_loader,
    next_ids,
    replay_after_first_iterator,
    watch_first_draws,
)
from ckptstore.client.torch.replicas import ReplicaComparison
from ckptstore.client.torch.sampler import ResumableSampler, ResumableSamplerLoader, is_resumable_sampler_loader
from ckptstore.client.torch.state import flatten, host_views_are_live, rng_state, set_rng_state, unflatten
from ckptstore.deferred import VerifiedTensors
from ckptstore.errors import ReplicasDisagreeError, ResumeRefusedError
from ckptstore.fingerprint import FINGERPRINT_KEY

__all__ = ["CheckpointManager", "distributed_identity", "ranks_node"]

STATE_KEY = "torch_state"
RNG = "rng"
RANK_RNGS = "rng_ranks"  # replicated state under torch.distributed: every rank's RNG, by rank
LOADER_GENERATORS = "loader_generators"  # each data loader's generators as of the save (client/torch/loaders.py)
RESERVED = (RNG, RANK_RNGS, LOADER_GENERATORS)

log = logging.getLogger("ckptstore.client")
PREEMPTION_UNCHECKED = "a preemption's save: the other ranks may not be saving, so none were asked"


def _in_place(obj: Any, name: str, saved_tree: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    """`obj`'s own state dict with the checkpoint's values read straight into its tensors' memory,
    where that can be done exactly: a verified local copy (`VerifiedTensors`), a state of the same
    structure, names and dtypes as the saved one (a module; an optimizer that has stepped), every
    tensor contiguous on the CPU. Loading it back is then free (each tensor is copied onto itself). None
    otherwise: the caller loads from new tensors."""
    if not isinstance(arrays, VerifiedTensors):
        return None
    state = obj.state_dict()
    if not host_views_are_live(state):
        return None
    views: dict[str, np.ndarray] = {}
    if flatten(state, name, views) != saved_tree:
        return None
    if any(arrays.spec(key) != (view.shape, view.dtype) for key, view in views.items()):
        return None
    arrays.read_into({key: view for key, view in views.items() if view.nbytes})
    return state


def _data_position(obj: Any) -> Any:
    """A DataLoader in `objects` with no state of its own, as what saves and restores its position:
    over a DistributedSampler (the DDP loop) or a ResumableSampler; anything else as given."""
    if is_distributed_loader(obj):
        return DistributedLoaderPosition(obj)
    if is_resumable_sampler_loader(obj):
        return ResumableSamplerLoader(obj)
    return obj


def ranks_node(options: CheckpointOptions, *, replicated: bool = True) -> tuple[CheckpointOptions, NodeIdentity | None]:
    """The options and node identity of this rank under an initialised torch.distributed: replicated
    state is the job's one node (`node-0`, which rank 0 writes and every rank restores), per-rank
    state a node per rank. Outside torch.distributed, the options as they are and no identity."""
    identity = distributed_identity(replicated)
    if identity is None:
        return options, None
    nodes = ["node-0"] if replicated else [f"node-{rank}" for rank in range(_world_size())]
    return dataclasses.replace(options, nodes=options.nodes or nodes), identity


def distributed_identity(replicated: bool) -> NodeIdentity | None:
    """This rank's identity under an initialised torch.distributed (None outside one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    if replicated:
        return NodeIdentity(
            f"node-{rank}", rank == 0, "torch.distributed", checkpoint_node="node-0", shared_restore=world > 1
        )
    return NodeIdentity(f"node-{rank}", True, "torch.distributed")


class CheckpointManager(LoopManager):
    """Save and restore `objects` (each with `state_dict` / `load_state_dict`) and the RNG states.

    Options are `CheckpointOptions`' (storage, service, job, node, max_to_keep, async_save, …).
    `replicated` matters under torch.distributed only (see the module docstring).
    """

    def __init__(
        self,
        *,
        objects: Mapping[str, Any],
        options: CheckpointOptions | None = None,
        replicated: bool = True,
        save_every: SaveEvery = None,
        save_every_seconds: float | None = None,
        job: str | None = None,
        storage: str | None = None,
        service: str | list[str] | None = None,
        local_storage: str | None = None,
        **settings: Any,
    ):
        objects = {name: _data_position(obj) for name, obj in objects.items()}
        for name, obj in objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(
                    f"objects[{name!r}] has no state_dict/load_state_dict (data: a DataLoader over a "
                    "DistributedSampler or a ResumableSampler, torchdata's StatefulDataLoader, or the sampler)"
                )
            if name in RESERVED:
                raise ValueError(f"{name!r} names what ckptstore saves besides the objects: use another name")
        if options is None:
            options = CheckpointOptions.resolve(
                job=job, storage=storage, service=service, local_storage=local_storage, **settings
            )
        options, identity = ranks_node(options, replicated=replicated)
        super().__init__(
            options=options, identity=identity, save_every=save_every, save_every_seconds=save_every_seconds
        )
        self.objects = dict(objects)
        self.replicated = replicated
        self._rank_rngs: list[Any] | None = None  # every rank's (RNG, seed), gathered for the save (rank 0 writes)
        self._comparing = False  # this save's replicas are compared (a collective save of replicated state)
        self._replicas: ReplicaComparison | None = None

    def _world(self) -> tuple[int, int]:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
        return 1, 0

    def _gather(self, *, collective: bool) -> None:
        """Replicated state under torch.distributed: rank 0 writes, but each rank draws from its own
        RNG (per-rank seeds), so every rank's RNG goes to rank 0 for the save; rank 0 tells every rank
        whether the replicas disagreed at a save since the last (its copy is not good: each rank warns,
        or raises under on_error="raise"). Not on a preemption's save, where the ranks may not all be
        saving at once (a collective then would hang): its copy says the replicas were not compared."""
        import torch.distributed as dist

        self._rank_rngs, self._comparing = None, False
        size, rank = self._world()
        if not (self.replicated and size > 1):
            return
        if not collective:
            if rank == 0:
                log.info("a preemption's save: replicas not compared (the other ranks may not be saving)")
            return
        gathered: list[Any] | None = [None] * size if rank == 0 else None
        dist.gather_object((rng_state(), torch.initial_seed()), gathered, dst=0)
        self._rank_rngs, self._comparing = gathered, True
        told = [self.checkpointer.take_disagreement() if rank == 0 else None]
        dist.broadcast_object_list(told, src=0)
        if told[0] is not None:
            if self.options.on_error == "raise":
                raise ReplicasDisagreeError(f"{told[0]} (rank {rank} of {size})")
            log.warning("%s: that save is kept but not good; a resume goes to where they agreed", told[0])

    def _compare_replicas(self, *, captured: bool) -> dict[str, Any]:
        """Every rank but the writer hashes its model and optimizer state, and the writer gets those
        hashes for its copy's metadata — off the training path (client/torch/replicas.py)."""
        size, rank = self._world()
        if not self._comparing:
            return {} if size == 1 or not self.replicated else unchecked_metadata(size, PREEMPTION_UNCHECKED)
        if self._replicas is None:
            self._replicas = ReplicaComparison(self.objects, size, rank)
        return self._replicas.compare(captured=captured)

    def close(self) -> None:
        if self._replicas is not None:
            self._replicas.close()
        super().close()

    @property
    def _decided_apart(self) -> bool:
        """A timed cadence, or replicated state whose checkpoint requests reach rank 0 alone: the ranks
        follow rank 0's decision. Per-rank state: each rank is a node of its own, with its own requests."""
        return self.cadence.timed or (self.replicated and self.checkpointer.client is not None)

    @property
    def _request_agreed_every(self) -> int:
        """Under torch.distributed, agreeing is a broadcast (~0.7 ms on 2 gloo ranks here): a checkpoint
        request is agreed on every 16th batch, so it costs training ~1/16 of that per batch."""
        return 16 if self._world()[0] > 1 else 1

    def _agree(self, due: bool) -> bool:
        """Under torch.distributed every rank saves when rank 0 (the clock of a timed cadence) says so."""
        import torch.distributed as dist

        size, _ = self._world()
        if size == 1:
            return due
        decision = [due]
        dist.broadcast_object_list(decision, src=0)
        return bool(decision[0])

    def _capture(self, position: Position) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        for obj in self.objects.values():
            if isinstance(obj, DistributedLoaderPosition):
                obj.position = position
        views: dict[str, np.ndarray] = {}
        states = {name: obj.state_dict() for name, obj in self.objects.items()}
        tree = {name: flatten(state, name, views) for name, state in states.items()}
        tree[RNG] = flatten(rng_state(), RNG, views)
        world = self._world()
        size, rank_seeds = world[0], None
        if self._rank_rngs is not None:
            tree[RANK_RNGS] = flatten([rng for rng, _ in self._rank_rngs], RANK_RNGS, views)
            rank_seeds = [seed for _, seed in self._rank_rngs]
        elif self.replicated and size > 1:  # a preemption's save: rank 0's RNG only (the audit says so)
            rank_seeds = [torch.initial_seed()]
        generators = {name: generator_states(obj) for name, obj in self.objects.items() if is_loader(obj)}
        if generators:
            tree[LOADER_GENERATORS] = flatten(generators, LOADER_GENERATORS, views)
        described = fingerprint(self.objects, states, world=world, seed=torch.initial_seed(), rank_seeds=rank_seeds)
        upcoming = {
            name: next_ids(self.objects[name], states[name]) for name in self.objects if is_data(self.objects[name])
        }
        described[PROOF_KEY] = recorded(next_ids={name: ids for name, ids in upcoming.items() if ids is not None})
        self.unforetold = {name for name, ids in upcoming.items() if ids is None}
        return views, {STATE_KEY: json.dumps(tree), FINGERPRINT_KEY: described}

    def _live_fingerprint(self, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, Any]) -> dict[str, Any]:
        """Models and optimizers as they are; data objects by their settings (asking a loader for its
        state could start its iterator)."""
        states = {name: obj.state_dict() for name, obj in self.objects.items() if not is_data(obj)}
        return fingerprint(self.objects, states, world=self._world(), seed=torch.initial_seed(), rank_seeds=None)

    def _watchable(self) -> set[str]:
        return {name for name, obj in self.objects.items() if is_data(obj)}

    def _watch(self, proof: ResumeProof) -> None:
        """Each data object reports the ids it hands out first (client/torch/loaders.py)."""
        for name, obj in self.objects.items():
            if is_data(obj) and not watch_first_draws(
                obj, functools.partial(proof.drawn, name), functools.partial(proof.remade, name)
            ):
                proof.unseen.append(f"data ({name}): {type(obj).__name__} cannot be watched")

    def _proof_world(self) -> tuple[int, int]:
        return self._world()

    def _watch_after_save(self, late: LateRecord) -> None:
        """Each data object reports the ids of its first batch after the save (its first NEXT_INDICES)."""
        for name in late.names:
            watch_first_draws(self.objects[name], functools.partial(_first_ids, late, name))

    def _apply(self, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, Any]) -> None:
        if STATE_KEY not in metadata:
            raise ValueError("this checkpoint was not written by ckptstore.client.torch.CheckpointManager")
        self._refuse_resharding_per_rank_state(metadata)
        tree = json.loads(metadata[STATE_KEY])
        missing = sorted(set(self.objects) - set(tree))
        if missing and self.options.strict:
            raise ValueError(f"the checkpoint has no state for {missing} (strict=False restores the rest)")
        for name, obj in self.objects.items():
            if name in tree:
                obj.load_state_dict(_in_place(obj, name, tree[name], arrays) or unflatten(tree[name], arrays))
        rngs = unflatten(tree[RANK_RNGS], arrays) if RANK_RNGS in tree else []
        _, rank = self._world()
        set_rng_state(rngs[rank] if rank < len(rngs) else unflatten(tree[RNG], arrays))
        self._replay_data_draws(unflatten(tree.get(LOADER_GENERATORS, {"__dict__": []}), arrays))

    def _refuse_resharding_per_rank_state(self, metadata: Mapping[str, Any]) -> None:
        """Per-rank state (`replicated=False`) is each rank's own: saved by N ranks it cannot be put on
        another number of them (some ranks' parts would be dropped, or missing) — DCP reshards tensors."""
        if self.replicated:
            return
        described = metadata.get(FINGERPRINT_KEY)
        world = described.get("world") if isinstance(described, Mapping) else None
        saved = world.get("size") if isinstance(world, Mapping) else None
        size, rank = self._world()
        if isinstance(saved, int) and saved != size:
            raise ResumeRefusedError(
                f"per-rank state (replicated=False) of {sorted(self.objects)} was saved by {saved} rank(s); this run "
                f"has {size} (rank {rank}): it cannot be resharded — restart on {saved} ranks, or save sharded "
                "state with DCP (ckptstore.client.torch.dcp), which reshards"
            )

    def _replay_data_draws(self, generators: Mapping[str, list[Any]]) -> None:
        """The draws a data loader makes when its resumed iterator is made, put right (loaders.py)."""
        restored = torch.get_rng_state()
        for name, obj in self.objects.items():
            if is_loader(obj):
                replay_after_first_iterator(obj, list(generators.get(name, [])), restored)
            elif isinstance(obj, (ResumableSampler, ResumableSamplerLoader, DistributedLoaderPosition)):
                obj.restore_rng_when_iterated(restored)

    def _started(self) -> None:
        """Every rank must resume from the same position: checked across ranks when distributed."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        positions: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(positions, self.resume_position)
        if len(set(positions)) != 1:
            raise RuntimeError(f"ranks resumed from different positions: {positions}")

    def __enter__(self) -> CheckpointManager:
        return self


def _first_ids(late: LateRecord, name: str, ids: Sequence[int]) -> None:
    """The first NEXT_INDICES ids the data object `name` drew after the save, to its late record."""
    late.drew(name, list(ids)[:NEXT_INDICES])


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()
