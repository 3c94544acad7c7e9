"""A long healthy DDP job whose per-rank gradient norms are heavy-tailed: noisy
labels (a quarter of them random), a loss that gets small late in training,
gradient accumulation with no_sync and gradient clipping. No rankwatch
import. With --record FILE each rank also appends its local (pre-allreduce)
gradient norm per optimizer step, measured by the script itself: the
reference series of bench/grad_spike_false_alarms.py.

    rankwatch run --nproc-per-node 4 tests/scripts/noisy_long.py --epochs 40
"""

import argparse
import gc
import json

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--noise", type=float, default=0.1, help="fraction of random labels")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record", default="")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(a.seed)
    g = torch.Generator().manual_seed(1000 + a.seed)
    x = torch.randn(a.samples, 20, generator=g)
    w = torch.randn(20, 5, generator=g)
    y = (x @ w).argmax(1)
    noisy = torch.rand(a.samples, generator=g) < a.noise
    y[noisy] = torch.randint(0, 5, (int(noisy.sum()),), generator=g)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, seed=a.seed)
    loader = DataLoader(data, batch_size=a.batch, sampler=sampler, drop_last=True)
    model = DDP(nn.Sequential(nn.Linear(20, a.hidden), nn.ReLU(), nn.Linear(a.hidden, a.hidden), nn.ReLU(),
                              nn.Linear(a.hidden, 5)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    record = open(f"{a.record}.rank{rank}", "w") if a.record else None
    step = 0
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        for i, (xb, yb) in enumerate(loader):
            last = (i + 1) % a.accum == 0
            ctx = model.no_sync() if not last else torch.enable_grad()
            with ctx:
                loss = nn.functional.cross_entropy(model(xb), yb) / a.accum
                if record is not None and last:
                    # local norm before the allreduce: the gradients of this micro-batch alone
                    local = torch.autograd.grad(loss, list(model.module.parameters()), retain_graph=True)
                    record.write(json.dumps({"step": step, "norm": float(torch.linalg.vector_norm(
                        torch.stack([torch.linalg.vector_norm(t) for t in local])))}) + "\n")
                loss.backward()
            if last:
                torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
        if rank == 0 and epoch % 10 == 0:
            print(f"epoch {epoch} step {step} loss {loss.item() * a.accum:.4f}", flush=True)
    if record is not None:
        record.close()
    print(f"done: {step} steps", flush=True)
    dist.barrier()
    del model  # nothing may hold DDP at destroy_process_group (conftest.TORCH_TEARDOWN_ABORT)
    gc.collect()  # DDP is freed only by a cyclic collection
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
