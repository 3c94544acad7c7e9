"""How small a fault each step-series check names, on the step records of the
zoo's healthy jobs (issue 24, part 1): `grad_spike`, `memory_growth` and
`straggler`.

Baselines: every healthy zoo job's step records as the collector received
them (`bench/data/zoo_series.json.gz`, extracted from `bench/zoo.py`'s run
dirs with `--extract`; 35 jobs from Lightning, Hugging Face, timm,
torchvision, diffusers, PEFT, PyG, Gymnasium and plain torch, 2 gloo ranks on
a 2-core host). A fault of a given magnitude is written into one rank's
records from a given step, and the collector's analyses run on the result
exactly as offline analysis does (`analyses.run_all`, consequences explained
away). Every (job, rank, fault step) is one trial:

- `grad_spike`: the rank's local gradient norm times ``k`` at one step (the
  first recorded norm at or after the fault step);
- `memory_growth`: the rank's RSS grows by ``k`` bytes every step from the
  fault step on (a leak);
- `straggler`: the rank's own compute time times ``k`` from the fault step on.

Each job's recorded steps are repeated to 600 steps (a minute of work for
`straggler`), so what is measured is the magnitude, not how long a zoo job
happened to run after the fault. Two simplifications, both on the records
alone: a slowed rank's peers keep their recorded own times (in a real DDP
job they wait for it in the allreduce, which the agent leaves out of their
own time, so this should be close); and RSS restarts from its recorded value
at each repetition (a drop every few hundred steps, which can only make a
leak harder to name). `bench/faultbench.py` runs real faulted jobs.

"Named" is the right kind on the right rank (for `grad_spike`, at the spiked
step). Magnitude 0 (or 1 for factors) is the healthy job itself: any verdict
there is a false alarm. The smallest magnitude named in at least 90 % of
trials is each check's sensitivity on these jobs.

    python bench/sensitivity.py                       # every kind: table on stdout
    python bench/sensitivity.py --kinds grad_spike    # one kind
    python bench/sensitivity.py --json F              # and every trial (JSON Lines)
    python bench/sensitivity.py --plot F.png          # named share against magnitude
    python bench/sensitivity.py --docs                # docs/sensitivity.md + its plot and trials, one commit
    python bench/sensitivity.py --extract /path/zoo-work   # rebuild the baselines from zoo run dirs

Pure (no processes)."""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
BASELINES = ROOT / "bench" / "data" / "zoo_series.json.gz"
DOCS_DIR = ROOT / "docs" / "benchmark"
FAULT_AT = (0.2, 0.6)  # fault steps, as a share of the (extended) job's steps
MIN_STEPS = 600  # each job's recorded steps repeated until it has this many (and its kind's seconds of work)
NAMED_SHARE = 0.9
FIELDS = ("step", "started_at", "ended_at", "forwards", "compute_s", "data_s", "loss", "grad_norm",
          "rss_bytes", "batch_fp", "optim_fp", "lr")
MIB = 1 << 20


@dataclass(frozen=True)
class Kind:
    name: str
    magnitudes: tuple[float, ...]  # the first is the healthy job
    unit: str
    inject: Callable[[list[dict], int, float], Optional[int]]  # records, fault index -> the faulted step
    min_seconds: float = 0.0  # the job's recorded steps repeated until it has this much work (see `extended`)

    def label(self, magnitude: float) -> str:
        if self.unit == "bytes":
            return "healthy" if magnitude == 0 else (f"{magnitude / MIB:g} MiB" if magnitude >= MIB
                                                     else f"{magnitude / 1024:g} KiB")
        return "healthy" if magnitude == 1 else f"{magnitude:g}x"


def _spike(records: list[dict], at: int, k: float) -> Optional[int]:
    for r in records[at:]:
        if r.get("grad_norm") is not None:
            r["grad_norm"] *= k
            return r["step"]
    return None


def _leak(records: list[dict], at: int, k: float) -> Optional[int]:
    for i, r in enumerate(records[at:]):
        if r.get("rss_bytes") is not None:
            r["rss_bytes"] = int(r["rss_bytes"] + k * (i + 1))
    return records[at]["step"] if at < len(records) else None


def _slow(records: list[dict], at: int, k: float) -> Optional[int]:
    for r in records[at:]:
        if r.get("compute_s") is not None:
            extra = r["compute_s"] * (k - 1)
            r["compute_s"] += extra
            r["ended_at"] += extra
    return records[at]["step"] if at < len(records) else None


KINDS = {
    "grad_spike": Kind("grad_spike", (1, 3, 10, 30, 100, 1_000, 10_000), "factor", _spike),
    "memory_growth": Kind("memory_growth", (0, 256 * 1024, 512 * 1024, MIB, 2 * MIB, 4 * MIB, 16 * MIB), "bytes", _leak),
    # persistence is judged over 5 s of the job's work: a minute of it, whatever the job's step
    "straggler": Kind("straggler", (1, 1.2, 1.3, 1.5, 2.0, 3.0), "factor", _slow, min_seconds=60.0),
}


