"""A small Hugging Face `transformers` Trainer job (accelerate, gloo, CPU),
launched by torchrun: a 2-layer GPT-2 built from a config (no download)
trained on a local text file, characters as tokens.

    hf_trainer.py TEXT_FILE OUTPUT_DIR [STEPS]

A fault is a TrainerCallback (hang, crash) or a forward hook on the token
embedding (NaN activations) on one rank at one step (see faults.py).
"""

import math
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import faults

TEXT, OUT = sys.argv[1], sys.argv[2]
STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 10
CONTEXT = 32


class Chars(Dataset):
    def __init__(self, path: str):
        ids = torch.tensor([min(ord(c), 127) for c in open(path, encoding="utf-8").read()])
        self.blocks = ids[: len(ids) // CONTEXT * CONTEXT].view(-1, CONTEXT)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


class Faults(TrainerCallback):
    step = 0

    def on_step_begin(self, args, state, control, **kwargs):
        Faults.step = state.global_step
        faults.hang_or_crash(faults.due(state.global_step, ("hang", "crash")))


class LastLoss(TrainerCallback):
    loss = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            LastLoss.loss = logs["loss"]


def poison(module, inputs, output):
    if faults.due(Faults.step, ("nan",)):
        return output * math.nan
    return output


def main():
    config = GPT2Config(vocab_size=128, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.transformer.wte.register_forward_hook(poison)
    args = TrainingArguments(output_dir=OUT, max_steps=STEPS, per_device_train_batch_size=4,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0,
                             disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Chars(TEXT), callbacks=[Faults(), LastLoss()])
    trainer.train()
    if trainer.is_world_process_zero():
        print(f"final loss: {LastLoss.loss:.9g}", flush=True)
    # Without it, gloo's threads may abort the interpreter's exit ("terminate
    # called without an active exception", SIGABRT) under plain torchrun too.
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
