"""A plain DDP training script (no rankwatch import) with optional faults.

    rankwatch run --nproc-per-node 4 examples/train.py --steps 30
    rankwatch run --nproc-per-node 4 examples/train.py --fault hang --fault-rank 2 --fault-step 10

Faults are injected the way real bugs happen, on one rank only.
"""

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


class Synthetic(Dataset):
    def __init__(self, n, dim, seed, hang_at=None):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randn(n, 1, generator=g)
        self.hang_at = hang_at

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.hang_at is not None and i == self.hang_at:
            time.sleep(3600)  # a stuck read inside a DataLoader worker
        return self.x[i], self.y[i]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--step-time", type=float, default=0.0, help="extra sleep per step (all ranks)")
    p.add_argument("--accum", type=int, default=1, help="gradient accumulation micro-batches")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--fault", default="none")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=5)
    p.add_argument("--fault-size", type=int, default=0)
    p.add_argument("--scaler", action="store_true", help="AMP GradScaler with an overflow every --overflow-every steps")
    p.add_argument("--overflow-every", type=int, default=0)
    p.add_argument("--warmup", type=int, default=0, help="linear lr warm-up steps")
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(a.seed)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(a.dim, a.hidden), torch.nn.ReLU(),
                                    torch.nn.Linear(a.hidden, a.hidden), torch.nn.ReLU(),
                                    torch.nn.Linear(a.hidden, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / a.warmup)) if a.warmup else None
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if a.scaler else None
    is_faulty = rank == a.fault_rank
    hang_at = None
    if a.fault == "dataloader_hang" and is_faulty:
        hang_at = a.fault_step * a.batch * a.accum
    data = Synthetic(a.batch * a.accum * (a.steps + 1), a.dim, seed=a.seed * 100 + rank, hang_at=hang_at)
    loader = DataLoader(data, batch_size=a.batch, num_workers=a.workers, shuffle=False)
    it = iter(loader)
    leak = []
    for step in range(a.steps):
        if a.fault == "slow" and is_faulty and step >= a.fault_step:
            time.sleep(a.fault_size / 1000 if a.fault_size else 0.2)  # a slow data pipeline or a throttled device
        if a.fault == "leak" and is_faulty and step >= a.fault_step:
            leak.append(torch.ones((a.fault_size or 20) * 262144))  # keeps (fault-size) MB a step alive
        if a.fault == "oom" and is_faulty and step == a.fault_step:
            torch.empty(1 << 50)  # an allocation the host cannot satisfy
        if a.fault == "leave_loop" and is_faulty and step == a.fault_step:
            dist.barrier()  # leaves the loop early and waits at the end-of-training barrier
            break
        opt.zero_grad()
        for micro in range(a.accum):
            x, y = next(it)
            if a.fault == "nan" and is_faulty and step == a.fault_step:
                x = x.clone()
                x[0, 0] = float("nan")
            if a.fault == "spike" and is_faulty and step == a.fault_step:
                x, y = x * 1e4, y * 1e4  # one bad batch on one rank
            ctx = model.no_sync() if micro < a.accum - 1 else torch.enable_grad()
            with ctx:
                loss = torch.nn.functional.mse_loss(model(x), y)
                if a.fault == "hang" and is_faulty and step == a.fault_step:
                    time.sleep(3600)  # stuck in compute before the backward
                if a.fault == "crash" and is_faulty and step == a.fault_step:
                    raise RuntimeError("injected failure: bad batch")
                if a.fault == "sigkill" and is_faulty and step == a.fault_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                if scaler is not None:
                    if a.overflow_every and step % a.overflow_every == a.overflow_every - 1 and rank == 0:
                        loss = loss * float("inf")  # what an fp16 overflow looks like to the scaler
                    scaler.scale(loss).backward()
                else:
                    loss.backward()
        if a.fault.startswith("extra_") and is_faulty and step == a.fault_step:
            size = a.fault_size or (8 if a.fault == "extra_small" else 1_000_000)
            dist.all_reduce(torch.ones(size))  # a collective only this rank issues
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if sched is not None:
            sched.step()
        if a.fault == "perturb" and is_faulty and step == a.fault_step:
            with torch.no_grad():  # a replica's weights change outside the training (e.g. bit flip)
                next(model.parameters()).add_(torch.randn_like(next(model.parameters())) * 0.01)
        if a.step_time:
            time.sleep(a.step_time)
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    if a.fault != "leave_loop":
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