def load_baselines(path: Path = BASELINES, min_seconds: float = 0.0) -> dict[str, dict[int, list[dict]]]:
    raw = json.loads(gzip.decompress(path.read_bytes()))
    return {job: extended({int(rank): [dict(zip(raw["fields"], row)) for row in rows] for rank, rows in ranks.items()},
                          min_seconds)
            for job, ranks in raw["jobs"].items()}


def extended(job: dict[int, list[dict]], min_seconds: float = 0.0, min_steps: int = MIN_STEPS) -> dict:
    """The recorded steps (the collector's last 256 of each rank), repeated
    until the job has `min_seconds` of work and `min_steps` steps: the checks
    that want evidence over time (a straggler over 5 s of the job's work, a
    leak over a window of steps) get it whatever the zoo job's length, so
    what is measured is the magnitude, not how many steps a job happened to
    record after the fault. Every copy keeps the recorded values (noise,
    memory, norms) as they were; steps and times move on."""
    first = min(recs[0]["step"] for recs in job.values())
    span = max(recs[-1]["step"] for recs in job.values()) - first + 1
    start = min(recs[0]["started_at"] for recs in job.values())
    duration = max(recs[-1]["ended_at"] for recs in job.values()) - start
    per_step = duration / span
    copies = max(1, math.ceil(min_seconds / max(duration, 1e-9)), math.ceil(min_steps / span))
    out = {}
    for rank, recs in job.items():
        out[rank] = [dict(r, step=r["step"] + c * span, started_at=r["started_at"] + c * (duration + per_step),
                          ended_at=r["ended_at"] + c * (duration + per_step))
                     for c in range(copies) for r in recs]
    return out


def analyse(job: dict[int, list[dict]]) -> list:
    from rankwatch import wire
    from rankwatch.collector import analyses
    from rankwatch.collector.state import RunState

    run = RunState(run_id="sensitivity", world_size=len(job))
    end = 0.0
    for rank, records in job.items():
        state = run.rank(rank)
        for r in records:
            state.add_step(wire.StepRecord(**{k: v for k, v in r.items() if v is not None}))
            end = max(end, r["ended_at"])
    return analyses.run_all(run, end + 3600.0, True)


def trial(kind: Kind, name: str, job: dict[int, list[dict]], rank: int, share: float, magnitude: float) -> dict:
    faulted = {r: [dict(rec) for rec in recs] for r, recs in job.items()}
    records = faulted[rank]
    at = min(len(records) - 1, int(share * len(records)))
    step = kind.inject(records, at, magnitude)
    found = analyse(faulted)
    out: dict[str, Any] = {"kind": kind.name, "job": name, "rank": rank, "magnitude": magnitude,
                           "fault_step": step, "verdicts": [(v.kind, v.ranks, v.step) for v in found]}
    mine = [v for v in found if v.kind == kind.name and v.ranks == [rank]]
    right = bool(mine) and (kind.name != "grad_spike" or mine[0].step == step)
    out["named"] = right
    if right and step is not None:
        out["step_error"] = mine[0].step - step
    return out


def extract(work: Path, out: Path) -> None:
    """The zoo's healthy run dirs (`<work>/<job>-s0/rankwatch-run/collector.sqlite`) -> the
    baselines file: every rank's step records, the fields above, per job (seed 0)."""
    from rankwatch.collector.store import Store

    jobs: dict[str, dict[str, list]] = {}
    for index in sorted(work.glob("*-s0/rankwatch-run/collector.sqlite")):  # one seed a job
        name = index.parent.parent.name
        report = json.loads((index.parent / "report.json").read_text()) if (index.parent / "report.json").exists() else {}
        if report.get("verdicts"):
            continue  # not a healthy run: not a baseline
        store = Store(index, readonly=True)
        try:
            run = store.load_run(store.run_ids()[0])
        finally:
            store.close()
        if run is None or len(run.ranks) < 2:
            continue
        t0 = min(s.started_at for st in run.ranks.values() for s in st.steps.values())
        jobs[name] = {str(rank): [[_compact(getattr(rec, f), f, t0) for f in FIELDS]
                                  for _, rec in sorted(st.steps.items())]
                      for rank, st in sorted(run.ranks.items())}
    out.write_bytes(gzip.compress(json.dumps({"fields": FIELDS, "jobs": jobs}, separators=(",", ":")).encode(),
                                  mtime=0))
    print(f"{len(jobs)} healthy jobs -> {out} ({out.stat().st_size} bytes)")


