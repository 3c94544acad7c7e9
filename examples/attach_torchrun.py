"""rankwatch without `rankwatch run`: a script started by plain torchrun (or
Ray, or srun) attaches the agent itself.

    rankwatch serve --host 0.0.0.0 --port 8765 --token "$TOKEN" &   # a standalone collector
    RANKWATCH_COLLECTOR=http://collector-host:8765 RANKWATCH_TOKEN="$TOKEN" \\
        torchrun --nproc-per-node 2 examples/attach_torchrun.py

The agent reads RANKWATCH_COLLECTOR (the older RANKWATCH_COLLECTOR_URL is
accepted too), RANKWATCH_TOKEN, RANKWATCH_RUN_ID (else torchrun's
TORCHELASTIC_RUN_ID) and any other RANKWATCH_<KEY> setting. Attach before the
model is wrapped in DistributedDataParallel. Without a collector the agent
stays quiet and the job runs as it would without it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import rankwatch.agent as rw


def main() -> None:
    rw.attach()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(50):
        x, y = torch.randn(32, 16), torch.randn(32, 1)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    if dist.get_rank() == 0:
        print(f"final loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
