"""One command on a GPU node: does rankwatch name every fault right on NCCL?

    python bench/gpu_acceptance.py                 # a node with 2 or more GPUs
    python bench/gpu_acceptance.py --only hang,nan_grad --wrappers ddp
    python bench/gpu_acceptance.py --dry-run       # what it would run (the default without CUDA)

NO GPU RUN OF THIS SCRIPT HAS BEEN MADE HERE: no GPU is available to this
project. It was written against torch's CUDA/NCCL sources (2.4-2.13), and on
CPU it runs as a dry run that checks its own matrix (every case's script
compiles, every expected verdict is a contract kind, every fault has a
culprit). The first GPU run is the real test; please send its output.

On a node with N >= 2 GPUs it runs, for DDP and for FSDP2 (`fully_shard`),
in float32 and bfloat16, each fault of the matrix on one rank with
`rankwatch run --nproc-per-node N` and the same job with plain `torchrun`:

    hang           the rank sleeps before its backward
    crash          the rank raises
    nan_loss       the rank's batch is NaN (loss non-finite in the forward)
    nan_grad       a gradient hook makes the rank's gradients NaN (loss finite)
    straggler      the rank's GPU sleeps 40 ms per step (torch.cuda._sleep): only device time shows it
    leak           the rank keeps 32 MiB of device memory per step
    oom            the rank allocates more than its GPU has (uncaught)
    oom_caught     a batch-size finder catches the OOM: healthy
    mismatch       the rank issues an extra all_reduce of another size
    healthy        nothing

and prints per case the verdict, the culprit, the time from the fault to
the verdict, plain torchrun's outcome, and for the healthy runs the
overhead ratio per step (median step time watched / plain, interleaved).
The DDP jobs never call torch.cuda.set_device (tensors go to cuda:LOCAL_RANK,
DDP(device_ids=[LOCAL_RANK])): the case that made every rank use GPU 0.
Exit status: 0 when every case got its expected verdict on its culprit
rank (and nothing else), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

CONTRACT_KINDS = {"hang", "collective_mismatch", "crash", "nonfinite", "grad_spike", "weight_divergence",
                  "straggler", "oom", "memory_growth"}


@dataclass(frozen=True)
class Case:
    fault: str
    expected: Optional[str]  # verdict kind, None for a healthy job
    steps: int = 60
    fault_step: int = 10
    hang_timeout: Optional[int] = None


MATRIX = [
    Case("healthy", None),
    Case("hang", "hang", hang_timeout=30),
    Case("crash", "crash"),
    Case("nan_loss", "nonfinite"),
    Case("nan_grad", "nonfinite"),
    Case("straggler", "straggler", steps=80, fault_step=0),
    Case("leak", "memory_growth", steps=120, fault_step=5),
    Case("oom", "oom"),
    Case("oom_caught", None),
    Case("mismatch", "collective_mismatch"),
]
WRAPPERS = ("ddp", "fsdp2")
DTYPES = ("float32", "bfloat16")

JOB = r'''
import math, os, sys, time
import torch
import torch.distributed as dist

WRAPPER, DTYPE, FAULT = os.environ["ACC_WRAPPER"], os.environ["ACC_DTYPE"], os.environ["ACC_FAULT"]
FAULT_RANK, FAULT_STEP, STEPS = int(os.environ["ACC_RANK"]), int(os.environ["ACC_STEP"]), int(os.environ["ACC_STEPS"])
local_rank = int(os.environ["LOCAL_RANK"])
device = torch.device("cuda", local_rank)
dtype = getattr(torch, DTYPE)
if WRAPPER == "fsdp2":
    torch.cuda.set_device(device)  # FSDP2's device mesh wants it; the DDP jobs do without on purpose
dist.init_process_group("nccl")
rank = dist.get_rank()
me = rank == FAULT_RANK


def fault_now(step):
    if me and step == FAULT_STEP:
        print(f"FAULT_AT {time.time():.3f}", flush=True)
        return True
    return False


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 4096),
                            torch.nn.GELU(), torch.nn.Linear(4096, 1024)).to(device=device, dtype=dtype)
if FAULT == "nan_grad" and me:
    state = {"step": -1}
    model[2].weight.register_hook(lambda g: g * float("nan") if state["step"] == FAULT_STEP else g)
if WRAPPER == "ddp":
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(model, device_ids=[local_rank])
else:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
kept = []
times = []
batch = 64
for step in range(STEPS):
    if FAULT == "nan_grad" and me:
        state["step"] = step
        fault_now(step)
    t0 = time.perf_counter()
    x = torch.randn(batch, 1024, device=device, dtype=dtype)
    if FAULT == "nan_loss" and fault_now(step):
        x.fill_(float("nan"))
    if FAULT == "oom" and fault_now(step):
        huge = torch.empty(torch.cuda.get_device_properties(device).total_memory, dtype=torch.uint8, device=device)
    if FAULT == "oom_caught" and me and step == FAULT_STEP:
        size = torch.cuda.get_device_properties(device).total_memory * 4
        while True:  # a batch-size finder
            try:
                probe = torch.empty(size, dtype=torch.uint8, device=device)
                del probe
                break
            except torch.cuda.OutOfMemoryError:
                size //= 2
    loss = model(x).float().pow(2).mean()
    if FAULT == "hang" and fault_now(step):
        time.sleep(3600)
    if FAULT == "crash" and fault_now(step):
        raise RuntimeError(f"acceptance: injected crash on rank {rank}")
    if FAULT == "straggler" and me:
        if step == FAULT_STEP:
            fault_now(step)
        torch.cuda._sleep(int(0.04 * 1.4e9))  # ~40 ms of GPU time at ~1.4 GHz: the host is not slower
    loss.backward()
    if FAULT == "mismatch" and fault_now(step):
        dist.all_reduce(torch.ones(7, device=device))  # an extra collective of another size
    opt.step()
    opt.zero_grad(set_to_none=True)
    if FAULT == "leak" and me and step >= FAULT_STEP:
        if step == FAULT_STEP:
            fault_now(step)
        kept.append(torch.empty(32 << 20, dtype=torch.uint8, device=device))
    if step % 10 == 0 and rank == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)  # the script's own sync, as users write
    torch.cuda.synchronize(device)
    times.append(time.perf_counter() - t0)
if rank == 0:
    print(f"STEP_MEDIAN {sorted(times[5:])[len(times[5:]) // 2]:.6f}", flush=True)
dist.destroy_process_group()
'''


def case_env(case: Case, wrapper: str, dtype: str, fault_rank: int) -> dict[str, str]:
    return {"ACC_WRAPPER": wrapper, "ACC_DTYPE": dtype, "ACC_FAULT": case.fault, "ACC_RANK": str(fault_rank),
            "ACC_STEP": str(case.fault_step), "ACC_STEPS": str(case.steps)}


def run(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, float]:
    started = time.time()
    try:
        proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stdout + proc.stderr, time.time() - started
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return -9, out + f"\n[gpu_acceptance] timed out after {timeout:.0f} s", time.time() - started


def torchrun_outcome(code: int, output: str, seconds: float) -> str:
    if code == -9:
        return f"still running after {seconds:.0f} s (killed)"
    if code == 0:
        return f"exit 0 in {seconds:.0f} s, nothing reported"
    root = re.search(r"rank\s*:\s*(\d+)[^\n]*\n[^\n]*exitcode\s*:\s*(-?\d+)", output)
    lines = [line for line in output.splitlines() if "Error" in line or "error" in line]
    named = f"root cause rank {root.group(1)}" if root else "no rank named"
    return f"exit {code} in {seconds:.0f} s, {named}: {(lines[-1] if lines else '')[:100]}"


def judge(case: Case, fault_rank: int, report: dict, fault_at: Optional[float]) -> tuple[bool, str, str, str]:
    verdicts = report.get("verdicts", [])
    if case.expected is None:
        ok = not verdicts
        got = ", ".join(f"{v['kind']}{v['ranks']}" for v in verdicts) or "healthy"
        return ok, got, "-", "-"
    found = [v for v in verdicts if v["kind"] == case.expected]
    if not found:
        return False, ", ".join(f"{v['kind']}{v['ranks']}" for v in verdicts) or "no verdict", "-", "-"
    v = found[0]
    ok = v["ranks"] == [fault_rank] and len(verdicts) == 1
    seconds = "-"
    if fault_at is not None:
        from datetime import datetime

        detected = datetime.fromisoformat(v["detected_at"].replace("Z", "+00:00")).timestamp()
        seconds = f"{detected - fault_at:.1f} s"
    return ok, f"{v['kind']}{v['ranks']}" + ("" if len(verdicts) == 1 else f" (+{len(verdicts) - 1} more)"), \
        str(v["ranks"]), seconds


def dry_run(cases: list[Case], wrappers: list[str], dtypes: list[str]) -> int:
    """Check the matrix itself: the job compiles, every expected verdict is a
    contract kind, every fault knows its step; print what would run."""
    compile(JOB, "acceptance_job.py", "exec")
    problems = []
    for case in cases:
        if case.expected is not None and case.expected not in CONTRACT_KINDS:
            problems.append(f"{case.fault}: {case.expected} is not a verdict kind of the contract")
        if case.fault not in JOB and case.fault != "healthy":
            problems.append(f"{case.fault}: the job has no such fault")
        if case.fault_step >= case.steps:
            problems.append(f"{case.fault}: fault step {case.fault_step} >= {case.steps} steps")
    print("[gpu_acceptance] dry run (no CUDA here): the matrix that a node with 2+ GPUs runs")
    print(f"{'wrapper':<7} {'dtype':<9} {'fault':<11} {'expected':<20} steps")
    for wrapper in wrappers:
        for dtype in dtypes:
            for case in cases:
                print(f"{wrapper:<7} {dtype:<9} {case.fault:<11} {case.expected or 'no verdict':<20} {case.steps}")
    for problem in problems:
        print(f"[gpu_acceptance] matrix problem: {problem}")
    print(f"[gpu_acceptance] {len(wrappers) * len(dtypes) * len(cases)} cases; "
          f"{'matrix OK' if not problems else 'matrix BROKEN'}")
    return 1 if problems else 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="faults to run, comma separated (default: all)")
    p.add_argument("--wrappers", default=",".join(WRAPPERS))
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--dry-run", action="store_true", help="check and print the matrix without running it")
    p.add_argument("--nproc", type=int, default=0, help="GPUs to use (default: all, at least 2)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    a = p.parse_args(argv)
    only = {f for f in a.only.split(",") if f}
    cases = [c for c in MATRIX if not only or c.fault in only]
    wrappers = [w for w in a.wrappers.split(",") if w]
    dtypes = [d for d in a.dtypes.split(",") if d]
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        gpus = 0
    if a.dry_run or gpus < 2:
        if not a.dry_run:
            print(f"[gpu_acceptance] {gpus} GPU(s) here: a real run needs 2 or more; dry run instead")
        return dry_run(cases, wrappers, dtypes)
    nproc = a.nproc or gpus
    fault_rank = nproc - 1
    misses = 0
    overhead: dict[str, list[float]] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "acceptance_job.py"
        job.write_text(JOB)
        for wrapper in wrappers:
            for dtype in dtypes:
                for case in cases:
                    env = case_env(case, wrapper, dtype, fault_rank)
                    run_dir = Path(tmp) / f"{wrapper}-{dtype}-{case.fault}"
                    watched = [sys.executable, "-m", "rankwatch.cli", "run", "--run-dir", str(run_dir),
                               "--nproc-per-node", str(nproc)]
                    if case.hang_timeout:
                        watched += ["--hang-timeout", str(case.hang_timeout)]
                    code, out, seconds = run(watched + [str(job)], env, a.timeout)
                    try:
                        report = json.loads((run_dir / "report.json").read_text())
                    except (OSError, ValueError):
                        report = {"verdicts": []}
                    fault_at = next((float(m) for m in re.findall(r"FAULT_AT (\S+)", out)), None)
                    ok, got, culprit, to_verdict = judge(case, fault_rank, report, fault_at)
                    plain_cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                                 str(job)]
                    plain_timeout = min(a.timeout, 120.0) if case.fault == "hang" else a.timeout
                    pcode, pout, pseconds = run(plain_cmd, env, plain_timeout)
                    if case.fault == "healthy":
                        w = re.search(r"STEP_MEDIAN (\S+)", out)
                        pl = re.search(r"STEP_MEDIAN (\S+)", pout)
                        if w and pl:
                            overhead.setdefault(f"{wrapper} {dtype}", []).append(float(w.group(1)) / float(pl.group(1)))
                    misses += not ok
                    rows.append((wrapper, dtype, case.fault, case.expected or "no verdict", got, culprit,
                                 to_verdict, torchrun_outcome(pcode, pout, pseconds), "ok" if ok else "MISS"))
                    print("  ".join(str(x) for x in rows[-1]), flush=True)
    print(f"\n{'wrapper':<7} {'dtype':<9} {'fault':<11} {'expected':<20} {'rankwatch':<28} {'culprit':<8} "
          f"{'to verdict':<10} {'plain torchrun':<60} result")
    for r in rows:
        print(f"{r[0]:<7} {r[1]:<9} {r[2]:<11} {r[3]:<20} {r[4]:<28} {r[5]:<8} {r[6]:<10} {r[7]:<60} {r[8]}")
    for key, ratios in overhead.items():
        print(f"overhead per step ({key}, healthy job, watched / plain): {statistics.median(ratios):.3f}")
    print(f"[gpu_acceptance] {len(rows) - misses}/{len(rows)} cases as expected")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
