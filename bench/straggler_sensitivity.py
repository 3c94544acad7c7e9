"""How slow a rank must be before the straggler check names it, on the step
times of real healthy jobs (issue 24, part 1, for `straggler` only).

The baselines are the zoo's recorded runs in tests/data (two gloo ranks on
a 2-core machine: the noisiest host rankwatch meets, step-to-step jitter of
10-20 %): each step's own time per rank, as the collector received it. One
rank is made `factor` times slower from a step onwards (its own time
multiplied, as a throttled device or a slow data pipeline would), and the
collector's analysis runs on the result, exactly as offline analysis does.
Every (baseline, slow rank, start step) is one trial; factor 1.0 is the
healthy run itself (a verdict there is a false alarm).

    python bench/straggler_sensitivity.py              # table on stdout
    python bench/straggler_sensitivity.py --json F     # and the trials

Pure (no processes): about 20 s here."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
BASELINES = {
    "hf_t5_trainer": DATA / "zoo_t5_trainer_step_times.json",
    "diffusers_unet_ema": DATA / "zoo_diffusers_unet_step_times.json",
}
FACTORS = (1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.8, 2.0, 2.5, 3.0)
STARTS = (20, 60, 100, 140, 180)  # the slowdown's first step (each run has 300)
NAMED_SHARE = 0.9  # "named": in at least this share of trials


def trial(recorded: dict, factor: float, slow_rank: int, start: int) -> dict:
    from rankwatch import wire
    from rankwatch.collector import analyses
    from rankwatch.collector.state import RunState

    compute, data = recorded["compute_s"], recorded["data_s"]
    ranks = sorted(int(r) for r in compute)
    t0 = 1_000_000.0
    run = RunState(run_id="sensitivity", world_size=len(ranks))
    at = t0
    slow_at = None  # the job's own time (sum of its slowest rank's) when the slowdown began
    clock = 0.0
    for step in range(len(compute[str(ranks[0])])):
        own = {r: compute[str(r)][step] * (factor if r == slow_rank and step >= start else 1.0) for r in ranks}
        if step == start:
            slow_at = clock
        for r in ranks:
            run.rank(r).add_step(wire.StepRecord(step=step, started_at=at, ended_at=at + max(own.values()),
                                                 compute_s=own[r], data_s=data[str(r)][step], loss=1.0,
                                                 grad_norm=1.0))
        clock += max(own.values())
        at += max(own.values()) + 0.01
    found = [v for v in analyses.run_all(run, t0 + 1e6, True) if v.kind == "straggler"]
    out = {"factor": factor, "slow_rank": slow_rank, "start": start, "verdicts": [v.ranks for v in found]}
    if found:
        v = found[0]
        last = v.evidence["steps"][1]
        # the verdict's step is the start of the rank's streak over the bound:
        # a few steps late when the first slow steps fell under it, earlier
        # when a stray episode over it shortly before joins the streak
        out.update(step=v.step, named_at_step=last, step_error=v.step - start,
                   right=factor > 1.0 and v.ranks == [slow_rank], steps_to_name=last - start)
        # seconds of the job's work from the slowdown to the step it was named at
        out["seconds_to_name"] = round(sum(max(compute[str(r)][s] * (factor if r == slow_rank and s >= start
                                                                       else 1.0) for r in ranks)
                                           for s in range(start, last + 1)), 2)
    else:
        out["right"] = False
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write every trial here")
    a = p.parse_args(argv)
    started = time.monotonic()
    rows, trials = [], []
    for name, path in BASELINES.items():
        recorded = json.loads(path.read_text())
        ranks = sorted(int(r) for r in recorded["compute_s"])
        for factor in FACTORS:
            got = [trial(recorded, factor, r, s) | {"baseline": name} for r in ranks for s in STARTS]
            trials += got
            if factor == 1.0:
                rows.append((name, factor, len(got), sum(bool(t["verdicts"]) for t in got), None, None, None, None))
                continue
            right = [t for t in got if t["right"]]
            wrong = sum(bool(t["verdicts"]) and not t["right"] for t in got)
            secs = sorted(t["seconds_to_name"] for t in right)
            errors = sorted(abs(t["step_error"]) for t in right)
            rows.append((name, factor, len(got), len(right), wrong, secs[len(secs) // 2] if secs else None,
                         errors[len(errors) // 2] if errors else None, errors[-1] if errors else None))
    print("| baseline | slowdown | trials | named (right rank) | other verdicts | median s to name "
          "| verdict step - slowdown's (median, max abs) |")
    print("|---|---|---|---|---|---|---|")
    for name, factor, n, named, wrong, secs, err, worst in rows:
        if factor == 1.0:
            print(f"| {name} | healthy | {n} | false alarms: {named} | | | |")
        else:
            print(f"| {name} | {factor:.1f}x | {n} | {named}/{n} | {wrong} | {'' if secs is None else secs} "
                  f"| {'' if err is None else f'{err}, {worst}'} |")
    print()
    for name in BASELINES:
        named = [f for b, f, n, k, *_ in rows if b == name and f > 1.0 and k >= NAMED_SHARE * n]
        smallest = min(named) if named else None
        print(f"{name}: smallest slowdown named in >= {NAMED_SHARE:.0%} of trials: "
              f"{'none' if smallest is None else f'{smallest:.1f}x'}")
    print(f"({len(trials)} trials in {time.monotonic() - started:.0f} s)")
    if a.json:
        a.json.write_text("".join(json.dumps(t) + "\n" for t in trials))
    return 0


if __name__ == "__main__":
    sys.exit(main())
