"""A small CNN trained with DDP, DataLoader workers and gradient accumulation
(no_sync). No rankwatch import: the held-out shape of a user's script."""

import argparse
import gc
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4))
        self.head = nn.Linear(16 * 16, 10)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow", type=float, default=0.0)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-step", type=int, default=-1)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(a.seed)
    g = torch.Generator().manual_seed(1234)
    data = TensorDataset(torch.randn(512, 1, 16, 16, generator=g), torch.randint(0, 10, (512,), generator=g))
    sampler = DistributedSampler(data, seed=a.seed)
    loader = DataLoader(data, batch_size=16, sampler=sampler, num_workers=2, persistent_workers=True)
    model = DDP(Net())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = 0
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % a.accum == 0
            if rank == a.slow_rank:
                time.sleep(a.slow)
            if rank == a.hang_rank and step == a.hang_step:
                time.sleep(3600)
            ctx = model.no_sync() if not last else torch.enable_grad()
            with ctx:
                loss = nn.functional.cross_entropy(model(x), y) / a.accum
                loss.backward()
            if last:
                opt.step()
                opt.zero_grad()
                step += 1
    del model  # nothing may hold DDP at destroy_process_group (conftest.TORCH_TEARDOWN_ABORT)
    gc.collect()  # DDP is freed only by a cyclic collection
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
