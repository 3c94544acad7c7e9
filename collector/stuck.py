"""Naming a stall and ending the job are separate (CONTRACT.md, additions
2026-11-25).

A stall is *named* once no rank has made progress for the hang timeout
(`naming_timeout`): fast, so a person sees which rank, where, and what the
others wait in. With `on_hang: abort` the job is *ended* only once the
stalled ranks are shown to be stuck (`stuck`), never for a stall that ends by
itself (a checkpoint upload, a long rank-0 evaluation): that one becomes a
note in the report.

A culprit rank counts as stuck when one of these holds:
1. idle: over the last `window` seconds (the hang timeout, at least 15 s)
   its process, rankwatch's own threads and the communication libraries'
   polling threads left out, used under 0.1 % of one CPU core (threads and
   child processes together), read or wrote no file bytes (/proc rchar +
   wchar), and its threads woke under once a second (context switches: a
   thread that waits on a socket for an upload wakes as bytes go out; a
   thread asleep or blocked for good never does; file bytes and wake-ups
   are those of the threads that run Python, since native library threads
   such as OpenMP's wake on timers of their own, see agent/core/activity.py). A
   rank asleep, blocked in a collective the
   others never join or on a lock does nothing; a rank uploading,
   evaluating or writing does. (Sampled by the rank's agent, agent/core/activity.py,
   from 2 s without progress.)
2. frozen: its heartbeat thread has been silent that long while its node
   vouches it is alive (the interpreter cannot run: frozen holding the GIL,
   or stopped).
3. exited: it left while the others wait for it.
4. busy past the abort bound: it keeps a CPU busy (or moves bytes) but the
   job has made no progress for `abort_timeout` (default max(300 s, 10 x the
   hang timeout); checkpoint_timeout while it is in a known slow phase:
   checkpoint, compile, start-up). An infinite loop cannot be told from long
   work by any outside measure; this bound is what ends it.
Every culprit must be stuck (two culprits where one works are not stuck).
"""

from __future__ import annotations

from typing import Any, Optional

from .state import Incident, RunState

IDLE_CPU_SHARE = 0.001  # of one core: pollers (a progress bar, a queue with a timeout) use ~0.001 %; a
# throttled 2 MB/s HTTP upload ~0.3 %; a rank asleep 0 (the communication threads left out)
IDLE_WAKEUPS_PER_S = 1.0  # context switches: pollers wake ~0.1-0.2 a second each; a socket upload ~3+
WINDOW_FLOOR_S = 15.0  # longer than TCP's first retransmission back-offs (1+2+4+8 s): a network hiccup is not "stuck"
BUSY_BOUND_FLOOR_S = 300.0
BUSY_BOUND_MULTIPLIER = 10.0
SLOW_PHASES = ("checkpoint", "compile", "startup", "setup", "init_process_group")


def naming_timeout(run: RunState, config: Any) -> float:
    """Seconds without progress before a stall is named."""
    timeout = run.adaptive_timeout(config.startup_timeout, config.adaptive_floor, config.adaptive_multiplier,
                                   getattr(config, "adaptive_margin", 2.0))
    if run.ranks_reported == 0 or run.ranks_reported < run.world_size:
        # Start-up: workers still import torch and join the rendezvous (slow
        # on a loaded node). Even a fixed --hang-timeout waits this long for
        # every rank's first word; a rank that never reports is still caught.
        timeout = max(timeout, config.startup_timeout)
    return timeout


def abort_timeout(run: RunState, config: Any, timeout: float, culprits: list[int]) -> float:
    """How long a busy culprit may go without progress before the job is ended."""
    fixed = getattr(config, "hang_abort_timeout", None)
    if fixed is not None:
        return float(fixed)
    bound = max(BUSY_BOUND_FLOOR_S, BUSY_BOUND_MULTIPLIER * timeout)
    if any(run.ranks[r].phase in SLOW_PHASES for r in culprits if r in run.ranks):
        bound = max(bound, config.checkpoint_timeout)
    return bound


