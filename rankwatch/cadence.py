"""How often a job's node relays report, and how long they pause after
failures: rules both sides keep. The collector asks for its cadence in each
reply and judges a relay silent past its longest pause; a relay starts at
the cadence for its job's world size before any reply and backs off within
that pause. Standard library only (the relay runs beside the training)."""

from __future__ import annotations

from typing import Optional

MAX_BACKOFF_S = 60.0  # the longest pause between tries (jittered): a 100k-rank job's 12,500 relays
# return from an outage spread over up to a minute, not in one burst
BACKOFF_CADENCES = 6  # ... and at most this many of the job's cadences: the cadence grows with the job
# (1 s to 2,000 ranks, 10 s at 100,000), so a 10,000-rank job's 1,250 relays return within ~12 s
# (~100 reports/s, a fifth of what one collector takes), not a minute of ranks unheard from


def node_report_interval(world_size: int, hang_timeout: float = 20.0) -> Optional[float]:
    """The node relays' cadence the collector asks for: every second up to
    2,000 ranks, 2 s up to 10,000, 5 s up to 50,000, 10 s beyond (about
    1,250 requests a second at 100,000 ranks), and never more than half the
    hang timeout. Progress is dated by the agents (RunState.observe_heartbeat),
    so the cadence delays what the collector sees, not when it calls a hang;
    the bound keeps a live rank's latest progress inside the timeout."""
    if world_size <= 2_000:
        return None
    wanted = 2.0 if world_size <= 10_000 else 5.0 if world_size <= 50_000 else 10.0
    return max(1.0, min(wanted, hang_timeout / 2))


def backoff_cap(interval: float) -> float:
    """The longest pause after failures for a relay at this cadence."""
    return max(interval, min(MAX_BACKOFF_S, BACKOFF_CADENCES * interval))


def longest_relay_silence(interval: float) -> float:
    """How long a live relay at this cadence can go unheard: its longest
    pause between tries and one cadence more. Past it, its ranks are judged
    on what is known (the collector's backlog and hang rules)."""
    return backoff_cap(interval) + interval
