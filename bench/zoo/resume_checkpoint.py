"""Resume from a checkpoint mid-run: half the steps, `torch.save` of model,
optimizer and scheduler state (rank 0), then a new model, optimizer and
scheduler built and loaded from it (as a restarted script does) for the
rest; DDP, AdamW, cosine."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zoocommon as zc


def build():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 1000)
    return model, DDP(model), opt, sched


def train(ddp, opt, sched, steps, w):
    for _ in range(steps):
        x = torch.randn(32, 32)
        loss = nn.functional.cross_entropy(ddp(x), (x @ w).argmax(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    w = torch.randn(32, 4, generator=torch.Generator().manual_seed(a.seed))
    path = os.path.abspath(f"zoo-resume-{a.seed}.pt")
    model, ddp, opt, sched = build()
    first = a.steps // 2
    train(ddp, opt, sched, first, w)
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, path)
    dist.barrier()
    del ddp
    model, ddp, opt, sched = build()
    state = torch.load(path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    train(ddp, opt, sched, a.steps - first, w)
    zc.done(a.steps)


if __name__ == "__main__":
    main()
