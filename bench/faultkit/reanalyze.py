"""The recorded rankwatch runs of a faultbench work dir, analysed again by
this checkout's collector: which verdicts change, and whether each change
is right.

    python bench/faultbench.py --reanalyze DIR

Each run's collector data (``DIR/work/<run>/rankwatch/...``: the run dir
`rankwatch run` wrote, or the Ray job's) goes through the offline analysis
(`rankwatch.collector.offline.load` and `analyses.run_all`, the code the live
collector runs) and is compared with the verdicts the run recorded. The
agent's side stays what the run's commit measured: this checks the analyses
alone, and a published table still comes from whole runs of one commit.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from . import scoring


def run_dir(work: Path, run_id: str) -> Optional[Path]:
    """Where the watched run's collector data is (torchrun shapes, or Ray's storage)."""
    base = work / "work" / run_id / "rankwatch"
    candidates = [base / "rankwatch-run", *sorted((base / "ray_results").glob("*/rankwatch"))]
    return next((c for c in candidates if (c / "collector.sqlite").exists() or (c / "report.json").exists()), None)


def reanalyze(work: Path, runs: list[dict]) -> list[dict]:
    """One row per run whose verdicts changed: run id, truth, before, after, and
    whether each side is correct (scoring.is_correct)."""
    from rankwatch.collector.analyses import run_all
    from rankwatch.collector.offline import load

    rows = []
    for run in runs:
        answer = (run.get("tools") or {}).get("rankwatch")
        path = run_dir(work, run["run_id"])
        if answer is None or path is None:
            continue
        state, _ = load(path)
        after = [{"kind": v.kind, "ranks": list(v.ranks), "step": v.step} for v in run_all(state, time.time(), True)]
        before = [{"kind": v["kind"], "ranks": v["ranks"], "step": v.get("step")} for v in answer.get("verdicts") or []]
        if _said(before) == _said(after):
            continue
        injected = answer.get("injected") or {}
        rows.append({"run_id": run["run_id"], "expected": run.get("expected"), "rank": run.get("rank"),
                     "step": injected.get("step", run.get("step")),
                     "before": before, "after": after,
                     "right_before": _right(before, run), "right_after": _right(after, run)})
    return rows


def _said(verdicts: list[dict]) -> list[tuple]:
    return [(v["kind"], tuple(v["ranks"] or ()), v.get("step")) for v in verdicts]


def _right(verdicts: list[dict], run: dict) -> bool:
    if run["kind"] == scoring.HEALTHY:
        return not verdicts
    return any(scoring.is_correct(v, run) for v in verdicts)


def text(rows: list[dict], total: int) -> str:
    def said(verdicts: list[dict]) -> str:
        return ", ".join(f"{v['kind']}{v['ranks']}@{v['step']}" for v in verdicts) or "-"

    lines = [f"{len(rows)} of {total} runs read differently:"]
    for row in rows:
        mark = {(False, True): "fixed", (True, False): "BROKEN"}.get((row["right_before"], row["right_after"]),
                                                                      "changed")
        truth = f"{row['expected']}[{row['rank']}]@{row['step']}" if row["expected"] else "healthy"
        lines.append(f"  {mark:7} {row['run_id']} (truth {truth}): {said(row['before'])} -> {said(row['after'])}")
    return "\n".join(lines)
