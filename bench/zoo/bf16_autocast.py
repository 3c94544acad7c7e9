"""bf16 autocast on CPU (`torch.autocast("cpu", torch.bfloat16)`) around the
forward of a small conv net with GroupNorm; float32 weights; DDP, SGD with
Nesterov momentum, step decay."""

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zoocommon as zc


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(32, 10))
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.3)
    x_all, y_all = zc.images(2048, size=16, seed=a.seed * 10 + rank)
    for step in range(a.steps):
        i = (step * 32) % 2048
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(ddp(x_all[i:i + 32]), y_all[i:i + 32])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    zc.done(a.steps)


if __name__ == "__main__":
    main()
