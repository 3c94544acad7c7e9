"""torchvision's `resnet18` (BatchNorm, bias-free convolutions, its own
initialisation) in a plain DDP loop, as the torchvision classification
reference trains it: SGD with Nesterov momentum, weight decay off for norms
and biases, label smoothing, warmup then cosine; augmentation by
`torchvision.transforms.v2` on the batch. Runs on PyPI's torch build (the
zoo's vision venv, docs/zoo.md)."""

import torch
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision.transforms import v2

import zoocommon as zc


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = torchvision.models.resnet18(num_classes=10)
    ddp = DDP(model)
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 1e-4}, {"params": rest, "weight_decay": 0.0}],
                          lr=0.05, momentum=0.9, nesterov=True)
    warm = min(20, a.steps // 4)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=warm)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, a.steps - warm))
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[warm])
    augment = v2.Compose([v2.RandomHorizontalFlip(), v2.RandomCrop(16, padding=2)])
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    x_all, y_all = zc.images(1024, size=16, seed=a.seed * 10 + rank)  # 16 px: 300 steps in ~1 min on 2 cores
    for step in range(a.steps):
        i = (step * 16) % 1024
        loss = loss_fn(ddp(augment(x_all[i:i + 16])), y_all[i:i + 16])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    zc.done(a.steps)


if __name__ == "__main__":
    main()
