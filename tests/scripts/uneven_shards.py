"""Hand-made sharding `data[rank::world]` over a length the world size does
not divide: the last ranks get one batch fewer per epoch, run out of data
first and leave their peers waiting in the next allreduce. No rankwatch
import.

    rankwatch run --nproc-per-node 4 tests/scripts/uneven_shards.py
"""

import argparse
import gc

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=350)  # 4 ranks, batch 8: 88, 88, 87, 87 samples: 11, 11, 10, 10 batches
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--epochs", type=int, default=2)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randn(a.samples, 16)
    y = x.sum(dim=1, keepdim=True)
    mine = TensorDataset(x[rank::world], y[rank::world])  # every world-th sample, from this rank's offset
    loader = DataLoader(mine, batch_size=a.batch, drop_last=True)
    model = DDP(nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(a.epochs):
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
    print(f"rank {rank} done", flush=True)
    del model  # nothing may hold DDP at destroy_process_group (conftest.TORCH_TEARDOWN_ABORT)
    gc.collect()  # DDP is freed only by a cyclic collection
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
