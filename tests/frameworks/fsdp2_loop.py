"""A small FSDP2 job (`torch.distributed.fsdp.fully_shard`, gloo, CPU) with a
plain training loop, launched by torchrun.

A fault lives in the user's Dataset (see faults.py): on one rank, at the
batch of one step, it hangs, raises, or returns NaN inputs.
"""

import math
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import faults

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 12
BATCH = 16


class Points(Dataset):
    """y = sum(x); counts the items it served to know which batch it is in."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)
        self.served = 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        step = self.served // BATCH
        self.served += 1
        kind = faults.due(step)
        faults.hang_or_crash(kind)
        x = self.x[i].clone()
        if kind == "nan":
            x.fill_(math.nan)
        return x, self.y[i]


def main():
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                torch.nn.GELU(), torch.nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = Points(BATCH * dist.get_world_size() * STEPS)
    loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, shuffle=False))
    loss = None
    for step, (x, y) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    final = loss.detach().clone()
    dist.all_reduce(final)
    if dist.get_rank() == 0:
        print(f"final loss: {final.item() / dist.get_world_size():.9g}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
