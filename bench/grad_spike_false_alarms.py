"""How often `grad_spike` fires on healthy runs, and the smallest spike it still catches.

    python bench/grad_spike_false_alarms.py                 # real healthy jobs + synthetic shapes
    python bench/grad_spike_false_alarms.py --no-jobs       # synthetic shapes only (seconds)
    python bench/grad_spike_false_alarms.py --run-dir DIR   # also replay an existing run dir

Per-rank local gradient norms are replayed, step by step, through the rule's
own code (`collector.analyses.grad_spike.Tracker`, the object the live and
offline collectors use). Sources:
- real healthy `rankwatch run` jobs (4 ranks, gloo): the long noisy-label run
  with accumulation and clipping, the fast-converging classifier with rare
  mislabelled samples, the demo script; their norms are read from the run's
  index, as the agent measured and sampled them;
- synthetic heavy-tailed series (many ranks, 20,000 steps each): log-normal
  noise, Pareto tails, convergence with rare hard examples, a slow rank with
  systematically larger norms, loss-scale-like steps.

False alarms: every finding on a healthy series (the tracker is re-armed
after each one), per 10,000 steps. Smallest spike caught: one rank's norm
multiplied by a factor at a random step (after a warm-up) of each series, the
fraction of injections named on that rank and step, per factor.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rankwatch.collector.analyses import grad_spike  # noqa: E402

FACTORS = (3, 10, 30, 100, 300, 1000, 10_000)


@dataclass
class Rec:
    grad_norm: float
    ended_at: float


Series = dict[int, dict[int, float]]  # step -> rank -> norm


def replay(series: Series, stop_at_first: bool = False) -> list[tuple[int, list[int]]]:
    """Every finding of the rule over the series: (step, ranks)."""
    tracker = grad_spike.Tracker()
    found = []
    for step in sorted(series):
        records = {r: Rec(v, float(step)) for r, v in series[step].items()}
        tracker.on_step(None, step, records)
        if tracker.finding is not None:
            found.append((tracker.finding["step"], sorted(tracker.finding["spiked"])))
            if stop_at_first:
                break
            tracker.finding = None
    return found


# -- synthetic healthy shapes ------------------------------------------------------------------

def synthetic(shape: str, ranks: int, steps: int, seed: int) -> Series:
    rnd = random.Random(seed)
    out: Series = {}
    for s in range(steps):
        level = 1.0 / (1.0 + s / 500)  # norms shrink as training goes on
        row = {}
        for r in range(ranks):
            if shape == "lognormal":
                v = level * math.exp(rnd.gauss(0, 0.5))
            elif shape == "pareto_a2":
                v = level * rnd.paretovariate(2.0)
            elif shape == "pareto_a1.5":
                v = level * rnd.paretovariate(1.5)
            elif shape == "converging_rare_hard":
                # most batches fitted (norm ~ 1e-3 of the start), 1 in 30 holds a hard example
                base = max(level * math.exp(-s / 300), 1e-3 * level) * math.exp(rnd.gauss(0, 0.3))
                v = base if rnd.random() > 1 / 30 else level * 0.5 * math.exp(rnd.gauss(0, 0.5))
            elif shape == "slow_rank_bigger":
                v = level * math.exp(rnd.gauss(0, 0.3)) * (4.0 if r == 0 else 1.0)
            elif shape == "accumulation_sampled":
                # the agent reads every 4th step on a loaded machine: gaps in the series
                if s % 4 and rnd.random() < 0.8:
                    continue
                v = level * math.exp(rnd.gauss(0, 0.7))
            else:
                raise ValueError(shape)
            row[r] = v
        if row:
            out[s] = row
    return out


SHAPES = ("lognormal", "pareto_a2", "pareto_a1.5", "converging_rare_hard", "slow_rank_bigger",
          "accumulation_sampled")


# -- real healthy jobs ---------------------------------------------------------------------------

JOBS = {
    "noisy_labels_accum_clip_1280_steps": [str(ROOT / "tests" / "scripts" / "noisy_long.py"), "--epochs", "40"],
    "converging_classifier_rare_mislabelled": [str(ROOT / "tests" / "scripts" / "converging_classifier.py")],
    "demo_mlp_accum": [str(ROOT / "examples" / "train.py"), "--steps", "300", "--accum", "2"],
}


def run_job(name: str, args: list[str], workdir: Path) -> Path:
    run_dir = workdir / name
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANKWATCH_RUN_ID", None)
    cmd = [sys.executable, "-m", "rankwatch.cli", "run", "--nproc-per-node", "4", "--run-dir", str(run_dir), *args]
    done = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return run_dir


def series_of(run_dir: Path) -> tuple[Series, list]:
    from rankwatch.collector.offline import load

    run, _ = load(run_dir)
    out: Series = {}
    for rank, state in run.ranks.items():
        steps = state.steps.values() if hasattr(state.steps, "values") else state.steps
        for rec in steps:
            if rec.grad_norm is not None and math.isfinite(rec.grad_norm):
                out.setdefault(rec.step, {})[rank] = rec.grad_norm
    import json

    report = json.loads((run_dir / "report.json").read_text())
    return out, [(v["kind"], v["ranks"], v["step"]) for v in report.get("verdicts", [])]


# -- measures ----------------------------------------------------------------------------------

def detection(series: Series, factor: float, trials: int, seed: int) -> float:
    rnd = random.Random(seed)
    steps = sorted(series)
    eligible = [s for s in steps[len(steps) // 10:] if len(series[s]) >= 2]
    if not eligible:
        return float("nan")
    caught = 0
    for _ in range(trials):
        step = rnd.choice(eligible)
        rank = rnd.choice(sorted(series[step]))
        spiked = {s: dict(v) for s, v in series.items() if s <= step + 2}
        spiked[step][rank] *= factor
        found = replay(spiked, stop_at_first=False)
        caught += any(s == step and ranks == [rank] for s, ranks in found)
    return caught / trials


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-jobs", action="store_true", help="skip the real healthy jobs")
    parser.add_argument("--run-dir", action="append", default=[], help="replay an existing healthy run dir too")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()

    sources: list[tuple[str, Series, str]] = []
    for shape in SHAPES:
        for seed in range(args.seeds):
            sources.append((f"{shape} seed {seed}", synthetic(shape, args.ranks, args.steps, seed), "synthetic"))
    if not args.no_jobs:
        with tempfile.TemporaryDirectory(prefix="rankwatch-bench-") as tmp:
            for name, job_args in JOBS.items():
                started = time.time()
                run_dir = run_job(name, job_args, Path(tmp))
                series, verdicts = series_of(run_dir)
                print(f"[job] {name}: {time.time() - started:.0f} s, live verdicts {verdicts or 'none'}",
                      file=sys.stderr, flush=True)
                sources.append((name, series, "real job, 4 ranks"))
    for path in args.run_dir:
        series, _ = series_of(Path(path))
        sources.append((Path(path).name, series, "run dir"))

    print("| series | source | steps judged | rank-steps | false alarms | per 10,000 steps |")
    print("|---|---|---|---|---|---|")
    total_steps = total_alarms = 0
    for name, series, kind in sources:
        alarms = replay(series)
        steps = len(series)
        total_steps += steps
        total_alarms += len(alarms)
        values = sum(len(v) for v in series.values())
        print(f"| {name} | {kind} | {steps:,} | {values:,} | {len(alarms)} | {1e4 * len(alarms) / max(steps, 1):.2f} |")
    print(f"\nall healthy series: {total_alarms} false alarms in {total_steps:,} steps "
          f"({1e4 * total_alarms / max(total_steps, 1):.2f} per 10,000 steps)\n")

    print("| series | " + " | ".join(f"x{f:g}" for f in FACTORS) + " | smallest factor caught >= 90% |")
    print("|---|" + "---|" * (len(FACTORS) + 1))
    for name, series, kind in sources:
        if kind == "synthetic" and not name.endswith("seed 0"):
            continue
        if len(series) > 3000:  # the detection sweep replays the prefix up to each injection
            series = {s: series[s] for s in sorted(series)[:3000]}
        rates = [detection(series, f, args.trials, seed=i) for i, f in enumerate(FACTORS)]
        smallest = next((f"x{f:g}" for f, r in zip(FACTORS, rates) if r >= 0.9), "none")
        print(f"| {name} | " + " | ".join(f"{r:.0%}" for r in rates) + f" | {smallest} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
