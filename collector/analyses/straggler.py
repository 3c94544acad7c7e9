"""`straggler`: a rank whose *own* time per step (data + forward + backward,
up to the moment it reaches the last gradient allreduce) is persistently
slower than its peers'.

In synchronous DDP every rank shows the same step time (the allreduce makes
the fast ranks wait), so the step time says nothing; the time before the wait
does. Score = own median / peers' median over a window (NVIDIA's straggler
detector uses the inverse, with a 0.75 threshold); persistence = the rank is
over the threshold on most steps of the window, so one slow step is not a
verdict.
"""

from __future__ import annotations

import statistics
from typing import Optional

from rankwatch import wire

from ..state import RunState
from .common import ranks_text, verdict, verb

THRESHOLD = 1.33  # own / peers' median time (1 / 0.75)
WINDOW = 12  # steps
PERSISTENCE = 0.75  # fraction of the window's steps that must be over the threshold
MIN_EXCESS_S = 0.02  # ignore differences below this (timer noise, tiny steps)
SKIP_FIRST = 3  # start-up steps (bucket rebuild, warm caches)


def own_time(record: wire.StepRecord) -> Optional[float]:
    if record.compute_s is None:
        return None
    return record.compute_s  # measured from the step's start: includes data loading


def _times(run: RunState) -> tuple[dict[int, dict[int, float]], list[int]]:
    times: dict[int, dict[int, float]] = {}
    for rank, state in run.ranks.items():
        for record in state.steps.values():
            t = own_time(record)
            if t is not None and record.step >= SKIP_FIRST:
                times.setdefault(record.step, {})[rank] = t
    steps = sorted(s for s, per in times.items() if len(per) == len(run.ranks) and len(per) >= 2)
    return times, steps


def _score_window(run: RunState, times: dict[int, dict[int, float]], steps: list[int]) -> dict[int, dict]:
    out = {}
    for rank in run.ranks:
        over, own, peer, first_over = 0, [], [], None
        for step in steps:
            mine = times[step][rank]
            others = statistics.median(v for r, v in times[step].items() if r != rank)
            own.append(mine)
            peer.append(others)
            if mine > THRESHOLD * others and mine - others > MIN_EXCESS_S:
                over += 1
                first_over = step if first_over is None else first_over
        own_median, peer_median = statistics.median(own), statistics.median(peer)
        out[rank] = {"score": own_median / max(peer_median, 1e-9), "own_median_s": own_median,
                     "peer_median_s": peer_median, "steps_over": over, "window": steps, "first_over": first_over}
    return out


def scores(run: RunState) -> dict[int, dict]:
    """Per rank, the straggler score over the latest window (also for metrics)."""
    times, steps = _times(run)
    if len(steps) < WINDOW:
        return {}
    return _score_window(run, times, steps[-WINDOW:])


def _slow(run: RunState, found: dict[int, dict]) -> dict[int, dict]:
    slow = {r: d for r, d in found.items()
            if d["steps_over"] >= PERSISTENCE * len(d["window"]) and d["score"] >= THRESHOLD}
    minority = len(slow) < len(run.ranks) / 2 or (len(run.ranks) == 2 and len(slow) == 1)
    return slow if minority else {}


def detect(run: RunState, now: float, final: bool) -> list[wire.Verdict]:
    # The earliest window in which a minority of ranks is persistently slow:
    # the step the straggler was first observed, live or offline alike.
    times, steps = _times(run)
    found, slow = {}, {}
    for end in range(WINDOW, len(steps) + 1):
        found = _score_window(run, times, steps[end - WINDOW:end])
        slow = _slow(run, found)
        if slow:
            break
    if not slow:
        return []
    worst_rank = max(slow, key=lambda r: slow[r]["score"])
    worst = slow[worst_rank]
    phase = _phase(run, worst_rank, worst["window"])
    window = worst["window"]
    extra = worst["own_median_s"] - worst["peer_median_s"]
    summary = (f"{ranks_text(slow).capitalize()} {verb(slow, 'is', 'are')} a straggler: its own work takes "
               f"{worst['own_median_s'] * 1e3:.0f} ms per step against {worst['peer_median_s'] * 1e3:.0f} ms on its "
               f"peers ({worst['score']:.1f}x, +{extra * 1e3:.0f} ms, mostly in {phase}) on "
               f"{worst['steps_over']} of the last {len(window)} steps; every other rank waits for it in the allreduce.")
    state = run.ranks[worst_rank]
    start = worst["first_over"] if worst["first_over"] is not None else window[0]
    first = state.steps[start].started_at if start in state.steps else now
    evidence = {"ranks": {str(r): {k: v for k, v in d.items() if k not in ("window", "first_over")}
                          for r, d in slow.items()},
                "phase": phase, "steps": [window[0], window[-1]],
                "scores": {str(r): round(d["score"], 3) for r, d in found.items()}}
    diff = profile_difference(run, worst_rank)
    if diff:
        evidence["profile"] = diff
        top = diff["operations"][0]
        summary += f" Profiler: the largest difference is {top['name']} (+{top['extra_ms']:.1f} ms)."
    return [verdict("straggler", slow, start, first, now, summary, evidence)]


def profile_difference(run: RunState, slow: int) -> Optional[dict]:
    """Operations whose time differs most between the slow rank's profiler
    trace and a healthy rank's (both taken after the verdict)."""
    def latest(rank: int):
        found = [ev for ev in run.ranks[rank].evidence.values() if ev.profile]
        return max(found, key=lambda ev: ev.created_at) if found else None

    mine = latest(slow)
    others = [(r, latest(r)) for r in run.ranks if r != slow]
    others = [(r, ev) for r, ev in others if ev is not None]
    if mine is None or not others:
        return None
    healthy, theirs = others[0]
    def table(ev):
        return {op["name"]: float(op.get("self_ms", 0.0)) for op in ev.profile.get("operations", [])
                if isinstance(op, dict) and "name" in op}
    a, b = table(mine), table(theirs)
    rows = [{"name": name, "slow_ms": a.get(name, 0.0), "healthy_ms": b.get(name, 0.0),
             "extra_ms": a.get(name, 0.0) - b.get(name, 0.0)} for name in set(a) | set(b)]
    rows.sort(key=lambda r: r["extra_ms"], reverse=True)
    return {"slow_rank": slow, "healthy_rank": healthy, "operations": rows[:10],
            "traces": {str(slow): mine.bundle_path, str(healthy): theirs.bundle_path}}


def _phase(run: RunState, rank: int, window: list[int]) -> str:
    """Where the extra time goes: data loading or forward/backward."""
    def split(r: int) -> tuple[float, float]:
        data, compute = [], []
        for step in window:
            rec = run.ranks[r].steps.get(step)
            if rec is not None and rec.compute_s is not None:
                d = rec.data_s or 0.0
                data.append(d)
                compute.append(rec.compute_s - d)
        return (statistics.median(data) if data else 0.0, statistics.median(compute) if compute else 0.0)

    mine = split(rank)
    peers = [split(r) for r in run.ranks if r != rank]
    peer_data = statistics.median(p[0] for p in peers)
    peer_compute = statistics.median(p[1] for p in peers)
    return "data loading" if mine[0] - peer_data >= mine[1] - peer_compute else "forward/backward"
