"""Early stopping: validation every 10 steps on every rank (losses averaged
with an allreduce), stop when it has not improved for a patience of 6
checks, but not before a minimum of steps; the best weights restored at the
end. DDP, AdamW, ReduceLROnPlateau on the validation loss."""

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zoocommon as zc


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=2, factor=0.5)
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(a.seed))
    x_val = torch.randn(256, 16, generator=torch.Generator().manual_seed(99 + rank))
    best, best_state, waited, step = float("inf"), None, 0, 0
    while True:
        x = torch.randn(32, 16)
        loss = nn.functional.mse_loss(ddp(x), torch.tanh(x @ w))
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % 10 == 0:
            model.eval()
            with torch.no_grad():
                val = nn.functional.mse_loss(model(x_val), torch.tanh(x_val @ w)).reshape(1)
            model.train()
            dist.all_reduce(val)
            val = float(val) / world
            plateau.step(val)
            if val < best - 1e-4:
                best, best_state, waited = val, copy.deepcopy(model.state_dict()), 0
            else:
                waited += 1
            if (waited >= 6 and step >= a.steps) or step >= 3 * a.steps:
                break
    model.load_state_dict(best_state)
    zc.done(step)


if __name__ == "__main__":
    main()
