"""`BackupAndRestore` for the Hugging Face `Trainer`: its checkpoints through ckptstore, and a killed
run resumed exactly by a plain `trainer.train()`.

trainer = Trainer(model, args, train_dataset=..., callbacks=[BackupAndRestore(storage="s3://…", job="lm")])
trainer.train()

Each time the Trainer saves (`args.save_steps`, `save_strategy`), the callback takes the checkpoint
folder it just wrote — weights, optimizer, scheduler, RNG states, trainer state — and saves it through
ckptstore (async, tiers, the service): each safetensors file as its tensors (so unchanged tensors are
written once), every other file as its bytes. On a restart, `trainer.train()` — with no
`resume_from_checkpoint` — restores the newest intact copy into a folder of the Trainer's own layout
and resumes from it the Trainer's own way: weights, optimizer, scheduler, RNG, and its batch skipping
for the data position. The callback finds its Trainer when the Trainer is built (`on_init_end`) and
wraps that one's `train`; if it cannot, it says so, and a run with copies to resume from is refused
rather than started from scratch.

Under DDP rank 0 writes and every rank restores rank 0's copy. Each save also keeps how many batches of
its epoch the whole job had trained (the Trainer's sampler draws one global order of batches per epoch
from its seed, and accelerate deals them out to the ranks in turn), so a restart on another number of
ranks goes on from that count: the Trainer's step is put where it skips that many on the new world
size (the batches of a last step the ranks cannot share evenly are skipped under it), no batch twice,
none skipped — beyond the padding accelerate itself adds to make the ranks' last batches even. Positions
go on counting from the one resumed from.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import struct
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import Any, NamedTuple

import numpy as np
import transformers
from torch.utils.data import Sampler
from transformers import TrainerCallback

from ckptstore import Position
from ckptstore.client.audit.declared import audit_restored
from ckptstore.client.audit.late_record import LateRecord
from ckptstore.client.audit.proof import PROOF_KEY, ResumeProof, recorded, start_proof
from ckptstore.client.engine.node import NodeCheckpointer
from ckptstore.client.engine.options import CheckpointOptions
from ckptstore.client.engine.restore import restore_in_one_pass
from ckptstore.client.torch.fingerprint import fingerprint
from ckptstore.client.torch.loaders import next_batches_ids, watch_every_iterator
from ckptstore.client.torch.manager import ranks_node
from ckptstore.copies import Restored
from ckptstore.errors import CkptStoreError, ResumeRefusedError
from ckptstore.fingerprint import FINGERPRINT_KEY
from ckptstore.format.shard import numpy_dtype
from ckptstore.wire.schema import ResumeAudit

__all__ = ["BackupAndRestore"]

log = logging.getLogger("ckptstore.client")
LAYOUT_KEY = "hf_checkpoint"  # manifest metadata: the folder's files and how each is stored
DATA_KEY = "hf_data_position"  # manifest metadata: the epoch's global count of batches trained, and the world size
STAGING = ".ckptstore-restore"  # under args.output_dir: the restored checkpoint the Trainer resumes from


def pack_folder(folder: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A checkpoint folder's files as named arrays, and the layout that puts them back byte for byte:
    a safetensors file as its header and its tensors (each with its own dtype), any other file as bytes."""
    arrays: dict[str, np.ndarray] = {}
    files: dict[str, Any] = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as handle:
            data = handle.read()
        tensors = _safetensors_parts(data) if name.endswith(".safetensors") else None
        if tensors is None:
            arrays[name] = np.frombuffer(data, dtype=np.uint8)
            files[name] = "bytes"
            continue
        header_end = tensors[0][1] if tensors else len(data)
        arrays[f"{name}#header"] = np.frombuffer(data[:header_end], dtype=np.uint8)
        for tensor, begin, end, code, shape in tensors:
            arrays[f"{name}#{tensor}"] = np.frombuffer(data[begin:end], dtype=numpy_dtype(code)).reshape(shape)
        files[name] = [tensor for tensor, *_ in tensors]
    return arrays, files


