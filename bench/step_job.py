"""The benchmark's training job: plain DDP (no rankwatch import), prints the
steady-state mean step time of rank 0. ``--compile``: the model under
torch.compile (the warm-up steps include the compilation)."""

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--compile", action="store_true", help="torch.compile the DDP model (DDP's optimizer: graphs split at buckets)")
    a = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    layers = []
    for _ in range(a.layers):
        layers += [torch.nn.Linear(a.width, a.width), torch.nn.ReLU()]
    model = DDP(torch.nn.Sequential(*layers))
    if a.compile:
        model = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(a.batch, a.width)
    times = []
    for step in range(a.steps + a.warmup):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        times.sort()
        print(f"STEP_TIME {sum(times) / len(times):.6f} MEDIAN {times[len(times) // 2]:.6f} PARAMS {params}", flush=True)
    # Nothing may hold DDP at destroy_process_group: torch 2.13's gloo teardown
    # aborts otherwise now and then (a bench run of plain torchrun died of it).
    del model, opt
    import gc

    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
