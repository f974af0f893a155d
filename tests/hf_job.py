"""A Hugging Face `Trainer` run as a user writes it with `client.hf.BackupAndRestore` (run as a
subprocess, to be SIGKILLed): a 2-layer GPT-2 built from a config (dropout on), synthetic tokens,
the Trainer's shuffled sampler, a checkpoint every 3 steps.

    python -m tests.hf_job --storage ROOT --job JOB --out OUT.npz [--kill-at STEP] [--native]

Writes the final weights and optimizer state to OUT.npz. `--kill-at` SIGKILLs the process once the
Trainer finished that optimizer step (and ckptstore committed the save in flight). `--native`
trains without ckptstore and, with `--resume`, resumes with the Trainer's own
`resume_from_checkpoint=True` (to compare with).
"""

from __future__ import annotations

import argparse
import os
import signal

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

TOKENS, LENGTH, VOCAB = 96, 16, 64


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, VOCAB, (TOKENS, LENGTH), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return TOKENS

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class KillAt(TrainerCallback):
    def __init__(self, step: int, ckptstore_callback=None):
        self.step, self.ckptstore_callback = step, ckptstore_callback

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            checkpointer = getattr(self.ckptstore_callback, "checkpointer", None)
            if checkpointer is not None:
                checkpointer.wait()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--storage", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--native", action="store_true")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=os.path.join(args.storage, "hf-output", args.job),
        per_device_train_batch_size=8,
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
    callbacks: list[TrainerCallback] = []
    ckptstore_callback = None
    if not args.native:
        from client.hf import BackupAndRestore

        ckptstore_callback = BackupAndRestore(storage=args.storage, job=args.job, node="n0")
        callbacks.append(ckptstore_callback)
    if args.kill_at is not None:
        callbacks.append(KillAt(args.kill_at, ckptstore_callback))
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    state = {f"model/{k}": v.detach().numpy().copy() for k, v in model.state_dict().items()}
    for index, slots in trainer.optimizer.state_dict()["state"].items():
        state |= {f"opt/{index}/{k}": torch.as_tensor(v).numpy().copy() for k, v in slots.items()}
    np.savez(args.out, **state)


if __name__ == "__main__":
    main()
