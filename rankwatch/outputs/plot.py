"""``rankwatch analyze PATH --plot FILE.png``: a run's per-rank picture.

Heatmaps of step time and of each rank's own compute time (ranks x steps, the
rank that stands out is a bright row), the last step each rank reached, and
the verdicts marked at their step with their culprit ranks.
"""

from __future__ import annotations

import math
from pathlib import Path

from rankwatch import wire

KIND_COLOURS = {"hang": "#d62728", "collective_mismatch": "#9467bd", "crash": "#8c564b", "nonfinite": "#e377c2",
                "grad_spike": "#ff7f0e", "weight_divergence": "#17becf", "straggler": "#1f77b4",
                "oom": "#7f7f7f", "memory_growth": "#bcbd22",
                "config_divergence": "#aec7e8", "duplicate_data": "#ffbb78", "broken_update": "#98df8a"}


def _matrix(run, field: str, ranks: list[int], steps: list[int]):
    import numpy as np

    grid = np.full((len(ranks), len(steps)), np.nan)
    index = {s: i for i, s in enumerate(steps)}
    for row, rank in enumerate(ranks):
        for record in run.ranks[rank].steps.values():
            if record.step in index:
                if field == "step":
                    value = record.ended_at - record.started_at
                else:
                    value = getattr(record, field)
                if value is not None and math.isfinite(value):
                    grid[row, index[record.step]] = value * 1e3
    return grid


def plot(run, report: wire.Report, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ranks = sorted(run.ranks)
    steps = sorted({s for r in ranks for s in run.ranks[r].steps})
    fig = plt.figure(figsize=(13, 3.2 + 0.9 * max(2, len(ranks))), constrained_layout=True)
    grid = fig.add_gridspec(2, 2, width_ratios=[5, 1])
    panels = [("step", "Step time (ms): the same on every rank, the allreduce waits for the slowest"),
              ("compute_s", "Own time per step (ms): data + forward + backward, waiting excluded")]
    culprits = {r for v in report.verdicts for r in v.ranks}
    for row, (field, title) in enumerate(panels):
        ax = fig.add_subplot(grid[row, 0])
        data = _matrix(run, field, ranks, steps) if steps else np.zeros((len(ranks), 1))
        body = data[:, 2:] if data.shape[1] > 4 else data  # the first steps are start-up
        finite = body[np.isfinite(body)]
        vmax = float(np.percentile(finite, 98)) if finite.size else 1.0
        image = ax.imshow(data, aspect="auto", interpolation="nearest", cmap="magma", vmin=0, vmax=max(vmax, 1e-3),
                          extent=(steps[0] - 0.5 if steps else -0.5, steps[-1] + 0.5 if steps else 0.5,
                                  len(ranks) - 0.5, -0.5))
        ax.set_yticks(range(len(ranks)))
        ax.set_yticklabels([f"rank {r}" + (" \u25c0" if r in culprits else "") for r in ranks])
        for label, rank in zip(ax.get_yticklabels(), ranks):
            if rank in culprits:
                label.set_color("#d62728")
                label.set_fontweight("bold")
        ax.set_xlabel("optimizer step")
        ax.set_title(title, fontsize=10, loc="left")
        fig.colorbar(image, ax=ax, label="ms", pad=0.01)
        for verdict in report.verdicts:
            if verdict.step is None:
                continue
            colour = KIND_COLOURS.get(verdict.kind, "white")
            ax.axvline(verdict.step, color=colour, linewidth=2, linestyle="--")
            for rank in verdict.ranks:
                if rank in ranks:
                    y = ranks.index(rank)
                    ax.plot([verdict.step], [y], marker="o", markersize=10, markerfacecolor="none",
                            markeredgecolor=colour, markeredgewidth=2.5)
        handles = [plt.Line2D([0], [0], color=KIND_COLOURS.get(v.kind, "white"), linestyle="--", linewidth=2,
                              label=f"{v.kind}: rank {','.join(map(str, v.ranks))}, step {v.step}")
                   for v in report.verdicts if v.step is not None]
        if handles and row == 0:
            ax.legend(handles=handles, loc="upper right", fontsize=8, framealpha=0.85)
    ax = fig.add_subplot(grid[:, 1])
    last = [run.ranks[r].step for r in ranks]
    colours = ["#d62728" if r in culprits else "#4c72b0" for r in ranks]
    ax.barh(range(len(ranks)), last, color=colours)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("last step reached")
    ax.set_title("Last progress", fontsize=10, loc="left")
    status = report.status.upper()
    lines = [f"{v.kind}: rank(s) {','.join(map(str, v.ranks))} at step {v.step}" for v in report.verdicts[:4]]
    fig.suptitle(f"rankwatch run {report.run_id} ({report.world_size} ranks): {status}"
                 + ("\n" + "; ".join(lines) if lines else ""), fontsize=11, x=0.01, ha="left")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
