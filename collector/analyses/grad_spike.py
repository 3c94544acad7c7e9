"""`grad_spike`: a rank's local (pre-allreduce) gradient norm is an outlier
against its peers at the same step *and* against its own recent history.

Robust statistics only (medians and MADs). Both tests are needed: the step
after a spike moves every replica's weights, so every rank's gradient jumps
against its own history, but not against its peers; a rank with
systematically different data differs from its peers, but not from itself.
"""

from __future__ import annotations

import collections
import math
import statistics
from typing import Optional

from rankwatch import wire

from ..state import RunState
from .common import paced, peer_medians, ranks_text, register_tracker, settle, tracker, verdict

RATIO = 10.0  # times the peers' median and the rank's own median
MAD_SCALE = 1.4826
MAD_K = 8.0
HISTORY = 20
# Own norms needed before judging a rank. Few: a loaded rank's agent checks
# its gradients every 4th or 8th step (cost budget), so by step 12 it may have
# 3 norms; the test against the peers at the same step carries the verdict.
WARMUP = 3


class Tracker:
    """Each rank's last HISTORY finite norms, and the first spike found.
    Per sealed step: one sort for every rank's peers' median; a rank's own
    median and MAD only when it already beats its peers' median RATIO times."""

    def __init__(self) -> None:
        self.history: dict[int, collections.deque[float]] = {}
        self.finding: Optional[dict] = None
        # The last full step's size and median: the peers' figure for a step
        # only a few ranks reported (relays at scale forward every k-th step
        # and each rank's unusual records; over thousands of peers the median
        # of one step and of the next are the same).
        self.full_size = 0
        self.full_median: Optional[float] = None

    def on_step(self, run: RunState, step: int, records: dict[int, wire.StepRecord]) -> None:
        if self.finding is not None:
            return  # the first spike is the verdict; later ones are its consequences
        at_step = {r: rec.grad_norm for r, rec in records.items()
                   if rec.grad_norm is not None and math.isfinite(rec.grad_norm)}
        if not at_step:
            return
        partial = 2 * len(at_step) < self.full_size
        if partial:
            if self.full_median is None:
                return
            peers = {r: self.full_median for r in at_step}
        else:
            peers = peer_medians(at_step)
            self.full_size, self.full_median = len(at_step), statistics.median(at_step.values())
        spiked = {}
        for rank, peer_median in paced(peers.items()):
            value = at_step[rank]
            if value <= RATIO * max(peer_median, 1e-12):
                continue
            own = self.history.get(rank)
            if own is None or len(own) < WARMUP:
                continue
            own_median = statistics.median(own)
            own_mad = statistics.median(abs(v - own_median) for v in own) * MAD_SCALE
            if value > RATIO * max(own_median, 1e-12) and value > own_median + MAD_K * own_mad:
                spiked[rank] = {"grad_norm": value, "peer_median": peer_median, "own_median": own_median,
                                "ratio_to_peers": value / max(peer_median, 1e-12)}
        size = self.full_size if partial else len(at_step)
        minority = len(spiked) < size / 2 or (size == 2 and len(spiked) == 1)
        if spiked and minority:
            self.finding = {"step": step, "spiked": spiked,
                            "first_at": min(records[r].ended_at for r in spiked)}
            return
        if partial:
            return  # a rank's own history holds the steps every rank reported
        for rank, value in paced(at_step.items()):
            own = self.history.get(rank)
            if own is None:
                own = self.history[rank] = collections.deque(maxlen=HISTORY)
            own.append(value)


register_tracker("grad_spike", Tracker)


def detect(run: RunState, now: float, final: bool) -> list[wire.Verdict]:
    settle(run, final)
    finding = tracker(run, "grad_spike").finding
    if finding is None:
        return []
    step, spiked = finding["step"], finding["spiked"]
    worst = max(spiked.values(), key=lambda d: d["ratio_to_peers"])
    summary = (f"{ranks_text(spiked).capitalize()} had a local gradient norm of {worst['grad_norm']:.3g} at step "
               f"{step}, {worst['ratio_to_peers']:.0f}x its peers' median ({worst['peer_median']:.3g}) and "
               f"{worst['grad_norm'] / max(worst['own_median'], 1e-12):.0f}x its own recent median, before "
               f"the allreduce spread it to every replica. Check that rank's batch at that step.")
    return [verdict("grad_spike", spiked, step, finding["first_at"], now, summary,
                    {"ranks": {str(r): dict(d) for r, d in spiked.items()}})]
