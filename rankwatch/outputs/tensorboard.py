"""``rankwatch analyze PATH --tensorboard DIR``: per-rank series as
TensorBoard scalars and the verdicts as text (the `tensorboard` extra)."""

from __future__ import annotations

import math
from pathlib import Path

from rankwatch import wire


def export(run, report: wire.Report, logdir: Path) -> Path:
    """Per-rank series as TensorBoard scalars, verdicts as text (optional extra)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise RuntimeError("TensorBoard export needs the tensorboard package: pip install 'rankwatch[tensorboard]'") from exc
    logdir = Path(logdir)
    for rank, state in sorted(run.ranks.items()):
        writer = SummaryWriter(log_dir=str(logdir / f"rank{rank}"))
        for record in state.steps.values():
            step_time = record.ended_at - record.started_at
            writer.add_scalar("rankwatch/step_seconds", step_time, record.step, walltime=record.ended_at)
            for name in ("compute_s", "data_s", "loss", "grad_norm", "rss_bytes", "device_allocated_bytes"):
                value = getattr(record, name)
                if value is not None and math.isfinite(value):
                    writer.add_scalar(f"rankwatch/{name}", value, record.step, walltime=record.ended_at)
        writer.close()
    writer = SummaryWriter(log_dir=str(logdir / "verdicts"))
    for i, v in enumerate(report.verdicts):
        writer.add_text(f"verdicts/{v.kind}", f"**rank(s) {v.ranks}**, step {v.step}: {v.summary}", v.step or i)
    writer.add_text("report/status", f"{report.status}: {len(report.verdicts)} verdict(s)", 0)
    writer.close()
    return logdir
