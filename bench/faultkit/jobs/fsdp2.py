"""FSDP2 (`fully_shard` per layer and at the root) on an MLP with dropout, a
DataLoader with a DistributedSampler, AdamW. gloo, CPU.

    torchrun --nproc-per-node 3 fsdp2.py [STEPS]
"""

import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 50
SEED = int(os.environ.get("FAULTBENCH_SEED") or 0)  # the run's seed: its data, init and sampling


def main():
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(SEED)
    g = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(4096, 32, generator=g)
    y = torch.tanh(x[:, :8].sum(dim=1, keepdim=True))
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, seed=SEED, drop_last=True)
    loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(128, 128), torch.nn.GELU(), torch.nn.Linear(128, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    step, epoch, loss = 0, 0, torch.zeros(())
    while step < STEPS:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == STEPS:
                break
        epoch += 1
    final = loss.detach().clone()
    dist.all_reduce(final)
    if dist.get_rank() == 0:
        print(f"final loss: {final.item() / dist.get_world_size():.6f}", flush=True)
    # The model let go before the process group (tests/conftest.py: gloo may abort the exit otherwise).
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
