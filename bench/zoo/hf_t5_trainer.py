"""Hugging Face T5 (tiny config) through `Seq2SeqTrainer` with
`DataCollatorForSeq2Seq` (dynamic padding of inputs and labels), bf16
autocast, ReduceLROnPlateau-free linear schedule."""

import random

import torch
from transformers import (DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments, T5Config,
                          T5ForConditionalGeneration)

import zoocommon as zc

VOCAB = 96


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        rng = random.Random(seed)
        self.items = []
        for _ in range(n):
            length = rng.randint(4, 20)
            ids = [rng.randrange(2, VOCAB) for _ in range(length)]
            self.items.append({"input_ids": ids, "attention_mask": [1] * length, "labels": ids[::-1]})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class PadOnly:
    """The collator only pads: a tokenizer-free stand-in for its `pad` call."""

    pad_token_id = 0
    padding_side = "right"

    def pad(self, features, padding=True, max_length=None, pad_to_multiple_of=None, return_tensors="pt"):
        longest = max(len(f["input_ids"]) for f in features)
        out = {k: torch.tensor([f[k] + [0] * (longest - len(f[k])) for f in features]) for k in ("input_ids",
                                                                                              "attention_mask")}
        return out


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                                                pad_token_id=0))
    args = Seq2SeqTrainingArguments(output_dir=f"zoo-out-{a.seed}", max_steps=a.steps, per_device_train_batch_size=8,
                                    learning_rate=1e-3, warmup_steps=20, logging_steps=50, save_strategy="no",
                                    report_to=[], seed=a.seed, use_cpu=True, bf16=True, disable_tqdm=True,
                                    dataloader_num_workers=0)
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=Pairs(2048, a.seed),
                             data_collator=DataCollatorForSeq2Seq(PadOnly(), model=model, label_pad_token_id=-100))
    trainer.train()
    zc.done(trainer.state.global_step)


if __name__ == "__main__":
    main()
