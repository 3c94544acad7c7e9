"""Hugging Face `MobileNetV2ForImageClassification` (tiny config: depthwise
convolutions, BatchNorm, ReLU6) in channels_last memory format (model and
inputs), DDP, RMSprop as in the paper, exponential decay."""

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

import zoocommon as zc


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = MobileNetV2ForImageClassification(MobileNetV2Config(num_channels=3, image_size=32, depth_multiplier=0.25,
                                                                num_labels=10))
    model = model.to(memory_format=torch.channels_last)
    ddp = DDP(model)
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3, alpha=0.9, momentum=0.9, eps=1e-3)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.995)
    x_all, y_all = zc.images(1024, size=32, seed=a.seed * 10 + rank)
    for step in range(a.steps):
        i = (step * 16) % 1024
        x = x_all[i:i + 16].contiguous(memory_format=torch.channels_last)
        loss = ddp(pixel_values=x, labels=y_all[i:i + 16]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    zc.done(a.steps)


if __name__ == "__main__":
    main()
