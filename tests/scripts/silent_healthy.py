"""Healthy training jobs in the shapes that look like silent errors but are
not (no rankwatch import). ``--shape`` picks one; each packs several.

    mixed       DDP; rank 0 alone validates (model.eval(), then model.train());
                every rank evaluates every few steps (and restores train());
                a frozen backbone layer, a LoRA-style adapter on a frozen base,
                a param group with lr 0, two optimizers, a per-step and a
                per-epoch scheduler, an EMA copy and a frozen teacher updated
                without gradients, rank-dependent augmentation, dropout,
                DistributedSampler with drop_last=False (a short last batch),
                a small dataset over many epochs
    amp_accum   DDP; a CPU GradScaler whose overflows skip steps (the
                parameters do not move then); no_sync() accumulation over 3
                micro-batches with zero_grad once per optimizer step; clipping
                on every rank
    compiled    torch.compile(DDP(model), backend="aot_eager"); one batch per
                rank per epoch without shuffling (the same batch every epoch:
                full-batch training of each rank's shard)
    hand_dp     no DDP: parameters broadcast from rank 0 at the start,
                gradients all-reduced by hand; an RL-style rollout (no
                DataLoader) reused for 4 optimizer steps, then a new one
"""

import argparse
import copy
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Adapter(nn.Module):
    """LoRA-style: a frozen base linear plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(16, 32)
        self.block = Adapter(nn.Linear(32, 32))
        self.drop = nn.Dropout(0.2)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.norm(self.drop(torch.relu(self.block(torch.relu(self.stem(x)))))))


def data(n: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].argmax(dim=1) + (x[:, 5] > 1.8).long()) % 4  # a few hard (shifted) labels
    return TensorDataset(x, y)


def mixed(rank: int, world: int, steps: int) -> int:
    dataset = data(8 * world * 3 - 5)  # ~3 batches per rank per epoch, the last one short
    sampler = DistributedSampler(dataset, seed=0)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler, drop_last=False)
    net = Net()
    for p in net.stem.parameters():
        p.requires_grad_(False)  # a frozen layer
    model = DDP(net)
    ema = copy.deepcopy(net).eval()
    teacher = copy.deepcopy(net).eval()
    for p in list(ema.parameters()) + list(teacher.parameters()):
        p.requires_grad_(False)
    main = torch.optim.AdamW([
        {"params": [p for n, p in net.named_parameters() if n.startswith("head")], "lr": 3e-3},
        {"params": [p for n, p in net.named_parameters() if n.startswith("norm")], "lr": 0.0},  # lr 0 by design
    ], weight_decay=0.01)
    adapter = torch.optim.SGD(net.block.parameters(), lr=0.02, momentum=0.9)  # frozen base: no grad, skipped
    per_step = torch.optim.lr_scheduler.LambdaLR(main, lambda s: min(1.0, (s + 1) / 5))
    per_epoch = torch.optim.lr_scheduler.StepLR(adapter, step_size=1, gamma=0.8)
    noise = torch.Generator().manual_seed(100 + rank)  # rank-dependent augmentation
    held_out = data(32, seed=9)
    step = epoch = 0
    while step < steps:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            xb = xb + 0.1 * torch.randn(xb.shape, generator=noise)
            with torch.no_grad():
                soft = teacher(xb).softmax(dim=1)
            out = model(xb)
            loss = nn.functional.cross_entropy(out, yb) + 0.1 * nn.functional.kl_div(
                out.log_softmax(dim=1), soft, reduction="batchmean")
            main.zero_grad()
            adapter.zero_grad()
            loss.backward()
            main.step()
            adapter.step()
            per_step.step()
            with torch.no_grad():
                for e, p in zip(ema.parameters(), net.parameters()):
                    e.lerp_(p, 0.1)
            step += 1
            if rank == 0 and step % 4 == 0:  # rank 0 validates alone, then back to training
                model.eval()
                with torch.no_grad():
                    model.module(held_out.tensors[0]).argmax(dim=1)
                model.train()
            if step % 6 == 0:  # every rank evaluates
                net.eval()
                with torch.no_grad():
                    for xv, _ in DataLoader(held_out, batch_size=16):
                        model(xv)
                net.train()
            if step >= steps:
                break
        per_epoch.step()
        epoch += 1
    return step


def amp_accum(rank: int, world: int, steps: int) -> int:
    accum = 3
    dataset = data(8 * world * accum * (steps + 1))
    sampler = DistributedSampler(dataset, seed=1)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=4)
    step = applied = 0
    optimizer.zero_grad()
    for i, (xb, yb) in enumerate(loader):
        last = (i + 1) % accum == 0
        with (model.no_sync() if not last else torch.enable_grad()):
            loss = nn.functional.cross_entropy(model(xb), yb) / accum
            if step % 5 == 4 and last:
                loss = loss * float("inf")  # an fp16-style overflow: the scaler skips this step everywhere
            scaler.scale(loss).backward()
        if not last:
            continue
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        step += 1
        applied += scaler.get_scale() >= before  # an overflow halves the scale: that step was skipped
        if step >= steps:
            break
    return applied  # optimizer steps that ran


def compiled(rank: int, world: int, steps: int) -> int:
    dataset = data(8 * world)  # one batch per rank per epoch
    sampler = DistributedSampler(dataset, shuffle=False)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    model = torch.compile(DDP(Net()), backend="aot_eager")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = 0
    for epoch in range(steps):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            step += 1
    return step


def hand_dp(rank: int, world: int, steps: int) -> int:
    torch.manual_seed(1000 + rank)  # each rank initialises differently ...
    net = Net()
    with torch.no_grad():
        for p in net.parameters():
            dist.broadcast(p, 0)  # ... and takes rank 0's weights
    optimizer = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=1e-3)
    env = torch.Generator().manual_seed(50 + rank)
    step = 0
    while step < steps:
        obs = torch.randn(32, 16, generator=env)  # a rollout, used for 4 updates (PPO-style epochs)
        target = obs[:, :4].argmax(dim=1)
        for _ in range(4):
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(obs), target).backward()
            for p in net.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
            optimizer.step()
            step += 1
    return step


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", required=True, choices=["mixed", "amp_accum", "compiled", "hand_dp"])
    p.add_argument("--steps", type=int, default=24)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    steps = {"mixed": mixed, "amp_accum": amp_accum, "compiled": compiled, "hand_dp": hand_dp}[a.shape](
        rank, world, a.steps)
    if rank == 0:
        print(f"done: {steps} steps", flush=True)
    dist.destroy_process_group()
    assert math.isfinite(steps)


if __name__ == "__main__":
    main()
