"""Uneven inputs: each rank has a different number of batches
(`drop_last=False`, a last short batch, ranks with more data), trained in
DDP's `Join` context so the ranks that finish early shadow the others'
allreduces. Several epochs; Adam."""

import torch
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import zoocommon as zc


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    ddp = DDP(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    n = 1000 + 37 * rank  # a different amount of data per rank, not a multiple of the batch
    x = torch.randn(n, 16)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    loader = DataLoader(data, batch_size=32, shuffle=True, drop_last=False)
    steps = 0
    while steps < a.steps:
        with Join([ddp]):
            for xb, yb in loader:
                opt.zero_grad()
                nn.functional.mse_loss(ddp(xb), yb).backward()
                opt.step()
                steps += 1
    zc.done(steps)


if __name__ == "__main__":
    main()
