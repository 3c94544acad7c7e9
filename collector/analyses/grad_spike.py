"""`grad_spike`: a rank's local (pre-allreduce) gradient norm is an outlier
against its peers at the same step, against its own recent history, *and*
against the run's own spread of per-rank norms over a long window.

Robust statistics only (medians, MADs, the window's extremes). The peers'
and own tests are both needed: the step after a spike moves every replica's
weights, so every rank's gradient jumps against its own history, but not
against its peers; a rank with systematically different data differs from
its peers, but not from itself. The run-level test is what keeps healthy
jobs quiet: per-rank gradient norms are heavy-tailed (near convergence one
hard or mislabelled example on one rank gives 10-100x its peers' median, and
10x its own, dozens of times in a long run), so a spike must be far beyond
anything the run has shown in healthy steps:

- its ratio to the peers' median beats the largest ratio of every healthy
  step so far by MARGIN (until the window holds EARLY_VALUES values, an
  absolute EARLY_RATIO stands in for the extremes not yet seen);
- the norm beats RATIO x the median of every rank's norms over the window
  (when most ranks' gradients vanish near convergence, a peers' median of
  0.005 makes any ordinary norm a "spike");
- and RATIO x its own recent median (+ MAD_K MADs), as before.

A rank with too few norms of its own to judge (the first steps, or a rank
whose agent samples its gradients every 4th or 8th step) that beats its
peers and the run's bound is held as a candidate, its norm kept out of every
window; it is judged against its own history once that holds WARMUP norms
from the steps after it (a spike passes, a rank that stays high, one with
systematically different data, does not). The verdict keeps the spike's
step. Without that, a spike in the first steps was never judged, and its
ratio became the run's "largest healthy" one.

`bench/grad_spike_false_alarms.py` measures the false alarms per 10,000
steps on healthy runs of several shapes and the smallest spike still caught.
"""

from __future__ import annotations

import collections
import statistics
from typing import Optional

import numpy as np

from rankwatch import wire

from ..state import RunState
from .common import (RankRows, margins, note_margin, peer_medians_of, ranks_text, register_tracker, settle, tracker,
                     verdict)

RATIO = 10.0  # times the peers' median, the rank's own median and the run's median
MAD_SCALE = 1.4826
MAD_K = 8.0
HISTORY = 20
# Own norms needed before judging a rank. Few: a loaded rank's agent checks
# its gradients every 4th or 8th step (cost budget), so by step 12 it may have
# 3 norms; the test against the peers at the same step carries the verdict.
WARMUP = 3
# The run's spread: the last WINDOW per-rank norms and their ratios to the
# peers' median (bounded: the same cost at step 10 and at step 10^6).
WINDOW = 4096
PER_STEP_KEPT = 64  # per-rank values a step adds to the window at most (an even spread of its ranks)
MARGIN = 10.0  # times beyond the largest peers' ratio of the window
EARLY_RATIO = 100.0  # times the peers' median, while the window holds fewer than EARLY_VALUES
EARLY_VALUES = 256
MAX_CANDIDATES = 64  # ranks held for want of their own history, at most


class _Histories:
    """Each rank's last HISTORY finite norms in one (HISTORY x ranks) ring of
    floats, a column per rank in the order ranks were first seen (a deque per
    rank cost ~0.1 s a 100,000-rank step to append to). Only medians are
    taken of a rank's norms, so their order in the ring does not matter."""

    def __init__(self) -> None:
        self.column = RankRows()  # rank -> column, in the order ranks were first seen
        self.values = np.zeros((HISTORY, 64))
        self.count = np.zeros(64, np.int64)
        self._last: Optional[tuple[list[int], np.ndarray]] = None  # (a step's ranks, their columns)

    def own(self, rank: int) -> Optional[list[float]]:
        """The rank's norms (at most HISTORY), or None before its first."""
        at = self.column.get(rank)
        if at is None:
            return None
        return self.values[:min(int(self.count[at]), HISTORY), at].tolist()

    def append(self, ranks: list[int], values: np.ndarray) -> None:
        at = self._columns(ranks)
        self.values[self.count[at] % HISTORY, at] = values
        self.count[at] += 1

    def _columns(self, ranks: list[int]) -> np.ndarray:
        """The columns of ``ranks`` (distinct), made for new ranks; reused
        while a step's ranks come as the last one's did."""
        last = self._last
        if last is not None and last[0] == ranks:
            return last[1]
        at, new = self.column.rows(ranks)
        if len(self.column) > len(self.count):
            width = max(len(self.column), 2 * len(self.count))
            self.values = np.concatenate([self.values, np.zeros((HISTORY, width - len(self.count)))], axis=1)
            self.count = np.concatenate([self.count, np.zeros(width - len(self.count), np.int64)])
        self._last = (ranks, at)
        return at


