"""Evaluation on rank 0 only every 50 steps (the model in eval mode, no
gradients, the module outside DDP), the other ranks waiting at a barrier;
DDP, SGD with momentum, MultiStepLR."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zoocommon as zc


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4))
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[150, 250], gamma=0.1)
    w = torch.randn(32, 4, generator=torch.Generator().manual_seed(a.seed))
    x_val = torch.randn(2048, 32, generator=torch.Generator().manual_seed(99))
    for step in range(a.steps):
        x = torch.randn(32, 32)
        loss = nn.functional.cross_entropy(ddp(x), (x @ w).argmax(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 49:
            if rank == 0:
                model.eval()
                with torch.no_grad():
                    accuracy = (model(x_val).argmax(-1) == (x_val @ w).argmax(-1)).float().mean()
                model.train()
            dist.barrier()
    zc.done(a.steps)


if __name__ == "__main__":
    main()