def _safetensors_parts(data: bytes) -> list[tuple[str, int, int, str, list[int]]] | None:
    """(name, begin, end, dtype code, shape) of each tensor in file order when the tensors follow the
    header back to back with dtypes ckptstore stores; None otherwise (the file is kept as bytes)."""
    try:
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + size])
        parts = sorted(
            (8 + size + entry["data_offsets"][0], 8 + size + entry["data_offsets"][1], name, entry)
            for name, entry in header.items()
            if name != "__metadata__"
        )
        expected = 8 + size
        for begin, end, _, entry in parts:
            numpy_dtype(entry["dtype"])
            if begin != expected:
                return None
            expected = end
    except (ValueError, KeyError, TypeError, struct.error):
        return None
    if expected != len(data):
        return None
    return [(name, begin, end, entry["dtype"], entry["shape"]) for begin, end, name, entry in parts]


def unpack_folder(arrays: Mapping[str, np.ndarray], files: Mapping[str, Any], folder: str) -> None:
    """Write the files `pack_folder` packed into `folder`, byte for byte."""
    os.makedirs(folder, exist_ok=True)
    for name, layout in files.items():
        parts = [arrays[name]] if layout == "bytes" else [arrays[f"{name}#header"]]
        parts += [] if layout == "bytes" else [arrays[f"{name}#{tensor}"] for tensor in layout]
        with open(os.path.join(folder, name), "wb") as handle:
            for part in parts:
                handle.write(np.ascontiguousarray(part).view(np.uint8).reshape(-1).data)


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None


def _fingerprint(model: Any, args: Any, length: int | None, *, reshards: bool = False) -> dict[str, Any]:
    """The run as the resume audit compares it: the model's arrays, the world, the seed, and the data
    as the Trainer draws it (batch size, dataset length, data seed; `reshards`: its order goes on from
    the saved global count on any world size)."""
    record = fingerprint(
        {"model": model},
        {"model": model.state_dict()},
        world=(args.world_size, args.process_index),
        seed=args.seed,
        rank_seeds=None,
    )
    record["framework"]["versions"]["transformers"] = transformers.__version__
    seed = args.data_seed if args.data_seed is not None else args.seed
    record["data"]["trainer"] = {
        "type": "Trainer",
        "batch_size": args.per_device_train_batch_size,
        "length": length,
        "seed": seed,
    }
    if reshards:
        record["data"]["trainer"]["reshards"] = True
    return record


def _reshards(args: Any) -> bool:
    """Whether the Trainer draws one global order of batches an epoch, from its seed, whatever the world
    size: its random sampler made seedable by accelerate (the defaults)."""
    config = getattr(args, "accelerator_config", None)
    return getattr(args, "train_sampling_strategy", None) == "random" and bool(
        getattr(config, "use_seedable_sampler", False)
    )