class Tracker:
    """Each rank's last HISTORY finite norms, the run's window of norms and
    peers' ratios, and the first spike found. Per sealed step: one sort for
    every rank's peers' median; the window's median and extremes only when a
    rank already beats its peers' median RATIO times (rare)."""

    def __init__(self) -> None:
        self.history = _Histories()
        self.finding: Optional[dict] = None
        # The last full step's size and median: the peers' figure for a step
        # only a few ranks reported (relays at scale forward every k-th step
        # and each rank's unusual records; over thousands of peers the median
        # of one step and of the next are the same).
        self.full_size = 0
        self.full_median: Optional[float] = None
        self.norms: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.ratios: collections.deque[float] = collections.deque(maxlen=WINDOW)
        # The largest peers' ratio of every healthy step so far: a heavy tail
        # shows its extremes rarely, and one that left the window is still
        # part of what this run does when healthy.
        self.peak_ratio = 0.0
        # rank -> a spike seen before the rank had WARMUP norms of its own (see the module's doc).
        self.candidates: dict[int, dict] = {}

    def run_bound(self) -> tuple[float, Optional[float]]:
        """(the peers' ratio a spike must beat, the run's median norm or None
        before any)."""
        bound = MARGIN * self.peak_ratio
        if len(self.ratios) < EARLY_VALUES:
            bound = max(EARLY_RATIO, bound)
        return max(bound, RATIO), (statistics.median(self.norms) if self.norms else None)

    def on_step(self, run: RunState, step: int, records: dict[int, wire.StepRecord]) -> None:
        if self.finding is not None:
            return  # the first spike is the verdict; later ones are its consequences
        # The step in columns, in the records' order: every rank's finite norm.
        norms = np.array([rec.grad_norm for rec in records.values()], dtype=float)  # None -> nan
        finite = np.isfinite(norms)
        if finite.all():
            ranks, values = list(records), norms
        else:
            at = np.flatnonzero(finite)
            if not len(at):
                return
            every = list(records)
            ranks, values = [every[i] for i in at.tolist()], norms[at]
        n = len(ranks)
        # A step few ranks reported, or one rank alone in a job of several
        # (each rank's agent samples its gradients at its own stride, so at a
        # few ranks most sampled steps have no peer): the peers' figure is the
        # last full step's median.
        partial = 2 * n < self.full_size or (n == 1 and len(run.ranks) > 1)
        if partial:
            if self.full_median is None:
                return
            peers = np.full(n, self.full_median)
        else:
            peers = peer_medians_of(values) if n > 1 else np.zeros(0)  # a rank alone has no peers
            self.full_size, self.full_median = n, float(np.median(values))
        # Every rank's ratio to its peers in a few array operations; only the
        # ranks beyond RATIO x their peers (rare) are looked at one by one.
        ratios = values[:len(peers)] / np.maximum(peers, 1e-12)
        spiked = {}
        held: dict[int, dict] = {}
        bound: Optional[tuple[float, Optional[float]]] = None
        for i in np.flatnonzero(ratios > RATIO * (1 - 1e-9)).tolist():  # a superset: checked below
            rank, value, peer_median = ranks[i], float(values[i]), float(peers[i])
            if value <= RATIO * max(peer_median, 1e-12):
                continue
            own = self.history.own(rank)
            if own is None or len(own) < WARMUP:
                if rank not in self.candidates and len(self.candidates) < MAX_CANDIDATES:
                    if bound is None:
                        bound = self.run_bound()
                    ratio = value / max(peer_median, 1e-12)
                    if ratio > bound[0]:
                        held[rank] = {"step": step, "grad_norm": value, "peer_median": peer_median,
                                      "ratio_to_peers": ratio, "largest_healthy_ratio": self.peak_ratio or None,
                                      "first_at": records[rank].ended_at}
                continue
            own_median = statistics.median(own)
            own_mad = statistics.median(abs(v - own_median) for v in own) * MAD_SCALE
            if not (value > RATIO * max(own_median, 1e-12) and value > own_median + MAD_K * own_mad):
                continue
            if bound is None:
                bound = self.run_bound()
            ratio_bound, run_median = bound
            ratio = value / max(peer_median, 1e-12)
            if ratio <= ratio_bound or (run_median is not None and value <= RATIO * max(run_median, 1e-12)):
                continue
            spiked[rank] = {"grad_norm": value, "peer_median": peer_median, "own_median": own_median,
                            "ratio_to_peers": ratio, "run_median": run_median,
                            "largest_healthy_ratio": self.peak_ratio or None}
        if not partial and n > 1:
            top = int(np.argmax(ratios))  # the first of equals
            self._note_margin(run, step, float(values[top]), float(peers[top]), ranks[top])
        size = self.full_size if partial else n
        outliers = len(spiked) + len(held)
        minority = outliers < size / 2 or (size == 2 and outliers == 1)
        if spiked and minority:
            self.finding = {"step": step, "spiked": spiked,
                            "first_at": min(records[r].ended_at for r in spiked)}
            return
        if held and minority:
            self.candidates.update(held)
        if partial:
            return  # a rank's own history and the run's window hold the steps every rank reported
        self._judge_candidates(run, step)
        if self.finding is not None:
            return
        held_now = {r for r, found in self.candidates.items() if found["step"] == step}
        keep = np.ones(n, bool)
        if held_now:  # a candidate's norm stays out of every window
            keep[[i for i, r in enumerate(ranks) if r in held_now]] = False
            self.history.append([r for r in ranks if r not in held_now], values[keep])
        else:
            self.history.append(ranks, values)
        order = np.argsort(np.array(ranks, np.int64), kind="stable")  # by rank (a sort in C)
        if n > PER_STEP_KEPT:  # a big job: an even spread of its ranks, the same cost per step
            order = order[(np.arange(PER_STEP_KEPT) * (n / PER_STEP_KEPT)).astype(np.int64)]
        order = order.tolist()
        for i in order:
            if not keep[i]:
                continue
            self.norms.append(float(values[i]))
            if len(ratios):
                self.ratios.append(float(values[i]) / max(float(peers[i]), 1e-12))
        if len(ratios) and keep.any():
            self.peak_ratio = max(self.peak_ratio, float(ratios[keep].max()))

    def _judge_candidates(self, run: RunState, step: int) -> None:
        """Candidates whose rank now has WARMUP norms of its own after the
        candidate's step: a spike if the candidate beats that history and the
        run's median norm as a spike with history would; else dropped."""
        for rank, found in list(self.candidates.items()):
            own = self.history.own(rank)
            if found["step"] >= step or own is None or len(own) < WARMUP:
                continue
            del self.candidates[rank]
            value = found["grad_norm"]
            own_median = statistics.median(own)
            own_mad = statistics.median(abs(v - own_median) for v in own) * MAD_SCALE
            run_median = statistics.median(self.norms) if self.norms else None
            if not (value > RATIO * max(own_median, 1e-12) and value > own_median + MAD_K * own_mad):
                continue
            if run_median is not None and value <= RATIO * max(run_median, 1e-12):
                continue
            first_at = found.pop("first_at")
            spike_step = found.pop("step")
            self.finding = {"step": spike_step, "first_at": first_at,
                            "spiked": {rank: {**found, "own_median": own_median, "run_median": run_median,
                                              "judged_after": True}}}
            return


    def _note_margin(self, run: RunState, step: int, value: float, peer_median: float, top: int) -> None:
        """How close the step's most outlying rank came to a verdict. A spike
        must beat all three bounds (its peers, the run's median norm, its own
        history), so the margin is the smallest of its three ratios to them:
        one test alone (a rank 5x its peers on a step whose norm is ordinary
        for the run) is not half a spike. The other two are computed only
        when the peers' ratio would raise the run's margin."""
        ratio_bound = max(RATIO, MARGIN * self.peak_ratio, EARLY_RATIO if len(self.ratios) < EARLY_VALUES else 0.0)
        margin = value / max(peer_median, 1e-12) / ratio_bound
        if margin <= margins(run).get("grad_spike", {}).get("margin", 0.0):
            return
        if self.norms:  # the run's median norm (one sort of the window, only on a new worst step)
            margin = min(margin, value / (RATIO * max(statistics.median(self.norms), 1e-12)))
        own = self.history.own(top)
        if own and len(own) >= WARMUP:
            own_median = statistics.median(own)
            own_mad = statistics.median(abs(v - own_median) for v in own) * MAD_SCALE
            margin = min(margin, value / max(RATIO * own_median, own_median + MAD_K * own_mad, 1e-12))
        note_margin(run, "grad_spike", margin, step, top)


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
               f"the allreduce spread it to every replica; the largest such ratio of the run's healthy steps "
               f"so far was {_times(worst.get('largest_healthy_ratio'))}. Check that rank's batch at that step.")
    return [verdict("grad_spike", spiked, step, finding["first_at"], now, summary,
                    {"ranks": {str(r): dict(d) for r, d in spiked.items()}})]


def _times(ratio: Optional[float]) -> str:
    return "not yet known" if ratio is None else f"{ratio:.1f}x"
