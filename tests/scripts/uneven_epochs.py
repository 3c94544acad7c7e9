"""Issue 24 part 5: rank 0 has 30 batches per epoch, rank 1 has 20, no
Join, a model so small that the first epoch ends in well under a second
(before any heartbeat). Rank 1 leaves the epoch first; the epoch-end metric
all_reduce then meets rank 0's gradient allreduce (a collective mismatch).
No rankwatch import.

    rankwatch run --nproc-per-node 2 tests/scripts/uneven_epochs.py
"""

import gc
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

dist.init_process_group("gloo")
rank = dist.get_rank()
batches = 30 if rank == 0 else 20
torch.manual_seed(rank)
loader = DataLoader(TensorDataset(torch.randn(batches * 8, 16), torch.randn(batches * 8, 1)), batch_size=8)
model = DDP(nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for epoch in range(3):
    for xb, yb in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
    metric = torch.tensor([float(epoch)])
    dist.all_reduce(metric)  # the epoch's metric
print(f"rank {rank} done", flush=True)
del model  # nothing may hold DDP at destroy_process_group (conftest.TORCH_TEARDOWN_ABORT)
gc.collect()  # DDP is freed only by a cyclic collection
dist.destroy_process_group()
