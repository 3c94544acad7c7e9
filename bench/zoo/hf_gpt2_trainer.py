"""Hugging Face GPT-2 (tiny config, tied embeddings) through `Trainer`
(DDP under torchrun, cosine schedule with warmup, evaluation on all ranks)."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import zoocommon as zc

VOCAB = 128


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        self.ids = zc.tokens(n, 32, VOCAB, seed=seed)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=f"zoo-out-{a.seed}", max_steps=a.steps, per_device_train_batch_size=8,
                             learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=20, weight_decay=0.01,
                             eval_strategy="steps", eval_steps=100, per_device_eval_batch_size=16,
                             logging_steps=50, save_strategy="no", report_to=[], seed=a.seed, use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(2048, a.seed), eval_dataset=Tokens(64, 99))
    trainer.train()
    zc.done(trainer.state.global_step)


if __name__ == "__main__":
    main()