def _update_steps(batches: int, accumulate: int) -> int:
    """The Trainer's optimizer steps in an epoch of `batches` (the last takes the batches left)."""
    return max(-(-batches // accumulate), 1)


class _Resumed(NamedTuple):
    """Where a run resumed: the position's epoch and batch (its steps of the epoch, as counted where it
    was saved), the Trainer's global step there (on this world size) and the epoch's global batches trained."""

    epoch: int
    batch: int
    global_step: int
    consumed: int
    skipped: int = 0  # samples the sampler skips first: a step's batches the ranks cannot share


class _SkipFirst(Sampler[int]):
    """Stands in for the Trainer's sampler for one iteration: its order without the first `count`
    indices (the batches of a step the new ranks cannot share evenly)."""

    def __init__(self, owner: Any, count: int):
        self.owner, self.sampler, self.count = owner, owner.sampler, count

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        self.owner.sampler = self.sampler  # one iteration: the sampler's own from now on
        for index, sample in enumerate(self.sampler):
            if index >= self.count:
                yield sample


def _calling_trainer() -> transformers.Trainer | None:
    """The Trainer whose construction is calling this callback's `on_init_end`."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, transformers.Trainer):
            return candidate
        frame = frame.f_back
    return None


class BackupAndRestore(TrainerCallback):
    """The Trainer's checkpoints through ckptstore, and an exact resume of a restarted run.

    Options are `CheckpointOptions`' (storage, job, service, local_storage, max_to_keep, codec, …; the
    job defaults to CKPTSTORE_JOB, else "hf"). The cadence is the Trainer's (`save_steps`).
    """

    def __init__(
        self,
        *,
        job: str | None = None,
        storage: str | None = None,
        service: str | list[str] | None = None,
        local_storage: str | None = None,
        **options: Any,
    ):
        self.options = CheckpointOptions.resolve(
            default_job="hf", job=job, storage=storage, service=service, local_storage=local_storage, **options
        )
        self.checkpointer: NodeCheckpointer | None = None
        self.resume_position: Position | None = None  # the position this run resumed from (None: fresh)
        self._steps_per_epoch = 1
        self._length: int | None = None
        self._resumed: _Resumed | None = None
        self.proof: ResumeProof | None = None  # the resume's proof (client/audit/proof.py), settled at the first step
        self._watching: list[Callable[[], None]] = []  # what stops each watch of the loaders, newest last
        self._late: LateRecord | None = None  # what the Trainer draws first after an epoch-end save

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _calling_trainer()
        if trainer is None:
            log.warning("ckptstore's BackupAndRestore could not find its Trainer: a restart will not resume")
            return
        original = trainer.train

        def train(resume_from_checkpoint: str | bool | None = None, **more: Any) -> Any:
            staged = self._start(trainer) if resume_from_checkpoint in (None, False) else None
            return original(resume_from_checkpoint=staged or resume_from_checkpoint, **more)

        trainer.train = train  # type: ignore[method-assign,assignment]

    def _start(self, trainer: transformers.Trainer) -> str | None:
        """Register and restore the newest intact copy into a folder the Trainer resumes from (None:
        fresh), after its resume audit against the Trainer's model, arguments and dataset."""
        started = time.perf_counter()
        options, identity = ranks_node(self.options)
        self.checkpointer = NodeCheckpointer(options, identity=identity)
        found = restore_in_one_pass(self.checkpointer, lambda restored: self._unpack(trainer, restored))
        if found is None:
            return None
        restored, (report, folder) = found
        if self._resumed is not None and self._resumed.skipped:
            _skip_once(trainer, self._resumed.skipped)
        self.resume_position = restored.copy.position
        one_process = trainer.args.world_size == 1
        self.proof = start_proof(
            report,
            restored.checkpoint.manifest.metadata,
            self.checkpointer,
            self.options.resume_check,
            mid_epoch=not restored.copy.position.is_end_of_epoch,
            watched={"train"} if one_process else set(),
            counting=True,
            unobservable=None if one_process else "ckptstore does not see which ranks' batches the Trainer draws",
            late=lambda: self.checkpointer.drawn_next(restored.copy) if self.checkpointer is not None else None,
        )
        if self.proof is not None and not self.proof.settled and one_process:
            # The Trainer makes its loader inside its loop: the first batches any loader takes until its
            # first step are its training batches.
            self._watching.append(watch_every_iterator(functools.partial(self.proof.drawn, "train")))
        if self.proof is not None and self._resumed is not None:
            self.proof.counters["global_step"] = self._resumed.global_step  # on another world size, the step it became
        pending = self.proof is not None and not self.proof.settled
        self.checkpointer.resumed(restored, time.perf_counter() - started, report, pending=pending)
        return folder

    def _unpack(self, trainer: transformers.Trainer, restored: Restored) -> tuple[ResumeAudit | None, str]:
        """The restored copy's resume audit, and the folder of the Trainer's layout it is unpacked into
        (each tensor checked as it is read; a copy that fails leaves a folder nothing resumes from)."""
        assert self.checkpointer is not None
        metadata = restored.checkpoint.manifest.metadata
        if LAYOUT_KEY not in metadata:
            raise ValueError("this checkpoint was not written by ckptstore.client.hf.BackupAndRestore")
        check = self.options.resume_check
        saved = metadata.get(DATA_KEY)
        args = trainer.args
        reshards = isinstance(saved, Mapping) and _reshards(args)
        report = audit_restored(
            restored,
            self.checkpointer,
            check,
            lambda: _fingerprint(trainer.model, args, _length(trainer.train_dataset), reshards=reshards),
        )
        folder = os.path.join(_staging(args), f"checkpoint-{metadata['global_step']}")
        shutil.rmtree(folder, ignore_errors=True)
        unpack_folder(restored.checkpoint.arrays, metadata[LAYOUT_KEY], folder)
        if isinstance(saved, Mapping):
            self._resumed = _go_on_from(trainer, folder, restored.copy.position, saved)
        if (
            report is not None
            and report.verdict == "drift"
            and any(d.startswith("world size:") for d in report.differences)
        ):
            log.warning(
                "ckptstore: on another world size the Trainer's own resume skips its saved step's batches on each "
                "rank, which are other samples here: %s",
                "the copy holds no global count of batches (saved before ckptstore kept one)"
                if not isinstance(saved, Mapping)
                else "the Trainer's sampler is not accelerate's seedable random one (train_sampling_strategy="
                f"{getattr(args, 'train_sampling_strategy', None)!r}), so no global order goes on",
            )
        return report, folder

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.checkpointer is None:  # train() was not wrapped: never start from scratch over copies
            options, identity = ranks_node(self.options)
            self.checkpointer = NodeCheckpointer(options, identity=identity)
            if self.checkpointer.start() is not None:
                raise ResumeRefusedError(
                    f"job {self.options.job!r} has checkpoints to resume from, but BackupAndRestore could not "
                    "hook this Trainer's train(): pass its newest checkpoint as resume_from_checkpoint, or "
                    "build the Trainer with the callback in callbacks="
                )
        loader = kwargs.get("train_dataloader")
        if loader is not None:
            self._steps_per_epoch = _update_steps(len(loader), max(args.gradient_accumulation_steps, 1))
            self._length = _length(getattr(loader, "dataset", None))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._stop_watching()
        if self.proof is not None and not self.proof.settled:
            self.proof.step({"global_step": state.global_step})

    def _stop_watching(self) -> None:
        while self._watching:
            self._watching.pop()()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A checkpoint request (`ckptstore checkpoint-now`): the Trainer saves at this step, as if
        `save_steps` said so, and `on_save` takes it."""
        if self.checkpointer is not None and self.checkpointer.requested:
            control.should_save = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The Trainer has just written checkpoint-<global_step>: save it through ckptstore."""
        assert self.checkpointer is not None, "on_train_begin runs first"
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if not args.should_save:
            return
        if not os.path.isdir(folder):
            log.warning("ckptstore: the Trainer's checkpoint %s is not there: this save is not in ckptstore", folder)
            return
        arrays, files = pack_folder(folder)
        position, consumed = self._position(state.global_step, args)
        metadata = {
            LAYOUT_KEY: files,
            "global_step": state.global_step,
            DATA_KEY: {"consumed": consumed, "world": args.world_size},
        }
        if "model" in kwargs:
            described = _fingerprint(kwargs["model"], args, self._length)
            upcoming = _next_ids(kwargs.get("train_dataloader"), consumed, args) if position.batch is not None else None
            proof = recorded(
                counters={"global_step": state.global_step}, next_ids={"train": upcoming} if upcoming else {}
            )
            metadata[FINGERPRINT_KEY] = described | {PROOF_KEY: proof}
        saved = self.checkpointer.save(position, arrays, step=state.global_step, metadata=metadata)
        if saved and position.is_end_of_epoch and args.world_size == 1 and "model" in kwargs:
            # The next epoch's order is drawn as its iterator is made: what it draws first is recorded late.
            self._late = LateRecord(position, {"train"}, (1, 0), self.checkpointer.record_drawn_next)
            self._watching.append(watch_every_iterator(functools.partial(self._late.drew, "train")))

    def _position(self, global_step: int, args: Any) -> tuple[Position, int]:
        """The position of the Trainer's `global_step`, and the global batches of its epoch trained
        there: counted on from the position resumed from, in its epoch (positions stay in order when
        the world size changed, and so what a step is)."""
        epoch, steps = divmod(global_step, self._steps_per_epoch)
        if steps == 0 and epoch > 0:
            return Position(epoch - 1), 0
        per_step = max(args.gradient_accumulation_steps, 1) * args.world_size
        resumed = self._resumed
        if resumed is not None and resumed.epoch == epoch and global_step >= resumed.global_step:
            done = global_step - resumed.global_step
            return Position(epoch, resumed.batch + done), resumed.consumed + done * per_step
        return Position(epoch, steps), steps * per_step

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The restored folder stays until here: the Trainer reads its RNG states once it has skipped batches.
        shutil.rmtree(_staging(args), ignore_errors=True)
        self._stop_watching()
        if self.proof is not None and not self.proof.settled:
            try:
                self.proof.settle("no batch was drawn after the restore")
            except CkptStoreError as exc:  # raise: a run that trained nothing has nothing to refuse
                log.warning("%s", exc)
        if self.checkpointer is not None:
            self.checkpointer.wait()
            self.checkpointer.close()
            self.checkpointer = None


def _staging(args: Any) -> str:
    """This rank's folder for the restored checkpoint (ranks on one machine share the output folder)."""
    staging = os.path.join(str(args.output_dir), STAGING)
    return staging if args.world_size == 1 else os.path.join(staging, f"rank-{args.process_index}")


def _go_on_from(trainer: transformers.Trainer, folder: str, position: Position, saved: Mapping[str, Any]) -> _Resumed:
    """Resume at the saved global count of the epoch's batches. On the saved world size that is the
    Trainer's own step. On another, the restored Trainer state's step is set to where the Trainer,
    skipping a step's batches on every rank, skips that count on this world size — and the batches of
    a step the ranks cannot share are left to the sampler to skip (`_Resumed.skipped`, `_skip_once`)."""
    args = trainer.args
    state_file = os.path.join(folder, "trainer_state.json")
    with open(state_file) as handle:
        state = json.load(handle)
    epoch, consumed = (position.epoch + 1, 0) if position.batch is None else (position.epoch, int(saved["consumed"]))
    if saved["world"] == args.world_size:
        return _Resumed(epoch, position.batch or 0, state["global_step"], consumed)
    accumulate = max(args.gradient_accumulation_steps, 1)
    steps_per_epoch = _update_steps(len(trainer.get_train_dataloader()), accumulate)
    steps, uneven = divmod(consumed, accumulate * args.world_size)
    global_step = epoch * steps_per_epoch + steps
    print(
        f"ckptstore: saved by {saved['world']} rank(s), resuming on {args.world_size}: epoch {epoch} goes on "
        f"after its first {consumed} batches of {args.per_device_train_batch_size} in the global order (the "
        f"Trainer's step {state['global_step']} is step {global_step} on this world size)",
        file=sys.stderr,
        flush=True,
    )
    state["global_step"] = global_step
    with open(state_file, "w") as handle:
        json.dump(state, handle)
    return _Resumed(epoch, position.batch or 0, global_step, consumed, uneven * args.per_device_train_batch_size)


def _skip_once(trainer: transformers.Trainer, count: int) -> None:
    """Have the training loader's next epoch skip its first `count` samples (made by the Trainer's
    `get_train_dataloader`, which this wraps for the one call)."""
    original = trainer.get_train_dataloader

    def skipping() -> Any:
        trainer.get_train_dataloader = original  # type: ignore[method-assign]
        loader = original()
        batches: Any = getattr(loader.batch_sampler, "batch_sampler", loader.batch_sampler)  # under accelerate's shard
        batches.sampler = _SkipFirst(batches, count)
        return loader

    trainer.get_train_dataloader = skipping  # type: ignore[method-assign]


def _next_ids(loader: Any, consumed: int, args: Any) -> list[int] | None:
    """The ids of the samples the Trainer's loader takes after `consumed` batches of the epoch — on
    one process, from accelerate's seedable sampler (its order a function of its epoch: drawn again
    here, changing nothing) or a sequential one; None where that cannot be told."""
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if args.world_size != 1 or type(sampler).__name__ not in ("SeedableRandomSampler", "SequentialSampler"):
        return None
    return next_batches_ids(loader.batch_sampler, consumed)
