"""`torch.compile` of a DDP model (an MLP with LayerNorm and dropout), AdamW,
linear warmup from lr 0 (LambdaLR)."""

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zoocommon as zc


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = nn.Sequential(nn.Linear(32, 128), nn.LayerNorm(128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 128),
                          nn.GELU(), nn.Linear(128, 8))
    compiled = torch.compile(DDP(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 30))
    w = torch.randn(32, 8, generator=torch.Generator().manual_seed(a.seed))
    for step in range(a.steps):
        x = torch.randn(32, 32)
        loss = nn.functional.cross_entropy(compiled(x), (x @ w).argmax(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    zc.done(a.steps)


if __name__ == "__main__":
    main()
