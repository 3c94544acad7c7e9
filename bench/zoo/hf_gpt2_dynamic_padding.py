"""Hugging Face GPT-2 (tiny config, tied embeddings) in a plain DDP loop with
dynamic padding: each batch is padded to its own longest sequence, so the
input shape changes on most steps. AdamW, no weight decay on norms and
biases, warmup from lr 0 then linear decay, gradient clipping."""

import itertools
import random

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

import zoocommon as zc

VOCAB = 128


def batches(seed: int):
    rng = random.Random(seed)
    while True:
        lengths = [rng.randint(8, 48) for _ in range(8)]
        longest = max(lengths)
        seqs = zc.tokens(8, longest, VOCAB, seed=rng.randrange(1 << 30))
        mask = torch.zeros(8, longest, dtype=torch.long)
        for i, n in enumerate(lengths):
            mask[i, :n] = 1
        ids = seqs.masked_fill(mask == 0, 0)
        labels = ids.masked_fill(mask == 0, -100)
        yield ids, mask, labels


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=2, tie_word_embeddings=True)
    model = GPT2LMHeadModel(config)
    ddp = DDP(model)
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    rest = [p for n, p in model.named_parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}], lr=1e-3)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=30, num_training_steps=a.steps)
    for ids, mask, labels in itertools.islice(batches(a.seed * 100 + rank), a.steps):
        loss = ddp(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    zc.done(a.steps)


if __name__ == "__main__":
    main()
