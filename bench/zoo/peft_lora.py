"""PEFT LoRA adapters on a frozen Hugging Face GPT-2 base (tiny config): only
the adapters train; DDP, AdamW, linear warmup."""

import torch
from peft import LoraConfig, get_peft_model
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

import zoocommon as zc

VOCAB = 128


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=2))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                                            lora_dropout=0.05, fan_in_fan_out=True))
    ddp = DDP(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    sched = get_linear_schedule_with_warmup(opt, 20, a.steps)
    data = zc.tokens(4096, 32, VOCAB, seed=a.seed * 10 + rank)
    for step in range(a.steps):
        x = data[(step * 8) % 4096:(step * 8) % 4096 + 8]
        ddp(input_ids=x, labels=x).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    zc.done(a.steps)


if __name__ == "__main__":
    main()
