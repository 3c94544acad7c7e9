"""Whole-job time of a short job under `rankwatch run` against plain
`torchrun`, side by side: what a short job or a CI run pays for rankwatch's
launcher, embedded collector, agent start and end-of-run report.

    python bench/startup_cost.py [--repeats 5] [--steps 3] [--nproc 2] [--quick]
    python bench/startup_cost.py --phases      # where the watched launch's time goes (its own log lines)

Runs are interleaved (plain, watched, plain, watched, ...) so that machine
noise hits both alike; the figure is the difference of the medians.
``--quick`` (one pair) is what a test calls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import side_by_side  # noqa: E402

JOB = ROOT / "examples" / "train.py"


def whole_job(watched: bool, steps: int, nproc: int, run_dir: Path, stamps: bool = False) -> tuple[float, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RANKWATCH_RUN_ID", None)
    # Bytecode as an installed package has it (pip compiles at install): with
    # PYTHONDONTWRITEBYTECODE (set on this project's machines) every process
    # compiled rankwatch's sources again, ~0.3 s in the launcher and in each
    # rank that torch, precompiled, never pays. The first pair warms it.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    cmd = [*side_by_side.launcher(watched, run_dir), "--standalone", "--nproc-per-node", str(nproc), str(JOB),
           "--steps", str(steps)]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in proc.stdout:  # each line with its time since the start (--phases)
        lines.append(f"{time.perf_counter() - started:7.3f} {line.rstrip()}" if stamps else line.rstrip())
    proc.wait(timeout=600)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"job failed ({'watched' if watched else 'plain'}):\n" + "\n".join(lines[-40:]))
    return elapsed, "\n".join(lines)


def measure(repeats: int, steps: int, nproc: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        whole_job(True, 1, nproc, Path(tmp) / "warm")  # bytecode written, caches warm, not counted
        plain, watched = side_by_side.interleaved(
            repeats, lambda i: whole_job(False, steps, nproc, Path(tmp) / f"p{i}")[0],
            lambda i: whole_job(True, steps, nproc, Path(tmp) / f"w{i}")[0])
    return {"plain_s": statistics.median(plain), "watched_s": statistics.median(watched),
            "extra_s": statistics.median(watched) - statistics.median(plain),
            "plain_all": plain, "watched_all": watched}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="one pair of runs")
    p.add_argument("--phases", action="store_true", help="one watched run, each output line timed")
    a = p.parse_args()
    if a.phases:
        with tempfile.TemporaryDirectory() as tmp:
            for watched in (False, True):
                elapsed, out = whole_job(watched, a.steps, a.nproc, Path(tmp) / "run", stamps=True)
                print(f"--- {'rankwatch run' if watched else 'torchrun'}: {elapsed:.2f} s\n{out}")
        return 0
    r = measure(1 if a.quick else a.repeats, a.steps, a.nproc)
    print(f"short job ({a.steps} steps, {a.nproc} ranks, --standalone), median of {1 if a.quick else a.repeats}:")
    print(f"  torchrun       {r['plain_s']:.2f} s   {' '.join(f'{x:.2f}' for x in r['plain_all'])}")
    print(f"  rankwatch run  {r['watched_s']:.2f} s   {' '.join(f'{x:.2f}' for x in r['watched_all'])}")
    print(f"STARTUP_EXTRA_S {r['extra_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
