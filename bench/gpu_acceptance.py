"""One command on a GPU node: does rankwatch name every fault right on NCCL?

    python bench/gpu_acceptance.py                 # a node with 2 or more GPUs
    python bench/gpu_acceptance.py --only hang,nan_grad --wrappers ddp
    python bench/gpu_acceptance.py --dry-run       # check the matrix and print what it would run

It was written against torch's CUDA/NCCL sources (2.4-2.13). Five GPU
sessions have run it, each on one H200 or H100 with torch 2.11.0+cu130, so
world size 1 (``--nproc 1 --dtypes bfloat16 --plain healthy --timeout 90``):

- 2026-11-26 (DDP only): the healthy job got no verdict, no sync more than
  plain torchrun and one process on the GPU; a NaN gradient was named; a
  rank asleep was named as hung but not ended (CUDA's pollers' wake-ups;
  fixed in agent/core/activity.py), and this script stalled on the
  survivors of that killed case (fixed: see run()).
- 2026-11-27 (Linux 6.18 Firecracker): DDP healthy, crash, nan_loss,
  nan_grad, leak, oom and oom_caught, and FSDP2 healthy, hang, nan_grad,
  leak and oom: each as expected on rank 0, crash named 1.9 s after the
  fault, nan/leak/oom in 0.3-1.0 s, the healthy jobs with no sync added
  and one process on the GPU. The DDP hang was named but not ended within
  90 s in one run of two: CUDA's event-handler thread used 0.8 ms of CPU a
  second, 80 % of the idle bound by itself (the other run was judged idle
  at 29.1 of 30.1 ms). CUDA's threads are machinery now; three reruns
  ended at 33 s with 0-5 ms in 30 s. A hang at world size 1 is named at
  the hang timeout (30 s here): no peer's evidence comes sooner. Median
  device time per step of the healthy job (a 3-layer MLP, host-bound):
  DDP 4.36 ms watched vs 2.08 ms plain, FSDP2 7.61 vs 6.18 ms: rankwatch's
  fixed cost per step is ~1.4-2.3 ms of host time there, over the 1 %
  budget for steps under ~0.2 s.
- 2026-11-27, later (``--only healthy,nan_grad``, float32 and bfloat16):
  8/8 as expected, float32 for the first time on a GPU; nan_grad named in
  0.4-0.9 s; the healthy jobs with no sync added. Median device time per
  step, watched vs plain: DDP float32 4.04 vs 2.13 ms, bfloat16 5.14 vs
  1.88; FSDP2 float32 10.61 vs 6.21, bfloat16 9.05 vs 6.24 (the same fixed
  host cost per step as above).
- 2026-11-28, one H100 80GB (torch 2.11.0+cu130, ``--dtypes bfloat16``):
  16/16 as expected (DDP and FSDP2: hang named at 31.2-31.4 s with the
  30-s timeout, crash 1.3-2.4 s, nan 0.5-1.3 s, leak 1.0-1.1 s, oom
  0.1-0.3 s; healthy and oom_caught without a verdict, no sync added, one
  process on the GPU). Median device time per step, watched vs plain: DDP
  5.52 vs 2.03 ms, FSDP2 10.71 vs 7.66. A cProfile of the watched DDP step
  put 0.45 ms a step in torch's flattening of the allocator's statistics
  (read as the nested dict since); host time per step of that job, plain
  vs watched, after the change (on an H200, the machine the next call got):
  2.87 vs 4.81 and 2.39 vs 5.23 ms, against 3.01 vs 6.85 and 2.65 vs 6.14
  on the H100 before it.
- 2026-11-28, later, one H200 (torch 2.11.0+cu130, ``--dtypes bfloat16``):
  16/16 as expected, every verdict on rank 0 (DDP and FSDP2: hang named at
  31.1-31.3 s with the 30-s timeout, crash 1.2-1.9 s, nan 0.5-0.7 s, leak
  0.7-0.9 s, oom 0.3-0.5 s; healthy and oom_caught without a verdict).
  Median device time per step, watched vs plain: DDP 4.55 vs 2.58 ms,
  FSDP2 10.81 vs 7.36 (the same fixed host cost per step as above).
- 2026-11-28, evening, one H200 (torch 2.11.0+cu130, ``--dtypes bfloat16``):
  16/16 as expected, every verdict on rank 0 (hang 31.2 s with the 30-s
  timeout, crash 1.0-2.3 s, nan 0.5-1.2 s, leak 1.1-1.2 s, oom 0.1-0.2 s).
  Median step, watched vs plain: DDP 4.52 vs 2.43 ms, FSDP2 11.45 vs 7.42.
  bench/gpu_step_profile.py then put the watched step's four copies to the
  host at ~0.2 ms of host time each (a pinned allocation, a copy, an event,
  a current-stream lookup); a step's reads now go as one copy
  (DeferredReads.flush). After it (``--only healthy,nan_grad``): 4/4, no
  sync added; DDP 4.68 vs 2.75 ms (within the run-to-run spread of the
  added ~2 ms), FSDP2 8.45 vs 6.60.

The two-rank cases (straggler, mismatch, FSDP2 across GPUs) have never run
on GPUs. On CPU, ``--dry-run`` checks its own matrix (the job
compiles, every expected verdict is a contract kind, every fault has a
culprit, and the FSDP2 nan_grad fault fires: the job runs on 2 CPU ranks for
that). Without ``--dry-run`` on a node with fewer GPUs than ``--nproc`` it
says so and exits 2 (nothing was checked). Please send the output of a run
on a node of 2 or more GPUs.

What it checks beyond verdicts, for the healthy jobs: the job makes no
synchronize and no ``.item()`` of its own and runs its steps under
``torch.cuda.set_sync_debug_mode("warn")`` (every synchronizing call counted,
from any thread, with its stack): any sync more under rankwatch than under
plain torchrun is a miss. While every rank is alive, the job counts the
compute processes per GPU (NVML, else ``nvidia-smi``): more than one on a
GPU (a rank with a context on GPU 0) is a miss. Step time is device time
between CUDA events at each step's start (no host sync per step). Every
launcher runs in a session of its own; at its timeout and after it ends
every process of the case (found by a token in its environment: torchrun's
workers run in sessions of their own) is killed (a hung job's workers would
otherwise spin in NCCL through the later cases).

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
import signal
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
    Case("straggler", "straggler", steps=200, fault_step=0),  # a slow rank is persistent after 5 s
    Case("leak", "memory_growth", steps=120, fault_step=5),
    Case("oom", "oom"),
    Case("oom_caught", None),
    Case("mismatch", "collective_mismatch"),
]
WRAPPERS = ("ddp", "fsdp2")
# A straggler is slow relative to its peers; a mismatch is between ranks.
NEEDS_A_PEER = ("straggler", "mismatch")
DTYPES = ("float32", "bfloat16")

JOB = r'''
import json, math, os, sys, time, traceback, warnings
import torch
import torch.distributed as dist

WRAPPER, DTYPE, FAULT = os.environ["ACC_WRAPPER"], os.environ["ACC_DTYPE"], os.environ["ACC_FAULT"]
FAULT_RANK, FAULT_STEP, STEPS = int(os.environ["ACC_RANK"]), int(os.environ["ACC_STEP"]), int(os.environ["ACC_STEPS"])
ON_CPU = os.environ.get("ACC_DEVICE") == "cpu"  # the dry run's own check of the job (gloo, small)
WIDTH = 64 if ON_CPU else 4096
local_rank = int(os.environ["LOCAL_RANK"])
device = torch.device("cpu") if ON_CPU else torch.device("cuda", local_rank)
dtype = getattr(torch, DTYPE)
if WRAPPER == "fsdp2" and not ON_CPU:
    torch.cuda.set_device(device)  # FSDP2's device mesh wants it; the DDP jobs do without on purpose
dist.init_process_group("gloo" if ON_CPU else "nccl")
rank = dist.get_rank()
me = rank == FAULT_RANK


def fault_now(step):
    if me and step == FAULT_STEP:
        print(f"FAULT_AT {time.time():.3f}", flush=True)
        return True
    return False


def gpu_processes(pids):
    """{gpu index: {"all": compute processes on it, "job": those of this job}}:
    NVML (pynvml) if installed, else nvidia-smi."""
    out = {}
    try:
        import pynvml
        pynvml.nvmlInit()
        for i in range(pynvml.nvmlDeviceGetCount()):
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i))
            out[str(i)] = {"all": len(procs), "job": sum(p.pid in pids for p in procs)}
        return out
    except Exception:
        out = {}
    import subprocess
    try:
        query = lambda what: subprocess.run(["nvidia-smi", what, "--format=csv,noheader"], capture_output=True,
                                            text=True, timeout=30).stdout
        gpus, apps = query("--query-gpu=index,gpu_uuid"), query("--query-compute-apps=pid,gpu_uuid")
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    index = {}
    for line in gpus.splitlines():
        i, uuid = [p.strip() for p in line.split(",")[:2]]
        index[uuid] = i
        out[i] = {"all": 0, "job": 0}
    for line in apps.splitlines():
        pid, uuid = [p.strip() for p in line.split(",")[:2]]
        if uuid in index and pid.isdigit():
            out[index[uuid]]["all"] += 1
            out[index[uuid]]["job"] += int(pid) in pids
    return out


# Every synchronizing CUDA call during the steps (torch.cuda.set_sync_debug_mode("warn")),
# from any thread, with the line that made it: the job itself makes none.
SYNCS = []
_show = warnings.showwarning


def _count_syncs(message, category, filename, lineno, file=None, line=None):
    if "synchronizing" in str(message):
        SYNCS.append("".join(traceback.format_stack(limit=8)[:-1]))
        return
    _show(message, category, filename, lineno, file, line)


warnings.showwarning = _count_syncs
warnings.filterwarnings("always", message=".*synchronizing.*")

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(WIDTH // 4, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, WIDTH),
                            torch.nn.GELU(), torch.nn.Linear(WIDTH, WIDTH // 4)).to(device=device, dtype=dtype)
if WRAPPER == "ddp":
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(model, device_ids=None if ON_CPU else [local_rank])
    layers = model.module
else:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu" if ON_CPU else "cuda", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    layers = model
state = {"step": -1}
if FAULT == "nan_grad" and me:
    # Registered after the wrapper: fully_shard replaces the parameters (a hook on
    # the old ones never fires), so the NaN enters the backward at layer 2's output
    # (the gradients of layers 2 and 0 are NaN on this rank; the loss stays finite).
    def poison(grad):
        if state["step"] == FAULT_STEP:
            print("FAULT_FIRED", flush=True)
            return grad * float("nan")
        return grad

    layers[2].register_forward_hook(lambda module, args, out: out.register_hook(poison) and None)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
kept = []
batch = 64
starts = []
for step in range(STEPS):
    if not ON_CPU and step == 2:  # after set-up (DDP's and NCCL's own start-up syncs)
        torch.cuda.set_sync_debug_mode("warn")
    state["step"] = step
    if FAULT == "nan_grad":
        fault_now(step)
    if not ON_CPU:
        starts.append(torch.cuda.Event(enable_timing=True))
        starts[-1].record()
    x = torch.randn(batch, WIDTH // 4, device=device, dtype=dtype)
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
    # No device sync and no scalar read of its own: every deferred read of
    # rankwatch's must complete by itself, and any sync it adds is counted.
if not ON_CPU:
    torch.cuda.set_sync_debug_mode(0)
    starts.append(torch.cuda.Event(enable_timing=True))
    starts[-1].record()
    torch.cuda.synchronize(device)
    times = [a.elapsed_time(b) / 1000.0 for a, b in zip(starts[5:], starts[6:])]  # device time per step
    print(f"SYNCS rank {rank} {len(SYNCS)}", flush=True)
    for stack in SYNCS[:3]:
        print(f"SYNC_AT rank {rank}\n{stack}", flush=True)
    if rank == 0:
        print(f"STEP_MEDIAN {sorted(times)[len(times) // 2]:.6f}", flush=True)
    # One process per GPU: each rank's context only on its own GPU (a rank that
    # touches GPU 0 by mistake shows as a second process there). Files, not a
    # collective: an object collective would itself use the current device (0).
    pid_dir = os.environ.get("ACC_PID_DIR")
    if pid_dir:
        with open(os.path.join(pid_dir, f"rank{rank}"), "w") as f:
            f.write(str(os.getpid()))
        world = dist.get_world_size()
        deadline = time.time() + 60
        if rank == 0:
            while len([n for n in os.listdir(pid_dir) if n.startswith("rank")]) < world and time.time() < deadline:
                time.sleep(0.1)
            pids = {int(open(os.path.join(pid_dir, f"rank{r}")).read()) for r in range(world)
                    if os.path.exists(os.path.join(pid_dir, f"rank{r}"))}
            print("GPU_PROCS " + json.dumps(gpu_processes(pids)), flush=True)
            open(os.path.join(pid_dir, "checked"), "w").close()
        while not os.path.exists(os.path.join(pid_dir, "checked")) and time.time() < deadline:
            time.sleep(0.1)
# Nothing may hold the model at destroy_process_group: on gloo (the dry run's
# CPU check) torch 2.13 aborts at teardown otherwise ("terminate called without
# an active exception", 2 of 6 runs of the FSDP2 nan_grad check here).
del model, layers, opt
import gc
gc.collect()
dist.destroy_process_group()
'''


def case_env(case: Case, wrapper: str, dtype: str, fault_rank: int) -> dict[str, str]:
    return {"ACC_WRAPPER": wrapper, "ACC_DTYPE": dtype, "ACC_FAULT": case.fault, "ACC_RANK": str(fault_rank),
            "ACC_STEP": str(case.fault_step), "ACC_STEPS": str(case.steps)}


def run(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, float]:
    """Run a launcher in a session of its own; past ``timeout`` kill it and
    every process it started, and in any case leave nothing of it running.
    Its process group is not enough: torch's elastic agent starts each
    worker in a session of its own, so a killed launcher's workers (a hung
    rank spinning in NCCL) survived it, held the output pipe open and
    stalled this script (the first run on an H200). Every process of the
    case carries a token in its environment, and is found by it."""
    token = f"{os.getpid()}-{time.monotonic_ns()}"
    started = time.time()
    with tempfile.TemporaryFile("w+") as output:
        proc = subprocess.Popen(cmd, env={**os.environ, **env, "ACC_CASE_TOKEN": token}, stdout=output,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
            note = ""
        except subprocess.TimeoutExpired:
            code = -9
            note = f"\n[gpu_acceptance] timed out after {timeout:.0f} s (the launcher and its workers killed)"
        _kill_case(proc.pid, token)
        proc.wait()
        output.seek(0)
        return code, output.read() + note, time.time() - started


def _kill_case(pgid: int, token: str) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    marker = f"ACC_CASE_TOKEN={token}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                found = marker in f.read().split(b"\0")
        except OSError:
            continue
        if found:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def judge_syncs(watched_output: str, plain_output: str) -> Optional[str]:
    """The healthy job's synchronizing calls (SYNCS lines, one per rank):
    any more under rankwatch than without it is a sync rankwatch added."""
    def total(output: str) -> Optional[int]:
        found = re.findall(r"SYNCS rank \d+ (\d+)", output)
        return sum(int(n) for n in found) if found else None

    watched, plain = total(watched_output), total(plain_output)
    if watched is None:
        return "sync count missing (the job did not finish its steps)"
    if watched > (plain or 0):
        where = re.findall(r"SYNC_AT rank \d+\n(.*?)(?=\nSYNC|\nSTEP_MEDIAN|\Z)", watched_output, re.S)
        return f"rankwatch added {watched - (plain or 0)} synchronizing call(s); first at:\n" + (where[0] if where else "?")
    return None


def judge_gpu_processes(output: str, nproc: int) -> Optional[str]:
    """One process per GPU (the GPU_PROCS line the job printed while every
    rank was alive): a rank with a context on another GPU (GPU 0, through
    an event or a summary of the current device) shows as a second process
    there. The job's own PIDs are used when the GPU driver reports them (in
    a PID namespace it may not; then every compute process counts)."""
    found = re.search(r"GPU_PROCS (\{.*\})", output)
    if not found:
        return "GPU processes not checked (no GPU_PROCS line)"
    procs = json.loads(found.group(1))
    if "error" in procs:
        return f"GPU processes not checked: {procs['error']}"
    key = "job" if any(v.get("job") for v in procs.values()) else "all"
    crowded = {gpu: v[key] for gpu, v in procs.items() if v[key] > 1}
    used = sum(v[key] for v in procs.values())
    if crowded:
        return f"more than one process on GPU(s) {crowded} ({key} processes): a rank created a context off its device"
    if key == "job" and used != nproc:
        return f"{used} of the job's {nproc} processes on the GPUs"
    return None


def torchrun_outcome(code: Optional[int], output: str, seconds: float) -> str:
    if code is None:
        return "not run (--plain)"
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


def _nan_grad_fires_under_fsdp2() -> Optional[str]:
    """Run the job itself on CPU (gloo, 2 ranks, a small model) with FSDP2
    and the nan_grad fault: the fault must fire (a hook registered before
    fully_shard replaced the parameters never did)."""
    import tempfile as _tempfile

    with _tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "acceptance_job.py"
        job.write_text(JOB)
        env = {**case_env(Case("nan_grad", "nonfinite", steps=6, fault_step=3), "fsdp2", "float32", 1),
               "ACC_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), str(job)]
        code, out, _ = run(cmd, env, 180.0)
    if code != 0:
        return f"nan_grad on CPU: the job failed (exit {code}): {out[-1500:]}"
    if "FAULT_FIRED" not in out:
        return "nan_grad: the injected NaN never fired under fully_shard"
    return None


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    if any(c.fault == "nan_grad" for c in cases) and "fsdp2" in wrappers:
        problem = _nan_grad_fires_under_fsdp2()
        if problem:
            problems.append(problem)
        else:
            print("[gpu_acceptance] nan_grad fires on the parameters fully_shard creates (2 CPU ranks, gloo)")
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
    p.add_argument("--nproc", type=int, default=0,
                   help="GPUs to use (default: all). One GPU runs world size 1: the cases that need a peer "
                        "(straggler, mismatch) are left out and said so")
    p.add_argument("--plain", choices=("all", "healthy", "none"), default="all",
                   help="which cases also run under plain torchrun (healthy: only the sync/overhead baseline)")
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
    if a.dry_run:
        return dry_run(cases, wrappers, dtypes)
    needed = max(1, a.nproc)
    if gpus < needed:
        print(f"[gpu_acceptance] {gpus} GPU(s) here: the matrix needs {needed}; nothing was run "
              f"(--dry-run checks the matrix without GPUs)")
        return 2
    nproc = a.nproc or gpus
    if nproc == 1:
        peerless = [c.fault for c in cases if c.fault in NEEDS_A_PEER]
        if peerless:
            print(f"[gpu_acceptance] one GPU: world size 1; left out (they need a peer): {', '.join(peerless)}")
        cases = [c for c in cases if c.fault not in NEEDS_A_PEER]
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
                    if case.fault == "healthy":
                        env["ACC_PID_DIR"] = str(Path(tmp) / f"pids-{wrapper}-{dtype}-watched")
                        os.makedirs(env["ACC_PID_DIR"])
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
                    if case.fault == "healthy":
                        env["ACC_PID_DIR"] = str(Path(tmp) / f"pids-{wrapper}-{dtype}-plain")
                        os.makedirs(env["ACC_PID_DIR"])
                    if a.plain == "all" or (a.plain == "healthy" and case.fault == "healthy"):
                        pcode, pout, pseconds = run(plain_cmd, env, plain_timeout)
                    else:
                        pcode, pout, pseconds = None, "", 0.0
                    if case.fault == "healthy":
                        # No sync and one process per GPU: what rankwatch adds is a miss.
                        for problem in (judge_syncs(out, pout), judge_gpu_processes(out, nproc)):
                            if problem is not None:
                                ok = False
                                got += f"; {problem}"
                                print(f"[gpu_acceptance] {wrapper} {dtype} healthy: {problem}", flush=True)
                        plain_procs = judge_gpu_processes(pout, nproc)
                        if plain_procs is not None:
                            print(f"[gpu_acceptance] plain torchrun, {wrapper} {dtype}: {plain_procs}", flush=True)
                        w = re.search(r"STEP_MEDIAN (\S+)", out)
                        pl = re.search(r"STEP_MEDIAN (\S+)", pout)
                        if w and pl:
                            overhead.setdefault(f"{wrapper} {dtype}", []).append(float(w.group(1)) / float(pl.group(1)))
                            # The ratio of a tiny step says little alone: the absolute time added is what a
                            # real job's step (tens of ms) pays.
                            print(f"[gpu_acceptance] {wrapper} {dtype} healthy: median step "
                                  f"{float(w.group(1)) * 1e3:.3f} ms watched, {float(pl.group(1)) * 1e3:.3f} ms plain",
                                  flush=True)
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
