"""Contrastive learning (SimCLR's NT-Xent): two augmented views per example,
the embeddings of every rank gathered with `all_gather` (the local ones keep
their gradient) so negatives come from the whole global batch; DDP, SGD with
momentum, cosine schedule."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zoocommon as zc


def gather(z):
    parts = [torch.zeros_like(z) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, z.detach())
    parts[dist.get_rank()] = z  # this rank's part keeps its graph
    return torch.cat(parts)


def nt_xent(z1, z2, temperature=0.2):
    z = nn.functional.normalize(torch.cat([gather(z1), gather(z2)]), dim=1)
    n = len(z) // 2
    sim = z @ z.t() / temperature
    sim.fill_diagonal_(float("-inf"))
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)])
    return nn.functional.cross_entropy(sim, targets)


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    encoder = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                            nn.Flatten(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 32))
    ddp = DDP(encoder)
    opt = torch.optim.SGD(encoder.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, a.steps)
    x_all, _ = zc.images(1024, size=16, seed=a.seed * 10 + rank)
    for step in range(a.steps):
        x = x_all[(step * 16) % 1024:(step * 16) % 1024 + 16]
        v1 = x + 0.3 * torch.randn_like(x)
        v2 = torch.flip(x, dims=[3]) + 0.3 * torch.randn_like(x)
        loss = nt_xent(ddp(v1), ddp(v2))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    zc.done(a.steps)


if __name__ == "__main__":
    main()
