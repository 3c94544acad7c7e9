"""Hugging Face BERT masked LM (tiny config) through `Trainer` with the
library's `DataCollatorForLanguageModeling` (random masking, dynamic padding
of variable-length examples), linear schedule with warmup."""

import random

import torch
from transformers import (BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling,
                          PreTrainedTokenizerFast, Trainer, TrainingArguments)
from tokenizers import Tokenizer, models, pre_tokenizers

import zoocommon as zc

WORDS = [f"w{i}" for i in range(100)]


def tokenizer():
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


class Sentences(torch.utils.data.Dataset):
    def __init__(self, tok, n, seed):
        rng = random.Random(seed)
        self.items = []
        for _ in range(n):
            start, length = rng.randrange(100), rng.randint(6, 40)
            text = " ".join(WORDS[(start + k) % 100] for k in range(length))
            self.items.append(tok(text))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    tok = tokenizer()
    model = BertForMaskedLM(BertConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=128, max_position_embeddings=64))
    args = TrainingArguments(output_dir=f"zoo-out-{a.seed}", max_steps=a.steps, per_device_train_batch_size=8,
                             learning_rate=5e-4, warmup_steps=30, weight_decay=0.01, logging_steps=50,
                             save_strategy="no", report_to=[], seed=a.seed, use_cpu=True, disable_tqdm=True,
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Sentences(tok, 2048, a.seed),
                      data_collator=DataCollatorForLanguageModeling(tok, mlm_probability=0.15))
    trainer.train()
    zc.done(trainer.state.global_step)


if __name__ == "__main__":
    main()
