"""Hugging Face Accelerate: `Accelerator(gradient_accumulation_steps=2)` with
its `accumulate` context (no_sync inside), `prepare` of model, optimizer,
loader and scheduler, `accelerator.backward`, `clip_grad_norm_`; a tiny
GPT-2 from a config. Steps are optimizer steps."""

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, get_cosine_schedule_with_warmup

import zoocommon as zc

VOCAB, ACCUMULATE = 128, 2


def main():
    a = zc.args()
    zc.seed_all(a.seed)
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATE, cpu=True)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = get_cosine_schedule_with_warmup(opt, 20 * ACCUMULATE, a.steps * ACCUMULATE)
    ids = zc.tokens(a.steps * ACCUMULATE * 8 * accelerator.num_processes + 64, 32, VOCAB, seed=a.seed)
    loader = DataLoader(ids, batch_size=8, shuffle=True)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    steps = 0
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                steps += 1
            opt.step()
            sched.step()
            opt.zero_grad()
        if steps >= a.steps:
            break
    zc.done(steps)


if __name__ == "__main__":
    main()