def _compact(value: Any, field: str, t0: float) -> Any:
    if value is None or field == "step" or isinstance(value, int):
        return value
    if field in ("started_at", "ended_at"):
        return round(value - t0, 4)
    return float(f"{value:.6g}")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated: " + ", ".join(KINDS))
    p.add_argument("--json", type=Path, help="write every trial here (JSON Lines)")
    p.add_argument("--plot", type=Path, help="named share against magnitude, one panel per kind (PNG)")
    p.add_argument("--extract", type=Path, help="rebuild the baselines from this zoo work dir, then stop")
    p.add_argument("--docs", action="store_true", help="write docs/sensitivity.md, its plot and its trials")
    a = p.parse_args(argv)
    if a.extract:
        extract(a.extract, BASELINES)
        return 0
    if a.docs:
        a.json, a.plot = DOCS_DIR / "sensitivity.jsonl", DOCS_DIR / "sensitivity.png"
    started = time.monotonic()
    trials: list[dict] = []
    summary: dict[str, list[tuple[float, int, int, int]]] = {}
    lines: list[str] = []

    def say(text: str = "") -> None:
        lines.append(text)
        print(text, flush=True)

    for kind_name in a.kinds.split(","):
        kind = KINDS[kind_name]
        jobs = load_baselines(min_seconds=kind.min_seconds)
        rows = summary[kind_name] = []
        say()
        say(f"### {kind_name} ({len(jobs)} healthy zoo jobs x 2 ranks x {len(FAULT_AT)} fault steps)")
        say()
        say("| magnitude | trials | named (right rank) | trials with another verdict "
            "| verdict step - fault step (median, max abs) |")
        say("|---|---|---|---|---|")
        for magnitude in kind.magnitudes:
            got = [trial(kind, name, job, rank, share, magnitude)
                   for name, job in sorted(jobs.items()) for rank in sorted(job) for share in FAULT_AT]
            trials += got
            named = sum(t["named"] for t in got)
            other = sum(bool(t["verdicts"]) and not t["named"] for t in got)
            rows.append((magnitude, len(got), named, other))
            errors = sorted(t["step_error"] for t in got if "step_error" in t)
            error = f"{errors[len(errors) // 2]}, {max(abs(x) for x in errors)}" if errors else ""
            healthy = magnitude == kind.magnitudes[0]
            say(f"| {kind.label(magnitude)} | {len(got)} | {'' if healthy else f'{named}/{len(got)}'} | "
                f"{f'false alarms: {other}' if healthy else other} | {error} |")
        enough = [m for m, n, named, _ in rows[1:] if named >= NAMED_SHARE * n]
        say()
        say(f"Smallest magnitude named in >= {NAMED_SHARE:.0%} of trials: "
            f"**{kind.label(min(enough)) if enough else 'none'}**.")
    print(f"\n({len(trials)} trials in {time.monotonic() - started:.0f} s)")
    if a.json:
        a.json.write_text("".join(json.dumps(t) + "\n" for t in trials))
    if a.plot:
        _plot(summary, a.plot)
    if a.docs:
        _write_docs(lines, len(trials), time.monotonic() - started)
    return 0


def _write_docs(tables: list[str], trials: int, seconds: float) -> None:
    import platform
    import subprocess

    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "bench", "collector", "rankwatch"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    head = [
        "# Sensitivity: the smallest fault each step-series check names",
        "",
        "<!-- Generated by bench/sensitivity.py --docs; edits here are overwritten. -->",
        "",
        f"Command: `python bench/sensitivity.py --docs` ({trials} trials, {seconds / 60:.0f} min); rankwatch at "
        f"`{commit}`{' with uncommitted changes' if dirty else ''}; Python {platform.python_version()}, "
        f"torch {torch.__version__}.",
        "",
        __doc__.split("\n\n", 1)[1].split("\n\n    python")[0].strip(),
        "",
        "What this does not measure: faults the agent must see first (a NaN in one element, a replica's",
        "weights moved by a zero-mean perturbation, a learning rate that differs) are judged from the",
        "agent's own digests, not from step records; they need real jobs (`bench/faultbench.py`).",
        "",
        "![named share against magnitude](benchmark/sensitivity.png)",
    ]
    (ROOT / "docs" / "sensitivity.md").write_text("\n".join(head + tables) + "\n")


def _plot(summary: dict[str, list[tuple[float, int, int, int]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summary), figsize=(4.2 * len(summary), 3.4), squeeze=False)
    for ax, (kind_name, rows) in zip(axes[0], summary.items()):
        kind = KINDS[kind_name]
        xs = [m if kind.unit == "factor" else m / MIB for m, *_ in rows[1:]]
        ax.plot(xs, [named / n for _, n, named, _ in rows[1:]], marker="o")
        ax.axhline(NAMED_SHARE, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(f"{kind_name} (false alarms: {rows[0][3]}/{rows[0][1]})", fontsize=9)
        ax.set_xlabel("factor" if kind.unit == "factor" else "MiB per step")
        ax.set_ylabel("share named (right rank)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
