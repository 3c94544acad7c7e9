"""Fine-tuning with a frozen backbone unfrozen later: the backbone's
parameters start with `requires_grad=False` in their own param group with
lr 0, and at a third of the run they are unfrozen and their group gets a
small lr (a param group with lr 0 until then); the head trains throughout.
DDP with `find_unused_parameters` off (the frozen part has no gradient by
design, DDP is rebuilt at the unfreeze, as users do); SGD."""

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zoocommon as zc


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    backbone = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
    head = nn.Linear(64, 4)
    model = nn.Sequential(backbone, head)
    for p in backbone.parameters():
        p.requires_grad_(False)
    ddp = DDP(model)
    opt = torch.optim.SGD([{"params": backbone.parameters(), "lr": 0.0}, {"params": head.parameters(), "lr": 0.05}],
                          momentum=0.9)
    w = torch.randn(32, 4, generator=torch.Generator().manual_seed(a.seed))
    for step in range(a.steps):
        if step == a.steps // 3:
            for p in backbone.parameters():
                p.requires_grad_(True)
            opt.param_groups[0]["lr"] = 0.005
            del ddp
            ddp = DDP(model)  # DDP registers its hooks for the parameters that need gradients
        x = torch.randn(32, 32)
        loss = nn.functional.cross_entropy(ddp(x), (x @ w).argmax(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    zc.done(a.steps)


if __name__ == "__main__":
    main()
