"""torchvision's `mobilenet_v3_small` (depthwise convolutions, BatchNorm,
squeeze-excitation, Hardswish, dropout) in channels_last memory format, DDP,
RMSprop as the torchvision reference trains MobileNetV3 (alpha 0.9, eps
0.0316, momentum 0.9), weight decay 1e-5, StepLR. (bf16 autocast runs in
bf16_autocast: on this CPU it tripled this job's time.) Runs on PyPI's torch
build (the zoo's vision venv, docs/zoo.md)."""

import torch
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP

import zoocommon as zc


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = torchvision.models.mobilenet_v3_small(num_classes=10).to(memory_format=torch.channels_last)
    ddp = DDP(model)
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3, alpha=0.9, eps=0.0316, momentum=0.9, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
    x_all, y_all = zc.images(1024, size=16, seed=a.seed * 10 + rank)
    for step in range(a.steps):
        i = (step * 16) % 1024
        x = x_all[i:i + 16].contiguous(memory_format=torch.channels_last)
        loss = torch.nn.functional.cross_entropy(ddp(x), y_all[i:i + 16])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    zc.done(a.steps)


if __name__ == "__main__":
    main()
