"""Hugging Face `ResNetForImageClassification` (tiny config: BatchNorm,
convolutions without bias, residual stages), DDP, SGD with momentum and
weight decay excluded from BatchNorm and biases, warmup then cosine.
torchvision's ResNet needs PyPI's torch build (see docs/zoo.md); this is the
same architecture from the transformers library."""

import itertools

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import ResNetConfig, ResNetForImageClassification, get_cosine_schedule_with_warmup

import zoocommon as zc


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = ResNetForImageClassification(ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32],
                                                      depths=[1, 1], layer_type="basic", num_labels=10))
    ddp = DDP(model)
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 1e-4}, {"params": rest, "weight_decay": 0.0}],
                          lr=0.05, momentum=0.9)
    sched = get_cosine_schedule_with_warmup(opt, 20, a.steps)
    x_all, y_all = zc.images(2048, size=32, seed=a.seed * 10 + rank)
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
