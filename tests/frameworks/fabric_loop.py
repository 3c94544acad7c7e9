"""A small Lightning Fabric job: Fabric(accelerator="cpu", devices=2,
strategy="ddp"), launched by torchrun, with the user's own training loop.

A fault lives in the user's Dataset (see faults.py): on one rank, at the
batch of one step, it hangs, raises, or returns NaN inputs.
"""

import math
import sys

import torch
from torch.utils.data import DataLoader, Dataset

from lightning.fabric import Fabric

import faults

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 12
BATCH = 16


class Points(Dataset):
    """y = sum(x); counts the items it served to know which batch it is in
    (one process, no workers, no shuffling across the epoch boundary)."""

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
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(Points(BATCH * 2 * STEPS), batch_size=BATCH))
    model.train()
    loss = None
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
    final = fabric.all_reduce(loss.detach(), reduce_op="mean")
    if fabric.global_rank == 0:
        print(f"final loss: {final.item():.9g}", flush=True)
    # Without it, gloo's threads may abort the interpreter's exit ("terminate
    # called without an active exception", SIGABRT) under plain torchrun too.
    torch.distributed.barrier()  # every rank done before teardown: gloo's teardown races otherwise
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
