"""Sensitivity on real jobs: the smallest fault each agent-side check names.

bench/sensitivity.py sweeps what the collector reads from step records
(gradient norms, memory, step times) by writing faults into recorded zoo
jobs. What the agent digests inside the process (weight fingerprints,
non-finite values, the learning rate, input batches) can only be swept on
real jobs: this runs faultbench's plain DDP job (bench/faultkit/jobs/ddp.py)
under `rankwatch run` with default settings, and puts one fault of a given
size into one rank through faultbench's injector (FAULTBENCH_MAGNITUDE):

- weight_divergence: the largest weight matrix nudged once, p *= 1 + M * randn,
  M from 1e-8 to 1e-2 (at 1e-8 only the elements whose factor rounds away
  from 1.0 in float32 change, by one ulp); expected `weight_divergence`;
- non-finite in one element: NaN or Inf in one element of the first layer's
  output, of its gradient (before DDP's allreduce), or of the largest weight
  matrix; expected `nonfinite`;
- learning rate: the culprit's learning rate x M (1 % to 10x), from the
  fault step on; expected `config_divergence`;
- duplicate data: the share M of the culprit's batch rows repeated from the
  fault step's batch, step after step (1.0: the whole batch); expected
  `duplicate_data`;
- healthy: no fault; any verdict is a false alarm.

Each condition runs once per seed; seed k uses WORLD_SIZES[k] ranks (2-4), a
culprit drawn from them and the fault step FAULT_STEPS[k] (from step 0 to
late in the run). A condition is named when a verdict of the expected kind
names exactly the culprit, or, on 2 ranks, names both (two ranks that
disagree have no majority: a cross-rank rule cannot say which one is
wrong); the table counts the exact ones apart. The verdict's step is
recorded next to the injection's.

    python bench/sensitivity_jobs.py                      # every condition, 3 seeds (~15 min)
    python bench/sensitivity_jobs.py --only weight_divergence --seeds 1
    python bench/sensitivity_jobs.py --docs               # docs/sensitivity_jobs.md from one run
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from faultkit import plan as plan_mod  # noqa: E402
from faultkit import report as report_mod  # noqa: E402
from faultkit import scoring, tools  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "sensitivity_jobs.md"
DATA = ROOT / "docs" / "benchmark" / "sensitivity_jobs.jsonl"
STEPS = 60
WORLD_SIZES = (2, 3, 4)
FAULT_STEPS = (0, 25, 45)
CAP_S = 240.0
NAMED_SHARE = 0.9


@dataclass(frozen=True)
class Condition:
    family: str  # a row group of the table
    kind: str  # the injector's fault kind
    variant: str
    magnitude: str
    expected: str  # the verdict kind that names it


CONDITIONS = (
    [Condition("weight_divergence", "weight_divergence", "", m, "weight_divergence")
     for m in ("1e-8", "1e-7", "1e-6", "1e-5", "1e-4", "1e-3", "1e-2")]
    + [Condition(f"nonfinite_{where}", kind, variant, value, "nonfinite")
       for where, kind, variant in (("activation", "nan_loss", "one"), ("gradient", "nan_grad", "one"),
                                    ("weight", "weight_divergence", ""))
       for value in ("nan", "inf")]
    + [Condition("learning_rate", "config_divergence", "lr", m, "config_divergence")
       for m in ("1.001", "1.01", "1.1", "2", "10")]
    + [Condition("duplicate_data", "duplicate_data", "", m, "duplicate_data") for m in ("0.25", "0.5", "1.0")]
    + [Condition("healthy", "none", "", "", "")]
)


def plan_for(cond: Condition, seed: int) -> plan_mod.RunPlan:
    world = WORLD_SIZES[seed % len(WORLD_SIZES)]
    if cond.kind == "none":
        return plan_mod.RunPlan("ddp", plan_mod.HEALTHY, seed, None, None, "", world, STEPS)
    rng = random.Random(f"{cond.family}/{cond.magnitude}/{seed}")
    return plan_mod.RunPlan("ddp", cond.kind, seed, rng.randrange(world), FAULT_STEPS[seed % len(FAULT_STEPS)],
                            cond.variant, world, STEPS, cond.magnitude)


def run_one(cond: Condition, seed: int, work: Path) -> dict:
    plan = plan_for(cond, seed)
    workdir = work / f"{cond.family}-{cond.magnitude or 'none'}-s{seed}"
    outcome = tools.run_job(plan, workdir, watched=True, pg_timeout=30.0, cap_s=CAP_S)
    answer = tools.rankwatch_answer(outcome)
    verdicts = answer.get("verdicts") or []
    of_kind = [v for v in verdicts if cond.expected and v["kind"] == cond.expected]
    named = [v for v in of_kind if v["ranks"] == [plan.rank]]
    # Two ranks that disagree, no majority: naming both is the most a cross-rank rule can say.
    both = [v for v in of_kind if plan.world_size == 2 and sorted(v["ranks"]) == [0, 1]]
    truth = outcome.injected or {}
    return {
        "family": cond.family, "kind": cond.kind, "variant": cond.variant, "magnitude": cond.magnitude,
        "expected": cond.expected, "seed": seed, "world_size": plan.world_size, "rank": plan.rank,
        "fault_step": plan.step, "injected": bool(truth) or cond.kind == "none",
        "injected_step": truth.get("step"), "detail": truth.get("detail"),
        "named": bool(named or both), "exact": bool(named),
        "verdict_step": (named or both)[0]["step"] if named or both else None,
        "verdicts": [{"kind": v["kind"], "ranks": v["ranks"], "step": v["step"]} for v in verdicts],
        "exit_code": outcome.exit_code, "timed_out": outcome.timed_out,
    }


def table(rows: list[dict]) -> list[str]:
    out = ["| fault | size | elements changed | named [95 % CI] | of which the culprit alone | "
           "verdict step - fault step | other verdicts |", "|---|---|---|---|---|---|---|"]
    order: dict[tuple, list[dict]] = {}
    for row in rows:
        order.setdefault((row["family"], row["magnitude"]), []).append(row)
    for (family, magnitude), group in order.items():
        if family == "healthy":
            alarms = [f"{v['kind']} {v['ranks']}" for r in group for v in r["verdicts"]]
            out.append(f"| healthy | – | – | false alarms: {len(alarms)} in {len(group)} runs | – | – | "
                       f"{'; '.join(alarms) or 'none'} |")
            continue
        injected = [r for r in group if r["injected"]]
        hits = sum(r["named"] for r in injected)
        p = scoring.wilson(hits, len(injected))
        lags = sorted(r["verdict_step"] - r["injected_step"] for r in injected
                      if r["named"] and r["verdict_step"] is not None and r["injected_step"] is not None)
        others = sorted({f"{v['kind']} {v['ranks']}" for r in group for v in r["verdicts"]
                         if not (r["named"] and v["kind"] == r["expected"])})
        exact = sum(r.get("exact", r["named"]) for r in injected)
        lag = ", ".join(str(x) for x in lags) if lags else "–"
        changed = [(r.get("detail") or {}).get("changed") for r in injected]
        changed_text = ", ".join(f"{c}/{(r.get('detail') or {}).get('elements')}" for c, r in zip(changed, injected)
                                 if c is not None) or "–"
        out.append(f"| {family} | {magnitude or '–'} | {changed_text} | {report_mod.proportion(p)} | "
                   f"{exact}/{hits} | {lag} | {'; '.join(others) or 'none'} |")
    return out


def smallest(rows: list[dict]) -> list[str]:
    """Per swept family: the smallest size from which every larger size tried
    was named in >= NAMED_SHARE of its runs (a smaller size named by luck
    below a missed one does not count)."""
    out = []
    for family in ("weight_divergence", "learning_rate", "duplicate_data"):
        sizes: dict[str, list[dict]] = {}
        for r in rows:
            if r["family"] == family and r["injected"]:
                sizes.setdefault(r["magnitude"], []).append(r)
        best = None
        for m in sorted(sizes, key=float, reverse=True):
            g = sizes[m]
            if not g or sum(x["named"] for x in g) < NAMED_SHARE * len(g):
                break
            best = m
        out.append(f"- {family}: {best if best else 'none of the sizes tried'}")
    return out


def misses(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r["family"] == "healthy" or not r["injected"] or r["named"]:
            continue
        said = "; ".join(f"{v['kind']} {v['ranks']} at step {v['step']}" for v in r["verdicts"]) or "nothing"
        out.append(f"- {r['family']} {r['magnitude']}, seed {r['seed']}: {r['world_size']} ranks, culprit "
                   f"{r['rank']}, fault at step {r['injected_step']}; said {said}")
    return out or ["- none"]


def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return sha + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_docs(rows: list[dict], command: str, seconds: float, commit: Optional[str] = None,
               data: bool = True) -> None:
    info = report_mod.machine()
    lines = [
        "# Sensitivity on real jobs: the smallest fault each agent-side check names",
        "",
        "<!-- Generated by bench/sensitivity_jobs.py; edits here are overwritten. -->",
        "",
        f"Command: `{command}` ({len(rows)} runs, {seconds / 60:.1f} min), rankwatch at `{commit or _commit()}`.",
        "",
        f"Machine: {info.get('cpu', '?')}, {info.get('cores', '?')} cores; torch {info.get('torch', '?')}.",
        "",
        f"Job: faultbench's plain DDP job (an MLP, SGD with momentum, DistributedSampler; gloo, CPU), {STEPS} "
        f"optimizer steps, under `rankwatch run` with default settings. Seed k runs {list(WORLD_SIZES)}[k] ranks "
        f"with the fault at step {list(FAULT_STEPS)}[k] on a culprit drawn at random; the fault is put in by "
        "faultbench's injector from outside the script (bench/faultkit/inject). Named: a verdict of the "
        "expected kind naming exactly the culprit, or on 2 ranks naming both (no majority: no cross-rank rule "
        "can tell which of two is wrong; the next column counts the runs that named the culprit alone). The "
        "lag column is the verdict's step minus the step the "
        "injector recorded (one value per named run).",
        "",
        "Smallest size from which every larger size tried was named in >= 90 % of runs:",
        "",
        *smallest(rows),
        "",
        *table(rows),
        "",
        "Runs with the fault that were not named:",
        "",
        *misses(rows),
        "",
        "Sizes: weight_divergence, the relative nudge of the largest weight matrix (p *= 1 + M * randn, once; "
        "the elements-changed column counts what float32 kept of it: at 1e-8 a few dozen elements move by one "
        "ulp); nonfinite_*, one element set to NaN "
        "or Inf once (the first layer's output, its gradient before DDP's allreduce, or the largest weight "
        "matrix); learning_rate, the culprit's rate times M from the fault step on; duplicate_data, the share "
        "of each batch's rows repeated from the fault step's batch, step after step.",
        "",
        f"Every run: `{DATA.relative_to(ROOT)}`.",
        "",
    ]
    DOC.write_text("\n".join(lines))
    if data:
        DATA.parent.mkdir(parents=True, exist_ok=True)
        DATA.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated families (weight_divergence, "
                        "nonfinite_activation, nonfinite_gradient, nonfinite_weight, learning_rate, duplicate_data, "
                        "healthy)")
    parser.add_argument("--work", type=Path, default=None, help="the runs' folders (default: a temp dir)")
    parser.add_argument("--docs", action="store_true", help=f"write {DOC.relative_to(ROOT)} and the runs")
    parser.add_argument("--rescore", action="store_true", help=f"only rewrite {DOC.relative_to(ROOT)} from "
                        f"{DATA.relative_to(ROOT)} (its command, time and commit kept)")
    a = parser.parse_args(argv)
    if a.rescore:
        import re

        rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
        head = re.search(r"Command: `([^`]*)` \(\d+ runs, ([\d.]+) min\), rankwatch at `([^`]*)`", DOC.read_text())
        if head is None:
            parser.error(f"{DOC} has no command line to keep")
        write_docs(rows, head.group(1), float(head.group(2)) * 60, commit=head.group(3), data=False)
        print(f"wrote {DOC}")
        return 0
    families = set(filter(None, a.only.split(",")))
    conditions = [c for c in CONDITIONS if not families or c.family in families]
    work = a.work or Path(tempfile.mkdtemp(prefix="rankwatch-sensitivity-jobs-"))
    started = time.time()
    rows = []
    for seed in range(a.seeds):
        for cond in conditions:
            row = run_one(cond, seed, work)
            rows.append(row)
            print(f"{cond.family} {cond.magnitude or '-'} seed {seed} ({row['world_size']} ranks, rank "
                  f"{row['rank']}, step {row['fault_step']}): {'named' if row['named'] else 'not named'}; "
                  f"verdicts {row['verdicts']}", flush=True)
    print("\n".join(smallest(rows) + [""] + table(rows)))
    if a.docs:
        command = "python bench/sensitivity_jobs.py" + (f" --seeds {a.seeds}" if a.seeds != 3 else "") + \
            (f" --only {a.only}" if a.only else "")
        write_docs(rows, command, time.time() - started)
        print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
