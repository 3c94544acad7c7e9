"""`grad_spike`: a rank's local (pre-allreduce) gradient norm is an outlier
against its peers at the same step *and* against its own recent history.

Robust statistics only (medians and MADs). Both tests are needed: the step
after a spike moves every replica's weights, so every rank's gradient jumps
against its own history, but not against its peers; a rank with
systematically different data differs from its peers, but not from itself.
"""

from __future__ import annotations

import math
import statistics

from rankwatch import wire

from ..state import RunState
from .common import ranks_text, verdict

RATIO = 10.0  # times the peers' median and the rank's own median
MAD_SCALE = 1.4826
MAD_K = 8.0
HISTORY = 20
WARMUP = 5  # steps of history needed before judging a rank


def _norms(run: RunState) -> dict[int, dict[int, float]]:
    out: dict[int, dict[int, float]] = {}
    for rank, state in run.ranks.items():
        for record in state.steps.values():
            if record.grad_norm is not None and math.isfinite(record.grad_norm):
                out.setdefault(record.step, {})[rank] = record.grad_norm
    return out


def detect(run: RunState, now: float, final: bool) -> list[wire.Verdict]:
    norms = _norms(run)
    history: dict[int, list[float]] = {}
    for step in sorted(norms):
        at_step = norms[step]
        spiked = {}
        for rank, value in at_step.items():
            own = history.get(rank, [])[-HISTORY:]
            peers = [v for r, v in at_step.items() if r != rank]
            if len(own) >= WARMUP and peers:
                own_median = statistics.median(own)
                own_mad = statistics.median(abs(v - own_median) for v in own) * MAD_SCALE
                peer_median = statistics.median(peers)
                if (value > RATIO * max(peer_median, 1e-12) and value > RATIO * max(own_median, 1e-12)
                        and value > own_median + MAD_K * own_mad):
                    spiked[rank] = {"grad_norm": value, "peer_median": peer_median, "own_median": own_median,
                                    "ratio_to_peers": value / max(peer_median, 1e-12)}
        minority = len(spiked) < len(at_step) / 2 or (len(at_step) == 2 and len(spiked) == 1)
        if spiked and minority:
            first = min(run.ranks[r].steps[step].ended_at for r in spiked if step in run.ranks[r].steps) \
                if all(step in run.ranks[r].steps for r in spiked) else now
            worst = max(spiked.values(), key=lambda d: d["ratio_to_peers"])
            summary = (f"{ranks_text(spiked).capitalize()} had a local gradient norm of {worst['grad_norm']:.3g} at step "
                       f"{step}, {worst['ratio_to_peers']:.0f}x its peers' median ({worst['peer_median']:.3g}) and "
                       f"{worst['grad_norm'] / max(worst['own_median'], 1e-12):.0f}x its own recent median, before "
                       f"the allreduce spread it to every replica. Check that rank's batch at that step.")
            return [verdict("grad_spike", spiked, step, first, now, summary,
                            {"ranks": {str(r): d for r, d in spiked.items()}})]
        for rank, value in at_step.items():
            history.setdefault(rank, []).append(value)
    return []
