"""The agent's added per-step cost of the silent-error checks (training
facts, batch fingerprints, update checks, optimizer fingerprints), as a
ratio against the same job under rankwatch with those checks off
(RANKWATCH_SILENT_CHECKS=0), measured side by side in one run.

    flock /tmp/rankwatch-heavy.lock python bench/silent_checks_cost.py [--sizes 64x2,256x4,1024x4] [--repeats 3]

Runs are interleaved (off, on, off, on, ...) so machine noise hits both
alike; each job prints the median of its steady-state step times (rank 0)
and the ratio is on / off of the medians of those. The job is an ordinary
DDP classifier: a DataLoader with a DistributedSampler, AdamW with one
param group per tensor (the digest reads every group), a per-step
scheduler, dropout, an evaluation pass every 20 steps (model.eval() /
model.train()), gradient clipping: every part of the checks has work to do.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import side_by_side  # noqa: E402


def job(width: int, layers: int, steps: int, warmup: int, batch: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    if not dist.is_initialized(): dist.init_process_group("gloo")
    torch.manual_seed(0)
    blocks = [torch.nn.Linear(32, width), torch.nn.ReLU()]
    for _ in range(layers - 1):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Dropout(0.1)]
    blocks.append(torch.nn.Linear(width, 10))
    model = DDP(torch.nn.Sequential(*blocks))
    groups = [{"params": [p], "lr": 1e-3} for p in model.parameters()]
    opt = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.001 * s))
    g = torch.Generator().manual_seed(1)
    total = batch * dist.get_world_size() * (steps + warmup + 8)
    data = TensorDataset(torch.randn(total, 32, generator=g), torch.randint(0, 10, (total,), generator=g))
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=batch, sampler=sampler)
    times = []
    it = iter(loader)
    for step in range(steps + warmup):
        t0 = time.perf_counter()
        x, y = next(it)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        opt.step()
        sched.step()
        if step % 20 == 19:
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"STEP_MEDIAN {statistics.median(times):.7f} PARAMS {params}", flush=True)
    dist.destroy_process_group()


def run(checks: bool, width: int, layers: int, steps: int, nproc: int, run_dir: Path) -> tuple[float, int]:
    cmd = [*side_by_side.launcher(True, run_dir), "--standalone", "--nproc-per-node", str(nproc), str(HERE), "--job",
           "--width", str(width), "--layers", str(layers), "--steps", str(steps)]
    env = side_by_side.job_env(RANKWATCH_SILENT_CHECKS="1" if checks else "0")
    median, params = side_by_side.figures(cmd, env, r"STEP_MEDIAN (\S+) PARAMS (\d+)", f"checks {'on' if checks else 'off'}")
    return float(median), int(params)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--sizes", default="64x2,256x4,1024x4", help="WIDTHxLAYERS, comma separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--nproc", type=int, default=2)
    a = p.parse_args()
    if a.job:
        job(a.width, a.layers, a.steps, a.warmup, a.batch)
        return
    print(f"{'model':>10} {'params':>9} {'checks off ms':>14} {'checks on ms':>13} {'ratio':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for size in a.sizes.split(","):
            width, layers = (int(v) for v in size.split("x"))
            off, on = side_by_side.interleaved(
                a.repeats,
                lambda i: run(False, width, layers, a.steps, a.nproc, Path(tmp) / f"off{size}{i}"),
                lambda i: run(True, width, layers, a.steps, a.nproc, Path(tmp) / f"on{size}{i}"))
            params = off[0][1]
            off, on = [t for t, _ in off], [t for t, _ in on]
            o, n = statistics.median(off), statistics.median(on)
            print(f"{size:>10} {params:>9} {o * 1e3:>14.3f} {n * 1e3:>13.3f} {n / o:>7.3f}", flush=True)


if __name__ == "__main__":
    main()
