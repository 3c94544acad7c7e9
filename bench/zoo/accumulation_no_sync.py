"""Gradient accumulation over 4 micro-batches with DDP's `no_sync()` on all
but the last one (one allreduce per optimizer step), Adam, linear warmup from
lr 0 then constant. Steps are optimizer steps."""

import contextlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zoocommon as zc

ACCUMULATE = 4


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    ddp = DDP(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 20))
    w = torch.randn(32, 4, generator=torch.Generator().manual_seed(a.seed))
    for step in range(a.steps):
        opt.zero_grad()
        for micro in range(ACCUMULATE):
            x = torch.randn(16, 32)
            sync = micro == ACCUMULATE - 1
            with contextlib.nullcontext() if sync else ddp.no_sync():
                loss = nn.functional.cross_entropy(ddp(x), (x @ w).argmax(-1)) / ACCUMULATE
                loss.backward()
        opt.step()
        sched.step()
    zc.done(a.steps)


if __name__ == "__main__":
    main()
