"""Hugging Face T5 (tiny config) in a plain DDP loop with gradient
checkpointing (the forward recomputed in backward), Adafactor-free AdamW,
constant schedule with warmup from lr 0."""

import itertools

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import T5Config, T5ForConditionalGeneration, get_constant_schedule_with_warmup

import zoocommon as zc

VOCAB = 96


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    config = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                      num_heads=4, decoder_start_token_id=0, pad_token_id=0)
    model = T5ForConditionalGeneration(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = get_constant_schedule_with_warmup(opt, num_warmup_steps=20)
    src = zc.tokens(4096, 24, VOCAB, seed=a.seed * 10 + rank)
    for step in range(a.steps):
        x = src[(step * 8) % 4096:(step * 8) % 4096 + 8]
        loss = ddp(input_ids=x, labels=x.flip(1)).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    zc.done(a.steps)


if __name__ == "__main__":
    main()
