"""Hugging Face `transformers` Trainer (accelerate, gloo, CPU): a 2-layer GPT-2
built from a config (no download) on generated text, characters as tokens.

    torchrun --nproc-per-node 3 hf_job.py OUTPUT_DIR [STEPS]
"""

import gc
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

OUT = sys.argv[1]
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 50
SEED = int(os.environ.get("FAULTBENCH_SEED") or 0)  # the run's seed: init and data order
CONTEXT = 32
WORDS = ("the rank waits in a collective while its peer sleeps and the loss goes down slowly as the "
         "replicas agree on every step of the run").split()


class Chars(Dataset):
    def __init__(self):
        text = " ".join(WORDS[(i * 7 + i // 3) % len(WORDS)] for i in range(20000))
        ids = torch.tensor([min(ord(c), 127) for c in text])
        self.blocks = ids[: len(ids) // CONTEXT * CONTEXT].view(-1, CONTEXT)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


class LastLoss(TrainerCallback):
    loss = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            LastLoss.loss = logs["loss"]


def main():
    config = GPT2Config(vocab_size=128, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(output_dir=OUT, max_steps=STEPS, per_device_train_batch_size=8,
                             learning_rate=1e-3, logging_steps=5, save_strategy="no", report_to=[],
                             use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0,
                             disable_tqdm=True, seed=SEED)
    trainer = Trainer(model=model, args=args, train_dataset=Chars(), callbacks=[LastLoss()])
    trainer.train()
    if trainer.is_world_process_zero():
        print(f"final loss: {LastLoss.loss:.6f}", flush=True)
    # The model let go before the process group (tests/conftest.py: gloo may abort the exit otherwise).
    del trainer, model
    gc.collect()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
