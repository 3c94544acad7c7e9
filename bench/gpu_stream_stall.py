"""One GPU: is a compute stream's device-side wait on another stream taken
out of a step's own time (``compute_s``), and own device work kept in it?

    python bench/gpu_stream_stall.py [--sleep-ms 20] [--steps 150]   # from outside the repo root

On a GPU a rank stalled behind a slower peer does not block its host: its
compute stream waits on an event (FSDP2's all-gathers and reduce-scatters).
agent/watch/stream_waits.py times such waits and progress subtracts them.
A straggler needs two GPUs to show; this shows the mechanism on one. The
same DDP job (world size 1, a 4-layer bf16 MLP) runs under ``rankwatch run``
three times:

    none    nothing added
    own     the compute stream sleeps SLEEP ms per step (torch.cuda._sleep): the rank's own work
    stall   a side stream sleeps SLEEP ms per step and the compute stream waits on it
            (``torch.cuda.current_stream().wait_event``), inside the forward

and prints, per mode, the device step time (events at each step's start,
read after the steps), rankwatch's median ``compute_s`` from the run's
records, and the synchronizing calls counted under
``torch.cuda.set_sync_debug_mode("warn")`` during the steps. Expected:
``stall``'s ``compute_s`` is ``none``'s (within SLEEP/4) while its device
step is SLEEP longer; ``own``'s ``compute_s`` is at least ``none``'s plus
SLEEP/2; no verdict; the syncs are the same in every mode (rankwatch adds
none). Exit 0 when all hold, 1 when one does not, 2 without a GPU.

Ran on one H200 (torch 2.11.0+cu130, 2026-11-27), SLEEP 20 ms, 150 steps,
twice (a first version of this job, then this file), none / own / stall:
device step 3.56 / 20.13 / 19.08 ms and 4.58 / 19.97 / 18.89 ms;
compute_s median 2.94 / 21.08 / 2.97 ms and 3.77 / 21.24 / 3.23 ms; 1 sync
in every mode (the job's or DDP's own, the same with and without the
stall); no verdict. (The fast ``none`` steps are thinned by the agent's
record sampling: fewer records.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

JOB = r'''
import os, statistics, traceback, warnings
import torch, torch.distributed as dist

MODE, SLEEP_MS, STEPS = os.environ["STALL_MODE"], float(os.environ["STALL_SLEEP_MS"]), int(os.environ["STALL_STEPS"])
dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(dev)
dist.init_process_group("nccl")
W, B = 4096, 2048
model = torch.nn.Sequential(*[torch.nn.Linear(W, W) for _ in range(4)]).to(dev, torch.bfloat16)
model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index])
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
a.record(); torch.cuda._sleep(10_000_000); b.record(); b.synchronize()  # calibrate, before the steps
cycles = int(10_000_000 * SLEEP_MS / a.elapsed_time(b))
side = torch.cuda.Stream()


def pre(module, inputs):
    if MODE == "stall":
        with torch.cuda.stream(side):
            torch.cuda._sleep(cycles)
            ready = torch.cuda.Event()
            ready.record(side)
        torch.cuda.current_stream().wait_event(ready)
    elif MODE == "own":
        torch.cuda._sleep(cycles)


model.module[1].register_forward_pre_hook(pre)
SYNCS = []
_show = warnings.showwarning


def _count(message, category, filename, lineno, file=None, line=None):
    if "synchroniz" in str(message):
        SYNCS.append(1)
        return
    _show(message, category, filename, lineno, file, line)


warnings.showwarning = _count
warnings.filterwarnings("always", message=".*synchroniz.*")
x = torch.randn(B, W, device=dev, dtype=torch.bfloat16)
marks = []
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("warn")
for step in range(STEPS):
    mark = torch.cuda.Event(enable_timing=True)
    mark.record()
    marks.append(mark)
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
torch.cuda.set_sync_debug_mode(0)
torch.cuda.synchronize()
ms = [marks[i].elapsed_time(marks[i + 1]) for i in range(len(marks) - 1)]
print(f"STALL_JOB device_step_ms {statistics.median(ms[10:]):.3f} syncs {len(SYNCS)}", flush=True)
dist.destroy_process_group()
'''

MODES = ("none", "own", "stall")


def run_mode(mode: str, job: Path, run_dir: Path, sleep_ms: float, steps: int) -> dict:
    from rankwatch.collector import offline

    env = dict(os.environ, STALL_MODE=mode, STALL_SLEEP_MS=str(sleep_ms), STALL_STEPS=str(steps),
               PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, "-m", "rankwatch.cli", "run", "--run-dir", str(run_dir),
                        "--nproc-per-node", "1", str(job)], env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    row: dict = {"mode": mode, "exit": p.returncode}
    line = next((l.split() for l in out.splitlines() if l.startswith("STALL_JOB ")), None)
    if line is None:
        row["error"] = out[-2000:]
        return row
    row["device_ms"], row["syncs"] = float(line[2]), int(line[4])
    report = json.loads((run_dir / "report.json").read_text())
    row["verdicts"] = [v.get("kind") for v in report.get("verdicts", [])]
    run, _ = offline.load(run_dir)
    compute = [r.compute_s for rank in run.ranks.values() for r in rank.steps.values()
               if r.compute_s is not None and r.step >= 10]
    row["compute_ms"] = 1e3 * statistics.median(compute) if compute else None
    row["records_with_compute"] = len(compute)
    return row


def judge(rows: dict[str, dict], sleep_ms: float) -> list[str]:
    misses = [f"{m}: {r.get('error', '')[-500:]}" for m, r in rows.items() if "error" in r or r["exit"] != 0]
    if misses:
        return misses
    if any(r["compute_ms"] is None for r in rows.values()):
        return ["a mode reported no compute_s"]
    none, own, stall = rows["none"], rows["own"], rows["stall"]
    if abs(stall["compute_ms"] - none["compute_ms"]) > sleep_ms / 4:
        misses.append(f"stall: compute_s {stall['compute_ms']:.2f} ms, not none's {none['compute_ms']:.2f} ms")
    if stall["device_ms"] < none["device_ms"] + sleep_ms / 2:
        misses.append("stall: the device step did not stall (the job's stall did not happen)")
    if own["compute_ms"] < none["compute_ms"] + sleep_ms / 2:
        misses.append(f"own: compute_s {own['compute_ms']:.2f} ms left out the rank's own work")
    misses += [f"{m}: verdicts {r['verdicts']}" for m, r in rows.items() if r["verdicts"]]
    if len({r["syncs"] for r in rows.values()}) > 1:
        misses.append(f"syncs differ between modes: {[r['syncs'] for r in rows.values()]}")
    return misses


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sleep-ms", type=float, default=20.0)
    p.add_argument("--steps", type=int, default=150)
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("[gpu_stream_stall] no GPU here: nothing was checked")
        return 2
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "stall_job.py"
        job.write_text(JOB)
        for mode in MODES:
            rows[mode] = run_mode(mode, job, Path(tmp) / mode, a.sleep_ms, a.steps)
            r = rows[mode]
            print(f"{mode:>6}  device step {r.get('device_ms', float('nan')):8.2f} ms  compute_s "
                  f"{r.get('compute_ms') or float('nan'):8.2f} ms  ({r.get('records_with_compute', 0)} records)  "
                  f"syncs {r.get('syncs')}  verdicts {r.get('verdicts')}", flush=True)
    misses = judge(rows, a.sleep_ms)
    for m in misses:
        print(f"[gpu_stream_stall] MISS {m}")
    print(f"[gpu_stream_stall] {'ok' if not misses else 'MISS'}")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
