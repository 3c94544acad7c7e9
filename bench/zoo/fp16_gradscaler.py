"""fp16 autocast with `torch.amp.GradScaler`: the scale starts at 2**24, so
the first steps overflow and are skipped (the scaler never calls the
optimizer) until the scale settles; DDP, Adam."""

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zoocommon as zc


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))
    ddp = DDP(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=50)
    w = torch.randn(32, 4, generator=torch.Generator().manual_seed(a.seed))
    skipped = 0
    for step in range(a.steps):
        x = torch.randn(64, 32)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(ddp(x), (x @ w).argmax(-1))
        opt.zero_grad()
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
    if rank == 0:
        print(f"zoo: skipped_steps={skipped}", flush=True)
    zc.done(a.steps)


if __name__ == "__main__":
    main()
