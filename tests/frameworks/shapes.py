"""A BatchNorm CNN trained with DDP, in the shapes real jobs have. Every
option is something users do; none of them is a fault.

    --sync-bn               batch statistics synchronised across ranks (what
                            SyncBatchNorm computes; torch refuses SyncBatchNorm on
                            CPU, so a hand-written one with dist.all_reduce in forward)
    --no-broadcast-buffers  DDP(broadcast_buffers=False): BN stats stay per rank
    --param-groups          one AdamW parameter group per tensor, own lr / weight decay
    --two-optimizers        AdamW on the features, SGD on the head, both stepped
    --compile BACKEND       torch.compile the DDP model ("inductor", "aot_eager")
    --accum K               gradient accumulation over K micro-batches
    --no-sync               ... with DDP.no_sync() on the K-1 first micro-batches
    --scheduler             OneCycleLR (per step) + StepLR (per epoch)
    --eval-every N          an evaluation loop (forwards, no backward) every N steps
    --rank0-extra           rank 0 alone logs, checkpoints with torch.save and runs
                            a slow test episode every few steps; the others wait
                            for it in the next allreduce
"""

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class GlobalBatchNorm(nn.BatchNorm2d):
    """BatchNorm whose batch statistics are averaged over every rank (as
    nn.SyncBatchNorm does; DDP rejects SyncBatchNorm on CPU: "SyncBatchNorm
    layers only work with GPU modules"). Equal-size batches on every rank."""

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        moments = torch.stack([x.mean(dim=(0, 2, 3)), (x * x).mean(dim=(0, 2, 3))])
        moments = dist.nn.functional.all_reduce(moments) / dist.get_world_size()
        mean, var = moments[0], moments[1] - moments[0] ** 2
        with torch.no_grad():
            n = x.numel() / x.shape[1] * dist.get_world_size()
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)
            self.num_batches_tracked += 1
        shape = (1, -1, 1, 1)
        y = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        return y * self.weight.view(shape) + self.bias.view(shape)


def convert_sync_batchnorm(module: nn.Module) -> nn.Module:
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            sync = GlobalBatchNorm(child.num_features)
            sync.load_state_dict(child.state_dict())
            setattr(module, name, sync)
        else:
            convert_sync_batchnorm(child)
    return module


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(2))
        self.head = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=384)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--sync-bn", action="store_true")
    p.add_argument("--no-broadcast-buffers", action="store_true")
    p.add_argument("--param-groups", action="store_true")
    p.add_argument("--two-optimizers", action="store_true")
    p.add_argument("--compile", default="")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--no-sync", action="store_true")
    p.add_argument("--scheduler", action="store_true")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--rank0-extra", action="store_true")
    p.add_argument("--checkpoint-dir", default=".")
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1234)
    images = torch.randn(a.samples, 3, 8, 8, generator=g)
    labels = (images.mean(dim=(1, 2, 3)) * 40).long().clamp(-5, 4) + 5
    data = TensorDataset(images, labels)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=a.batch, sampler=sampler, drop_last=True)
    held_out = TensorDataset(torch.randn(64, 3, 8, 8, generator=g), torch.randint(0, 10, (64,), generator=g))

    net = Net()
    if a.sync_bn:
        net = convert_sync_batchnorm(net)
    model = DDP(net, broadcast_buffers=False) if a.no_broadcast_buffers else DDP(net)
    if a.compile:
        model = torch.compile(model, backend=a.compile)

    if a.two_optimizers:
        optimizers = [torch.optim.AdamW(net.features.parameters(), lr=2e-3, weight_decay=0.01),
                      torch.optim.SGD(net.head.parameters(), lr=0.05, momentum=0.9)]
    elif a.param_groups:
        groups = [{"params": [param], "lr": 1e-3 * (1 + i % 3), "weight_decay": 0.0 if param.ndim == 1 else 0.05}
                  for i, param in enumerate(net.parameters())]
        optimizers = [torch.optim.AdamW(groups, lr=1e-3)]
    else:
        optimizers = [torch.optim.AdamW(net.parameters(), lr=2e-3)]
    steps_per_epoch = len(loader) // a.accum
    per_step, per_epoch = [], []
    if a.scheduler:
        per_step = [torch.optim.lr_scheduler.OneCycleLR(optimizers[0], max_lr=5e-3,
                                                        total_steps=steps_per_epoch * a.epochs)]
        per_epoch = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) for o in optimizers[1:]]

    def evaluate() -> float:
        model.eval()
        correct = 0
        with torch.no_grad():
            for x, y in DataLoader(held_out, batch_size=32):
                correct += (model(x).argmax(1) == y).sum().item()
        model.train()
        return correct / len(held_out)

    step = 0
    loss = torch.zeros(())
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % a.accum == 0
            context = model.no_sync() if (a.no_sync and not last and not a.compile) else torch.enable_grad()
            with context:
                loss = nn.functional.cross_entropy(model(x), y) / a.accum
                loss.backward()
            if not last:
                continue
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            for scheduler in per_step:
                scheduler.step()
            step += 1
            if a.eval_every and step % a.eval_every == 0:
                evaluate()
            if a.rank0_extra and rank == 0 and step % 5 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item() * a.accum:.4f}", flush=True)
                torch.save({"model": net.state_dict(), "optimizers": [o.state_dict() for o in optimizers],
                            "step": step}, os.path.join(a.checkpoint_dir, "checkpoint.pt"))
                # A slow test episode on rank 0 only: the others wait in the next allreduce.
                deadline = time.time() + 1.5
                while time.time() < deadline:
                    evaluate()
        for scheduler in per_epoch:
            scheduler.step()
    accuracy = evaluate()
    if rank == 0:
        print(f"done: {step} steps, final loss {loss.item() * a.accum:.6f}, accuracy {accuracy:.3f}", flush=True)
    # Nothing may hold DDP at destroy_process_group (tests/conftest.py TORCH_TEARDOWN_ABORT);
    # with BatchNorm only a cyclic collection frees it.
    model = loss = None  # noqa: F841
    if a.compile:
        torch._dynamo.reset()  # compiled code and its guards refer to the module
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
