"""How much of a core the running analyses of one run may use, and the step
sampling that keeps them there.

At scale the relays forward every `NodeReply.step_stride`-th step record of
each rank (and every unusual record whatever its step): `record_stride`
picks the stride from the job's record rate. What a record costs to take in
and seal depends on the machine and on the checks, so a fixed rate alone
cannot bound the collector's work: on this project's 2-core machine a
100,000-rank step took ~1.5 s of the tick thread (~15 us a record, 2026-11-28,
scratch harness over `Collector.tick`), and 20,000 records a second were
0.3 core, beside the ingest that needs the rest.

`AnalysisBudget` measures the tick thread's CPU spent on a run (its hang
watch, taking in what arrived, the analyses), over windows of WINDOW_S, and
doubles the stride
while that is over SHARE of a core, halving it again once it is under a
quarter of that (powers of two: every step a coarser stride samples, a finer
one samples too, so relays that still use the old stride send steps the new
one wants). The share comes from the collector's tick targets (100 ms of
work per second at 10,000 ranks). Records that matter on their own (a
non-finite loss or gradient, a gradient-norm jump) are forwarded at any
stride; what a coarser stride costs is time: a straggler or a leak needs its
window of sampled steps, so it is named later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

SHARE = 0.1  # of one core: the tick thread's work on one run, averaged over a window
WINDOW_S = 30.0  # long enough for a changed stride to reach every relay (one cadence: 10 s at 100,000 ranks)
MAX_SCALE = 64


@dataclass
class AnalysisBudget:
    share: float = SHARE
    window_s: float = WINDOW_S
    scale: int = 1  # the factor on the rate-based stride (a power of two)
    _cpu_s: float = field(default=0.0, repr=False)
    _since: Optional[float] = field(default=None, repr=False)

    def spent(self, cpu_s: float) -> None:
        """CPU seconds of the tick thread on this run."""
        self._cpu_s += max(0.0, cpu_s)

    def review(self, now: float) -> int:
        """At most once per window: double the scale while over the share,
        halve it while under a quarter of it. Returns the scale."""
        if self._since is None or now < self._since:
            self._since, self._cpu_s = now, 0.0
            return self.scale
        elapsed = now - self._since
        if elapsed < self.window_s:
            return self.scale
        used = self._cpu_s / elapsed
        if used > self.share and self.scale < MAX_SCALE:
            self.scale *= 2
        elif used < self.share / 4 and self.scale > 1:
            self.scale //= 2
        self._since, self._cpu_s = now, 0.0
        return self.scale
