"""Hugging Face `ConvNextForImageClassification` (tiny config: LayerNorm,
depthwise 7x7 convolutions, layer scale, stochastic depth with
drop_path_rate 0.2), DDP, AdamW, OneCycle. timm's ConvNeXt needs torchvision
(PyPI's torch build, see docs/zoo.md)."""

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import ConvNextConfig, ConvNextForImageClassification

import zoocommon as zc


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = ConvNextForImageClassification(ConvNextConfig(num_channels=3, patch_size=2, hidden_sizes=[16, 32],
                                                          depths=[1, 1], num_stages=2, drop_path_rate=0.2, num_labels=10,
                                                          image_size=16))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=a.steps)
    x_all, y_all = zc.images(2048, size=16, seed=a.seed * 10 + rank)
    for step in range(a.steps):
        i = (step * 16) % 2048
        loss = ddp(pixel_values=x_all[i:i + 16], labels=y_all[i:i + 16]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    zc.done(a.steps)


if __name__ == "__main__":
    main()
