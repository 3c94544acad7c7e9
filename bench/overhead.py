"""Per-step overhead of rankwatch with every check on, against the same job
without rankwatch, measured side by side in one run (CONTRACT: under 1%).

    python bench/overhead.py [--sizes 256x4,1024x4,2048x6] [--repeats 3]
    python bench/overhead.py --compile     # the model under torch.compile: compiled throughput side by side

Runs are interleaved (plain, watched, plain, watched, ...) so that machine
noise hits both alike; the ratio is watched / plain of the median step time.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
JOB = HERE / "step_job.py"


def run(watched: bool, width: int, layers: int, steps: int, nproc: int, run_dir: Path,
        compiled: bool = False) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launcher = ([sys.executable, "-m", "rankwatch.cli", "run", "--run-dir", str(run_dir)] if watched
                else [sys.executable, "-m", "torch.distributed.run"])
    cmd = [*launcher, "--standalone", "--nproc-per-node", str(nproc), str(JOB), "--width", str(width),
           "--layers", str(layers), "--steps", str(steps)] + (["--compile"] if compiled else [])
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    match = re.search(r"STEP_TIME (\S+) MEDIAN (\S+) PARAMS (\d+)", out.stdout + out.stderr)
    if out.returncode != 0 or not match:
        raise SystemExit(f"benchmark job failed ({'watched' if watched else 'plain'}):\n{out.stderr[-3000:]}")
    return float(match.group(2)), int(match.group(3))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256x4,1024x4,2048x6", help="WIDTHxLAYERS, comma separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="the model under torch.compile (rankwatch must add no "
                                                            "graph break: tests/test_compile_safety.py counts them)")
    a = p.parse_args()
    if a.compile:
        print("torch.compile'd model (steps per second = 1 / step time)")
    print(f"{'model':>12} {'params':>10} {'plain ms':>9} {'watched ms':>11} {'ratio':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for size in a.sizes.split(","):
            width, layers = (int(v) for v in size.split("x"))
            plain, watched = [], []
            params = 0
            for i in range(a.repeats):
                t, params = run(False, width, layers, a.steps, a.nproc, Path(tmp) / f"p{size}{i}", a.compile)
                plain.append(t)
                t, params = run(True, width, layers, a.steps, a.nproc, Path(tmp) / f"w{size}{i}", a.compile)
                watched.append(t)
            p_med, w_med = statistics.median(plain), statistics.median(watched)
            print(f"{size:>12} {params:>10} {p_med * 1e3:>9.2f} {w_med * 1e3:>11.2f} {w_med / p_med:>7.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