def stuck(run: RunState, incident: Incident, culprits: list[int], now: float, config: Any,
          stale_after: float) -> Optional[dict[str, Any]]:
    """Why the culprits are stuck (the rule and its figures), or None while
    any of them may still be working."""
    timeout = incident.timeout or naming_timeout(run, config)
    window = max(WINDOW_FLOOR_S, timeout)
    stalled = now - incident.last_progress_at
    per_rank: dict[str, Any] = {}
    heard: Optional[bool] = None  # whether any rank is heard: O(ranks), taken once and only when needed
    for rank in culprits:
        state = run.ranks.get(rank)
        if state is None:
            return None
        if state.exit_code is not None:
            per_rank[str(rank)] = {"rule": "exited", "exit_code": state.exit_code}
            continue
        silent = state.silent_for(now)
        if silent >= max(window, stale_after) and not state.vouched_at and heard is None:
            heard = _job_heard(run, now, stale_after)
        if silent >= max(window, stale_after) and (state.vouched_at or heard):
            # Silent while its node's supervisor still vouched for it (or,
            # without one, while other ranks are heard): the rank's own
            # silence. When nothing of the job is heard, the collector lost
            # contact (a network cut, its relays down): nothing is shown.
            per_rank[str(rank)] = {"rule": "frozen", "heartbeat_silent_s": round(silent, 1)}
            continue
        idle = _idle(state.activity, now, window)
        if idle is not None:
            per_rank[str(rank)] = idle
            continue
        per_rank = {}
        break
    if per_rank:
        return {"rule": _rule_text(per_rank), "window_s": round(window, 1), "ranks": per_rank,
                "stalled_for_s": round(stalled, 1)}
    bound = abort_timeout(run, config, timeout, culprits)
    if stalled >= bound:
        return {"rule": f"no progress for {stalled:.0f} s, past the abort bound of {bound:.0f} s, "
                        f"though the rank kept working", "abort_timeout_s": round(bound, 1),
                "stalled_for_s": round(stalled, 1), "ranks": {}}
    return None


def _job_heard(run: RunState, now: float, stale_after: float) -> bool:
    """Whether any rank's heartbeat arrived within ``stale_after``."""
    return any(now - s.last_heartbeat_at <= stale_after for s in list(run.ranks.values()))


def _idle(samples, now: float, window: float) -> Optional[dict[str, Any]]:
    """The rank's figures when its samples cover the window and show neither
    CPU nor file I/O; None otherwise (too few samples, or it works)."""
    if not samples:
        return None
    latest = samples[-1]
    if now - latest[0] > max(3.0, window / 2):
        return None  # no fresh sample: not judged idle on old figures
    start = None
    for sample in reversed(samples):
        if latest[0] - sample[0] >= window:
            start = sample
            break
    if start is None:
        return None
    if latest[1] < start[1] or latest[2] < start[2] or latest[3] < start[3]:
        return None  # counters went back: a new process (a restart), not this stall's figures
    span = latest[0] - start[0]
    if span > 3 * window:
        return None  # a gap: the samples are not one stall's
    cpu = latest[1] - start[1]
    io = latest[2] - start[2]
    wakeups = latest[3] - start[3]
    if cpu < IDLE_CPU_SHARE * span and io == 0 and wakeups < IDLE_WAKEUPS_PER_S * span:
        return {"rule": "idle", "cpu_s": round(cpu, 4), "io_bytes": io, "wakeups": wakeups, "over_s": round(span, 1)}
    return None


def _rule_text(per_rank: dict[str, Any]) -> str:
    rules = sorted({v["rule"] for v in per_rank.values()})
    texts = {"idle": "no CPU and no file I/O in its process", "frozen": "its interpreter frozen (heartbeat silent)",
             "exited": "it exited"}
    return "; ".join(texts[r] for r in rules)
