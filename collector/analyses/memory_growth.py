"""`memory_growth`: a rank whose memory grows step after step (a leak).

Robust slope (Theil-Sen: the median of pairwise slopes) of host RSS, and of
device allocated memory where there is one, over the recent steps; the growth
must be steady (most steps grow) and well above the peers' slopes. Start-up
steps are skipped: allocators and DataLoader workers grow then settle.
"""

from __future__ import annotations

import statistics
from typing import Optional

from rankwatch import wire
from rankwatch.memory_snapshot import human

from ..state import RunState
from .common import ranks_text, verdict

SKIP_FIRST = 5
MIN_STEPS = 15
WINDOW = 60
MIN_SLOPE = 1 << 20  # 1 MiB per step
STEADY = 0.6  # fraction of steps that grow


def _series(run: RunState, rank: int, field: str) -> list[tuple[int, float, float]]:
    out = []
    for record in run.ranks[rank].steps.values():
        value = getattr(record, field)
        if value is not None and record.step >= SKIP_FIRST:
            out.append((record.step, float(value), record.ended_at))
    return out[-WINDOW:]


def theil_sen(points: list[tuple[int, float]]) -> float:
    slopes = []
    n = len(points)
    stride = max(1, n // 40)  # bounded work on long windows
    for i in range(0, n, stride):
        for j in range(i + 1, n, stride):
            dx = points[j][0] - points[i][0]
            if dx:
                slopes.append((points[j][1] - points[i][1]) / dx)
    return statistics.median(slopes) if slopes else 0.0


def growth(run: RunState, rank: int, field: str) -> Optional[dict]:
    series = _series(run, rank, field)
    if len(series) < MIN_STEPS:
        return None
    slope = theil_sen([(s, v) for s, v, _ in series])
    ups = sum(1 for a, b in zip(series, series[1:]) if b[1] > a[1])
    duration = series[-1][2] - series[0][2]
    per_second = slope * (series[-1][0] - series[0][0]) / duration if duration > 0 else 0.0
    return {"bytes_per_step": slope, "bytes_per_second": per_second, "steady": ups / (len(series) - 1),
            "first_step": series[0][0], "last_step": series[-1][0], "last_bytes": series[-1][1],
            "first_at": series[0][2]}


def detect(run: RunState, now: float, final: bool) -> list[wire.Verdict]:
    for field, what in (("device_allocated_bytes", "device memory"), ("rss_bytes", "host memory (RSS)")):
        stats = {r: g for r in run.ranks if (g := growth(run, r, field)) is not None}
        if len(stats) < 1:
            continue
        leaking = {}
        for rank, g in stats.items():
            peers = [p["bytes_per_step"] for r, p in stats.items() if r != rank]
            peer_slope = statistics.median(peers) if peers else 0.0
            if (g["bytes_per_step"] >= MIN_SLOPE and g["steady"] >= STEADY
                    and g["bytes_per_step"] > 4 * max(peer_slope, 0.0) + MIN_SLOPE / 2):
                leaking[rank] = {**g, "peer_bytes_per_step": peer_slope}
        if not leaking or (len(run.ranks) > 1 and len(leaking) == len(run.ranks)):
            continue
        rank = max(leaking, key=lambda r: leaking[r]["bytes_per_step"])
        g = leaking[rank]
        eta = _time_to_exhaustion(run, rank, g, field)
        summary = (f"{ranks_text(leaking).capitalize()} leaks {what}: +{human(g['bytes_per_step'])} per step "
                   f"({human(g['bytes_per_second'])}/s) over steps {g['first_step']}-{g['last_step']}, "
                   f"against +{human(max(g['peer_bytes_per_step'], 0))} per step on its peers")
        if eta:
            summary += (f"; at this rate memory runs out in about {eta:.0f} s." if eta < 120
                        else f"; at this rate memory runs out in about {eta / 60:.0f} min.")
        else:
            summary += "."
        evidence = {"memory": field, "ranks": {str(r): d for r, d in leaking.items()},
                    "seconds_to_exhaustion": eta}
        return [verdict("memory_growth", leaking, g["first_step"], g["first_at"], now, summary, evidence)]
    return []


def _time_to_exhaustion(run: RunState, rank: int, g: dict, field: str) -> Optional[float]:
    if g["bytes_per_second"] <= 0:
        return None
    mem = run.ranks[rank].host_memory
    if field == "rss_bytes":
        available = mem.get("MemAvailable")
        limit = mem.get("CgroupLimit")
        if limit:
            available = min(available or limit, max(0, limit - int(g["last_bytes"])))
        return available / g["bytes_per_second"] if available else None
    return None
