"""Plain DDP: an MLP with dropout on a synthetic regression set, a
DataLoader with a DistributedSampler, SGD with momentum. gloo, CPU.

    torchrun --nproc-per-node 3 ddp.py [STEPS]
"""

import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 50
SEED = int(os.environ.get("FAULTBENCH_SEED") or 0)  # the run's seed: its data, init and sampling


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(SEED)
    g = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(4096, 64, generator=g)
    y = torch.tanh(x[:, :8].sum(dim=1, keepdim=True))
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, seed=SEED, drop_last=True)
    loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                    torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    step, epoch, loss = 0, 0, torch.zeros(())
    while step < STEPS:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            optimizer.step()
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
