"""docs/hf.md's block run as written (as a subprocess, to be SIGKILLed), with what it assumes defined:
a 2-layer GPT-2 built from a config (dropout on), synthetic tokens, the Trainer's shuffled sampler,
a checkpoint every 3 steps.

    python -m tests.hf_job --storage ROOT --job JOB --out OUT.npz [--kill-at STEP]
                           [--sequences N] [--accumulate GRADIENT_ACCUMULATION_STEPS]

Writes the final weights and optimizer state to OUT.npz. `--kill-at` SIGKILLs the process once the
Trainer finished that optimizer step (and ckptstore committed the save in flight).
"""

from __future__ import annotations

import os
import signal

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from tests.job_runs import documented_block, job_parser

TOKENS, LENGTH, VOCAB = 96, 16, 64


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int = TOKENS) -> None:
        self.ids = torch.randint(0, VOCAB, (count, LENGTH), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def main() -> None:
    parser = job_parser()
    parser.add_argument("--sequences", type=int, default=TOKENS)
    parser.add_argument("--accumulate", type=int, default=1, help="gradient_accumulation_steps")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=os.path.join(os.path.dirname(args.storage), "hf-output", args.job),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=args.accumulate,
        num_train_epochs=3,
        save_strategy="steps",
        save_steps=3,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        logging_steps=1000,
        seed=42,
        disable_tqdm=True,
    )
    from ckptstore.client.hf import BackupAndRestore

    class Backup(BackupAndRestore):
        """The documented callback, and a SIGKILL once step --kill-at is done and its save committed."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == kill_at and self.checkpointer is not None:
                self.checkpointer.wait()
                os.kill(os.getpid(), signal.SIGKILL)

    kill_at = args.kill_at
    placeholders = {'"s3://ckpt/jobs"': repr(args.storage), 'job="lm"': f'job={args.job!r}, node="n0"'}
    placeholders["from ckptstore.client.hf import BackupAndRestore\n"] = ""
    namespace = {
        "Trainer": Trainer,
        "model": model,
        "args": training,
        "dataset": Tokens(args.sequences),
        "BackupAndRestore": Backup,
    }
    exec(compile(documented_block("docs/hf.md", "## The callback", placeholders), "docs/hf.md", "exec"), namespace)
    trainer = namespace["trainer"]
    state = {f"model/{k}": v.detach().numpy().copy() for k, v in model.state_dict().items()}
    for index, slots in trainer.optimizer.state_dict()["state"].items():
        state |= {f"opt/{index}/{k}": torch.as_tensor(v).numpy().copy() for k, v in slots.items()}
    np.savez(args.out, **state)


if __name__ == "__main__":
    main()
