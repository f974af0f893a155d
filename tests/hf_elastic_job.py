"""A Hugging Face `Trainer` under DDP that records which samples each rank trains (run as gloo ranks by
tests.test_torch.ranks, to be SIGKILLed): a tiny regression model, the Trainer's own shuffled sampler
(accelerate deals its batches out to the ranks), a checkpoint every --every steps (2: `save_steps`) through
BackupAndRestore, every copy kept.

    python -m tests.hf_elastic_job --storage ROOT --job J --out TRAINED.jsonl [--kill-at STEP] [--every N]
                                   [--sampling random|sequential]

Appends one line per batch trained to --out: {"epoch", "batch", "indices"} (`batch`: the Trainer's
global step before it — in epoch 0, the batch's index on its rank). --kill-at SIGKILLs every rank once that optimizer step is done, before its
own save (the save in flight committed). Prints FRESH or RESUMED EPOCH BATCH last.
"""

from __future__ import annotations

import json
import os
import signal

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

from tests.job_runs import job_parser

SAMPLES, BATCH, EPOCHS = 96, 8, 2


class Indexed(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": torch.tensor([float(index)]), "labels": torch.tensor([1.0]), "index": torch.tensor(index)}


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": ((self.linear(x / SAMPLES) - labels) ** 2).mean()}


def main() -> None:
    parser = job_parser()
    parser.add_argument("--every", type=int, default=2, help="save_steps")
    parser.add_argument("--sampling", default="random", help="train_sampling_strategy")
    args = parser.parse_args()
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
    training = TrainingArguments(
        output_dir=os.path.join(os.path.dirname(args.storage), "hf-output", args.job),
        per_device_train_batch_size=BATCH,
        num_train_epochs=EPOCHS,
        save_strategy="steps",
        save_steps=args.every,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        logging_steps=1000,
        seed=42,
        disable_tqdm=True,
        remove_unused_columns=False,
        train_sampling_strategy=args.sampling,
    )
    trained = open(args.out, "a")

    class Recording(Trainer):
        def compute_loss(self, model, inputs, *rest, **more):  # type: ignore[no-untyped-def]
            indices = inputs.pop("index").tolist()
            record = {"epoch": int(self.state.epoch or 0), "batch": self.state.global_step, "indices": indices}
            trained.write(json.dumps(record) + "\n")
            trained.flush()
            return super().compute_loss(model, inputs, *rest, **more)

    class Kill(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step == kill_at:
                backup.checkpointer.wait()
                os.kill(os.getpid(), signal.SIGKILL)

    from ckptstore.client.hf import BackupAndRestore

    kill_at = args.kill_at
    backup = BackupAndRestore(storage=args.storage, job=args.job, max_to_keep=None)
    trainer = Recording(model=Regression(), args=training, train_dataset=Indexed(), callbacks=[backup, Kill()])
    trainer.train()
    resumed = backup.resume_position
    print("FRESH" if resumed is None else f"RESUMED {resumed.epoch} {resumed.batch}", flush=True)


if __name__ == "__main__":
    main()
