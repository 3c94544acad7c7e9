"""timm's ConvNeXt (`convnext_atto`: depthwise 7x7 convolutions, LayerNorm,
layer scale, stochastic depth 0.1) in channels_last, DDP, with timm's LAMB
optimizer (`create_optimizer_v2`, layer-wise trust ratio), a
`CosineLRScheduler` stepped per epoch of 50 updates with warmup, and
gradient accumulation over 2 micro-batches under `no_sync`. Runs on PyPI's
torch build (the zoo's vision venv, docs/zoo.md)."""

import contextlib

import timm
import torch
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from torch.nn.parallel import DistributedDataParallel as DDP

import zoocommon as zc

ACCUMULATE = 2
PER_EPOCH = 50


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = timm.create_model("convnext_atto", pretrained=False, num_classes=10, drop_path_rate=0.1)
    model = model.to(memory_format=torch.channels_last)
    ddp = DDP(model)
    opt = create_optimizer_v2(model, opt="lamb", lr=2e-3, weight_decay=0.05)
    epochs = max(1, a.steps // PER_EPOCH)
    sched = CosineLRScheduler(opt, t_initial=epochs, warmup_t=1, warmup_lr_init=1e-5)
    x_all, y_all = zc.images(1024, size=32, seed=a.seed * 10 + rank)
    for step in range(a.steps):
        for micro in range(ACCUMULATE):
            i = ((step * ACCUMULATE + micro) * 8) % 1024
            x = x_all[i:i + 8].contiguous(memory_format=torch.channels_last)
            sync = micro == ACCUMULATE - 1
            with contextlib.nullcontext() if sync else ddp.no_sync():
                loss = torch.nn.functional.cross_entropy(ddp(x), y_all[i:i + 8]) / ACCUMULATE
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % PER_EPOCH == 0:
            sched.step((step + 1) // PER_EPOCH)
    zc.done(a.steps)


if __name__ == "__main__":
    main()
