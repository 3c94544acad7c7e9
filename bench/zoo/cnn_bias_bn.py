"""A plain CNN as tutorials write it: Conv2d(bias=True) before BatchNorm2d
(the bias's gradient is ~1e-8: BatchNorm removes the batch mean), DDP, and
the optimizer of PyTorch's "60 minute blitz" tutorial (SGD, lr 0.001,
momentum 0.9: lr x grad ~1e-11 is far below the bias's float32 resolution,
so the step leaves it exactly unchanged), cosine schedule."""

import itertools

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import zoocommon as zc


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=True), nn.BatchNorm2d(cout), nn.ReLU(),
                         nn.MaxPool2d(2))


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = nn.Sequential(block(3, 16), block(16, 32), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.steps)
    data = TensorDataset(*zc.images(2048, size=16, seed=a.seed))
    sampler = DistributedSampler(data, seed=a.seed)
    loader = zc.Repeat(DataLoader(data, batch_size=32, sampler=sampler, drop_last=True), sampler)
    for x, y in itertools.islice(loader, a.steps):
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        sched.step()
    zc.done(a.steps)


if __name__ == "__main__":
    main()
