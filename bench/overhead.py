"""Per-step overhead of rankwatch with every check on, against the same job
without rankwatch, measured side by side in one run (CONTRACT: under 1%).

    python bench/overhead.py [--sizes 256x4,1024x4,2048x6] [--repeats 3]
    python bench/overhead.py --compile     # the model under torch.compile: compiled throughput side by side

Runs are interleaved (plain, watched, plain, watched, ...) so that machine
noise hits both alike; the ratio is watched / plain of the median step time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import side_by_side

HERE = Path(__file__).resolve().parent
JOB = HERE / "step_job.py"


def run(watched: bool, width: int, layers: int, steps: int, nproc: int, run_dir: Path,
        compiled: bool = False) -> tuple[float, int]:
    cmd = [*side_by_side.launcher(watched, run_dir), "--standalone", "--nproc-per-node", str(nproc), str(JOB),
           "--width", str(width), "--layers", str(layers), "--steps", str(steps)] + (["--compile"] if compiled else [])
    _, median, params = side_by_side.figures(cmd, side_by_side.job_env(), r"STEP_TIME (\S+) MEDIAN (\S+) PARAMS (\d+)",
                                             "watched" if watched else "plain")
    return float(median), int(params)


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
            plain, watched = side_by_side.interleaved(
                a.repeats,
                lambda i: run(False, width, layers, a.steps, a.nproc, Path(tmp) / f"p{size}{i}", a.compile),
                lambda i: run(True, width, layers, a.steps, a.nproc, Path(tmp) / f"w{size}{i}", a.compile))
            params = plain[0][1]
            plain, watched = [t for t, _ in plain], [t for t, _ in watched]
            p_med, w_med = statistics.median(plain), statistics.median(watched)
            print(f"{size:>12} {params:>10} {p_med * 1e3:>9.2f} {w_med * 1e3:>11.2f} {w_med / p_med:>7.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
