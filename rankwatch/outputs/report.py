"""report.json on disk (strict JSON, written atomically) and the human
summary printed at the end of a run and by `rankwatch analyze`."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from rankwatch import wire


def write(report: wire.Report, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # launchers of several nodes may share the run dir
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
    ending = report.termination
    if ending is not None:
        who = "the scheduler" if ending.by == "scheduler" else "a signal from outside"
        lines.append(f"  ended by {who}: {ending.reason.replace('_', ' ')} ({ending.signal} at {ending.at}; "
                     f"{ending.source})")
    for note in report.notes:
        lines.append(f"  note: {note}")
    for v in report.verdicts:
        ranks = ",".join(map(str, v.ranks)) or "-"
        step = "-" if v.step is None else str(v.step)
        lines.append(f"  [{v.kind}] rank(s) {ranks} at step {step}: {v.summary}")
    return "\n".join(lines)
