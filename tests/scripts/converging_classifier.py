"""A small classifier that converges fast: separable classes, Adam, the loss
near 0 within a few hundred steps, where one rank's rare mislabelled sample
gives a gradient norm ~100x its peers' and ~10x its own median. Healthy. No rankwatch import.

    rankwatch run --nproc-per-node 4 tests/scripts/converging_classifier.py
"""

import argparse
import gc

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flip", type=float, default=0.01, help="fraction of mislabelled samples")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(a.seed)
    model = DDP(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank + 17 * a.seed)
    centers = torch.tensor([[2.0] * 8, [-2.0] * 8])
    for step in range(a.steps):
        y = torch.randint(0, 2, (a.batch,), generator=g)
        x = centers[y] + 0.8 * torch.randn(a.batch, 8, generator=g)
        # A rare mislabelled sample: once the others are fitted (loss near 0), the
        # rank whose batch holds one has a gradient norm ~100x its peers'.
        flip = torch.rand(a.batch, generator=g) < a.flip
        y = torch.where(flip, 1 - y, y)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step % 100 == 0:
            print(f"step {step} loss {loss.item():.5f}", flush=True)
    print(f"done: {a.steps} steps", flush=True)
    dist.barrier()
    del model  # nothing may hold DDP at destroy_process_group (conftest.TORCH_TEARDOWN_ABORT)
    gc.collect()  # DDP is freed only by a cyclic collection
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
