"""report.json (CONTRACT.md) and its human summary."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from rankwatch import wire

from .state import RunState


def build(run: RunState, verdicts: list[wire.Verdict]) -> wire.Report:
    world = run.world_size or (max(run.ranks) + 1 if run.ranks else 0)
    ordered = list(verdicts)  # run_all orders them: root causes first
    return wire.Report(run_id=run.run_id, world_size=world,
                       status="faulty" if ordered else "healthy", verdicts=ordered, notes=notes(run))


def notes(run: RunState) -> list[str]:
    """Gradient-flow observations, once per kind (every rank reports the same)."""
    out = []
    for kind, text in (("unused_parameters", "never received a gradient in the first steps"),
                       ("zero_gradients", "always had an exactly zero gradient")):
        for rank in sorted(run.ranks):
            event = next((e for e in run.ranks[rank].events if e.kind == kind), None)
            if event is not None:
                names = event.details.get("parameters") or []
                out.append(f"parameters that {text} (rank {rank}): {', '.join(map(str, names[:10]))}")
                break
    return out


def write(report: wire.Report, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(wire.json_text(wire.to_dict(report), indent=2) + "\n")  # strict JSON: NaN as "NaN"
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()  # a full disk leaves no half-written file behind
        raise


def text(report: wire.Report) -> str:
    lines = [f"rankwatch: run {report.run_id} ({report.world_size} ranks): {report.status.upper()}"]
    if not report.verdicts:
        lines.append("  no faults found")
    for note in report.notes:
        lines.append(f"  note: {note}")
    for v in report.verdicts:
        ranks = ",".join(map(str, v.ranks)) or "-"
        step = "-" if v.step is None else str(v.step)
        lines.append(f"  [{v.kind}] rank(s) {ranks} at step {step}: {v.summary}")
    return "\n".join(lines)
