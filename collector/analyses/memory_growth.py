"""`memory_growth`: a rank whose memory grows step after step (a leak).

Robust slope (Theil-Sen: the median of pairwise slopes) of host RSS, and of
device allocated memory where there is one, over the recent steps; the growth
must be steady (most steps grow) and well above the peers' slopes. Start-up
steps are skipped: allocators and DataLoader workers grow then settle.
"""

from __future__ import annotations

import operator
import statistics
from typing import Optional

import numpy as np

from rankwatch import wire
from rankwatch.memory_snapshot import human

from ..state import RunState
from .common import RankRows, note_margin, ranks_text, register_tracker, settle, tracker, verdict

SKIP_FIRST = 5
MIN_STEPS = 15
WINDOW = 60
MIN_SLOPE = 1 << 20  # 1 MiB per step
STEADY = 0.6  # fraction of steps that grow
# Growth from the first watched step is also what a job's warm-up looks like
# (allocator arenas, per-shape caches under dynamic padding: a healthy T5
# Seq2SeqTrainer rank grew 1.2 MiB a step over steps 5-40, 9 % of its RSS,
# then stopped). Until it outlasts the window, such growth must have added
# this share of the memory the rank had at the window's start.
STARTUP_SHARE = 0.25


FIELDS = (("device_allocated_bytes", "device memory"), ("rss_bytes", "host memory (RSS)"))
PEER_SAMPLE = 64  # peers' slopes: every peer up to this many, an even sample beyond

_ENDED_AT = operator.attrgetter("ended_at")


class Series:
    """One rank's window of one field, read out of its `Window` row (what
    the slope, the onset and the warm-up test need): its (step, value,
    time) points, oldest first, the count of steps that grew, the value
    just before the first point (a start-up step, or the point the window
    last dropped) when known, and whether the window has slid."""

    __slots__ = ("points", "ups", "before", "slid")

    def __init__(self, points: list[tuple[int, float, float]], ups: int, before: Optional[float],
                 slid: bool) -> None:
        self.points, self.ups, self.before, self.slid = points, ups, before, slid

    def __len__(self) -> int:
        return len(self.points)

    def growth_per_step(self) -> float:
        """The overall growth per step over the window (0 before 2 points)."""
        if len(self.points) < 2:
            return 0.0
        (s0, v0, _), (s1, v1, _) = self.points[0], self.points[-1]
        return (v1 - v0) / max(1, s1 - s0)


class Window:
    """Every rank's last WINDOW (step, value, time) points of one memory
    field, as numpy columns (a row per rank, each a ring: ~1.5 KiB a rank
    at any run length), with a running count of each rank's steps that
    grew. A sealed step is added for all its ranks at once and the O(1)
    figures (margin, candidate, growth per step) come for all rows in a few
    array operations: a Series object per rank cost ~7 us a rank-step,
    a quarter of sealing a 10,000-rank step."""

    def __init__(self) -> None:
        self.rows = RankRows()  # rank -> row, in the order ranks were first seen
        self.ranks = self.rows.ranks  # row -> rank
        self.changes = 0  # counts the steps added and the rows made
        self._ends_of: Optional[tuple[int, tuple]] = None
        self._grow(64)

    def _grow(self, size: int) -> None:
        old = getattr(self, "steps", None)
        steps, values, times = (np.zeros((size, WINDOW), np.int64), np.zeros((size, WINDOW)),
                                np.zeros((size, WINDOW)))
        head, count, ups = (np.zeros(size, np.int64) for _ in range(3))
        before, slid = np.full(size, np.nan), np.zeros(size, bool)
        if old is not None:
            for new, cur in ((steps, self.steps), (values, self.values), (times, self.times), (head, self.head),
                             (count, self.count), (ups, self.ups), (before, self.before), (slid, self.slid)):
                new[:len(cur)] = cur
        self.steps, self.values, self.times = steps, values, times
        self.head, self.count, self.ups, self.before, self.slid = head, count, ups, before, slid

    def rows_of(self, ranks: list[int], before: dict[int, float]) -> np.ndarray:
        """The rows of ``ranks`` (distinct), in their order. New ranks get the
        next rows, all at once, their value before the window popped from
        ``before`` (none: nan); a row made per rank cost ~0.25 s the first
        steady step of a 100,000-rank cold start on a slow machine."""
        rows, new = self.rows.rows(ranks)
        # Popped before the grow: a grow that fails leaves no start-up value behind in ``before``.
        values = np.array([before.pop(rank, None) for rank in new], float) if new else None  # None -> nan
        end = len(self.ranks)
        if end > len(self.count):
            # Checked on every call, not only when ranks are new: a grow that
            # failed (MemoryError) left rows beyond the arrays, made here at
            # the next call (their value before the window lost: nan).
            size = len(self.count)
            while size < end:
                size *= 2
            self._grow(size)
            self.changes += 1
        if values is None:
            return rows
        self.changes += 1
        self.before[end - len(new):end] = values
        return rows

    def add(self, rows: np.ndarray, step: int, values: np.ndarray, at: np.ndarray) -> None:
        """One step's points of ``rows`` (distinct)."""
        self.changes += 1
        head, count = self.head[rows], self.count[rows]
        full = count == WINDOW
        oldest = self.values[rows, head]
        # A full window drops its oldest point, and with it that point's growth step.
        self.ups[rows] -= full & (self.values[rows, (head + 1) % WINDOW] > oldest)
        self.ups[rows] += (count > 0) & (values > self.values[rows, (head + count - 1) % WINDOW])
        slot = np.where(full, head, (head + count) % WINDOW)
        self.before[rows] = np.where(full, oldest, self.before[rows])
        self.slid[rows] |= full
        self.head[rows] = np.where(full, (head + 1) % WINDOW, head)
        self.count[rows] = np.where(full, count, count + 1)
        self.steps[rows, slot], self.values[rows, slot], self.times[rows, slot] = step, values, at

    def _ends(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every row's (count, first-to-last growth, steps between), made
        once per change of the window: a step's margin and candidates both
        read them (~12 ms each time at 100,000 ranks on a slow machine)."""
        if self._ends_of is not None and self._ends_of[0] == self.changes:
            return self._ends_of[1]
        n = len(self.ranks)
        count, head = self.count[:n], self.head[:n]
        first, last = head, (head + np.maximum(count, 1) - 1) % WINDOW
        rows = np.arange(n)
        ends = (count, self.values[rows, last] - self.values[rows, first],
                np.maximum(1, self.steps[rows, last] - self.steps[rows, first]))
        self._ends_of = (self.changes, ends)
        return ends

    def growth_per_step(self) -> np.ndarray:
        """Every row's overall growth per step over its window (0 before 2 points)."""
        count, grown, steps = self._ends()
        return np.where(count >= 2, grown / steps, 0.0)

    def margins(self) -> np.ndarray:
        """Every row's smaller of its share of growing steps against STEADY
        and its overall growth per step against MIN_SLOPE (0 before MIN_STEPS)."""
        count, grown, steps = self._ends()
        share = self.ups[:len(count)] / (STEADY * np.maximum(count - 1, 1))
        return np.where(count >= MIN_STEPS, np.minimum(share, grown / steps / MIN_SLOPE), 0.0)

    def candidates(self) -> np.ndarray:
        """Rows that pass the cheap necessary conditions before the Theil-Sen
        slope: enough points, growing on most steps, and overall."""
        count, grown, steps = self._ends()
        return ((count >= MIN_STEPS) & (self.ups[:len(count)] >= STEADY * (count - 1))
                & (grown >= MIN_SLOPE / 4 * steps))

    def eligible(self) -> np.ndarray:
        """Rows with at least MIN_STEPS points."""
        return self.count[:len(self.ranks)] >= MIN_STEPS

    def get(self, rank: int) -> Optional[Series]:
        row = self.rows.get(rank)
        if row is None:
            return None
        head, count = int(self.head[row]), int(self.count[row])
        order = [(head + i) % WINDOW for i in range(count)]
        steps, values, times = self.steps[row], self.values[row], self.times[row]
        before = float(self.before[row])
        return Series([(int(steps[j]), float(values[j]), float(times[j])) for j in order], int(self.ups[row]),
                      None if np.isnan(before) else before, bool(self.slid[row]))


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


def onset(points: list[tuple[int, float, float]], slope: float = MIN_SLOPE, drift: float = 0.0,
          before: Optional[float] = None) -> tuple[int, float]:
    """(step, time) the growth began: the point after the last one still
    within half a step's growth of the lowest value before it (a leak that
    starts mid-window has a flat stretch before it), or the window's first
    point when it grows from there on (the leak began then or earlier).
    ``before``, the value just before the window, says which: flat into the
    first point, the growth began at the second (a leak starting the step
    after the skipped start-up steps was dated one step early).

    A step's growth is the leak's own (``slope``, at least MIN_SLOPE), and
    the values are taken net of ``drift`` (bytes a step: the peers' growth,
    what every rank's allocator does anyway). Without either, an allocator's
    slow drift before a fast leak (0.2 MiB a step on every rank before +16 MiB
    ones, faultbench hf-leak-s1) ran past the tolerance and dated the leak a
    step early, or many steps early over a long flat stretch."""
    tolerance = max(MIN_SLOPE, slope) / 2
    first_step = points[0][0]
    drift = max(0.0, drift)
    values = [value - drift * (step - first_step) for step, value, _ in points]
    lowest = values[0] if before is None else min(values[0], before + drift)
    last_low: Optional[int] = None
    for i, value in enumerate(values):
        if value <= lowest + tolerance:
            last_low = i
        lowest = min(lowest, value)
    if last_low is None or (last_low == 0 and before is None):
        return points[0][0], points[0][2]  # growing from the window's first point, or before it
    start = points[min(last_low + 1, len(points) - 1)]
    return start[0], start[2]


def beyond_warm_up(series: Series, began: int) -> bool:
    """Whether growth cannot be a job's warm-up: it began after a flat
    stretch (a leak that starts mid-run), or it has lasted the whole window,
    or it has added STARTUP_SHARE of the memory the rank had at the window's
    start (a 16 MiB/step leak in a 400 MiB process does in 7 steps)."""
    points = series.points
    if series.slid or began > points[0][0] + 1:
        return True
    base = points[0][1]
    return base <= 0 or points[-1][1] - base >= STARTUP_SHARE * base


def _growth(series: Series) -> Optional[dict]:
    points = series.points
    if len(points) < MIN_STEPS:
        return None
    slope = theil_sen([(s, v) for s, v, _ in points])
    duration = points[-1][2] - points[0][2]
    per_second = slope * (points[-1][0] - points[0][0]) / duration if duration > 0 else 0.0
    began, began_at = onset(points, slope, before=series.before)
    return {"bytes_per_step": slope, "bytes_per_second": per_second, "steady": series.ups / (len(points) - 1),
            "first_step": points[0][0], "last_step": points[-1][0], "last_bytes": points[-1][1],
            "first_at": points[0][2], "onset_step": began, "onset_at": began_at}


class Tracker:
    """Per field, a Window of every rank; the slopes are computed only for
    ranks that pass the cheap conditions (`Window.candidates`) and for a
    bounded sample of their peers. The first leak found is kept (a leak
    that plateaus later stays a leak); while the same ranks keep leaking
    its figures follow the latest window."""

    def __init__(self) -> None:
        self.series: dict[str, Window] = {f: Window() for f, _ in FIELDS}
        self.before: dict[str, dict[int, float]] = {f: {} for f, _ in FIELDS}  # start-up values, per rank
        self.findings: dict[str, dict] = {}
        self.last_step = 0
        self.cheap_worst = 0.0  # the highest O(1) margin seen: gates the robust one
        self._last_rows: dict[str, tuple[list[int], np.ndarray]] = {}  # field -> (a step's ranks, their rows)

    def on_step(self, run: RunState, step: int, records: dict[int, wire.StepRecord]) -> None:
        if step < SKIP_FIRST:
            # Only the last start-up value: where the first window point came
            # from. Taken a column at a time (a walk per rank and field cost
            # ~0.1 s a 100,000-rank start-up step on a slow machine, at the
            # moment every rank of a cold start reports).
            every, kept = list(records), list(records.values())
            for field, _ in FIELDS:
                column = list(map(operator.attrgetter(field), kept))
                missing = column.count(None)
                if missing == len(column):
                    continue
                if missing:
                    self.before[field].update((rank, float(value)) for rank, value in zip(every, column)
                                              if value is not None)
                else:
                    self.before[field].update(zip(every, map(float, column)))
            return
        # The step in columns: per field one array of every rank's value (None
        # -> nan), and the window's rows of those ranks, reused while a step's
        # ranks come as the last one's did (a walk per rank and field cost
        # ~0.5 s a 100,000-rank step on a slow machine).
        self.last_step = step
        every, kept = list(records), list(records.values())
        ats = np.array(list(map(_ENDED_AT, kept)), float)
        for field, _ in FIELDS:
            column = list(map(operator.attrgetter(field), kept))
            if column.count(None) == len(column):
                continue  # no rank sends it (a host-only job's device memory): not ~30 ms of Nones to nan
            values = np.array(column, float)
            present = ~np.isnan(values)
            if present.all():
                ranks = every
            else:
                at = np.flatnonzero(present)
                if not len(at):
                    continue
                ranks, values = [every[i] for i in at.tolist()], values[at]
            window = self.series[field]
            window.add(self._rows(field, ranks), step, values, ats if ranks is every else ats[at])
            self._evaluate(run, field)

    def _rows(self, field: str, ranks: list[int]) -> np.ndarray:
        """The window's rows of ``ranks`` (in their order), made for new ranks."""
        last = self._last_rows.get(field)
        if last is not None and last[0] == ranks:
            return last[1]
        found = self.series[field].rows_of(ranks, self.before[field])
        self._last_rows[field] = (ranks, found)
        return found

    def _margin(self, run: RunState, field: str, step: int) -> None:
        """How close a rank came: the smallest of its share of growing steps
        against STEADY, its growth per step (the Theil-Sen slope the verdict
        uses) against MIN_SLOPE, that growth against what its peers'
        would have to stay under (4x theirs + MIN_SLOPE / 2), and for growth
        from start-up what it added against STARTUP_SHARE of the rank's
        memory, as a leak must pass all of them: ranks that grow alike (allocators warming up on every
        rank) are not half a leak. The slope and the peers' growth are
        computed only when the O(1) share-and-growth figure reaches a new
        high for the run (a bounded number of times)."""
        window = self.series[field]
        margins = window.margins()
        if not len(margins):
            return
        best_row = int(np.argmax(margins))  # the first of the highest, in the order ranks were seen
        best = float(margins[best_row])
        if best <= 0 or best <= self.cheap_worst:
            return
        self.cheap_worst = best  # the robust figures below only on a new high of the cheap one
        # The growth the verdict judges: the Theil-Sen slope, which one
        # transient step (glibc handing an arena back a few steps later) does
        # not move, unlike the window's first-to-last growth.
        best_rank = window.ranks[best_row]
        series = window.get(best_rank)
        g = _growth(series)
        slope = g["bytes_per_step"] if g is not None else 0.0
        best = min(best, slope / MIN_SLOPE)
        if g is not None and not beyond_warm_up(series, g["onset_step"]):
            points = series.points  # growth from start-up: how much of the share it has added
            base = points[0][1]
            best = min(best, (points[-1][1] - base) / (STARTUP_SHARE * base))
        others = [r for r in np.flatnonzero(window.eligible()) if r != best_row]
        if others:
            sample = others if len(others) <= PEER_SAMPLE else others[:: len(others) // PEER_SAMPLE]
            peer_growth = float(np.median(window.growth_per_step()[sample]))
            best = min(best, slope / (4 * max(peer_growth, 0.0) + MIN_SLOPE / 2))
        note_margin(run, "memory_growth", best, step, best_rank)

    def _evaluate(self, run: RunState, field: str) -> None:
        window = self.series[field]
        if not self.findings:
            self._margin(run, field, self.last_step)
        candidates = [window.ranks[r] for r in np.flatnonzero(window.candidates())]
        if not candidates:
            return
        eligible = sorted(window.ranks[r] for r in np.flatnonzero(window.eligible()))
        sample = eligible if len(eligible) <= PEER_SAMPLE + 1 else eligible[:: len(eligible) // PEER_SAMPLE]
        slopes: dict[int, dict] = {}

        def growth(rank: int) -> Optional[dict]:
            if rank not in slopes:
                slopes[rank] = _growth(window.get(rank))
            return slopes[rank]

        leaking = {}
        for rank in candidates:
            g = growth(rank)
            if g is None or g["bytes_per_step"] < MIN_SLOPE or g["steady"] < STEADY:
                continue
            peers = [p["bytes_per_step"] for r in sample if r != rank and (p := growth(r)) is not None]
            peer_slope = statistics.median(peers) if peers else 0.0
            if g["bytes_per_step"] > 4 * max(peer_slope, 0.0) + MIN_SLOPE / 2:
                series = window.get(rank)
                began, began_at = onset(series.points, g["bytes_per_step"], peer_slope, series.before)
                if not beyond_warm_up(series, began):
                    continue
                leaking[rank] = {**g, "peer_bytes_per_step": peer_slope, "onset_step": began, "onset_at": began_at}
        if not leaking or (len(run.ranks) > 1 and len(leaking) == len(run.ranks)):
            return
        found = self.findings.get(field)
        if found is None:
            self.findings[field] = {"leaking": leaking}
        elif set(found["leaking"]) == set(leaking):
            first = {r: found["leaking"][r] for r in leaking}
            for rank, g in leaking.items():  # the leak's start stays where it was first seen
                for key in ("first_step", "first_at", "onset_step", "onset_at"):
                    g[key] = first[rank][key]
            found["leaking"] = leaking


register_tracker("memory_growth", Tracker)


def growth(run: RunState, rank: int, field: str) -> Optional[dict]:
    """The rank's current slope of one field (running summary; for tools and tests)."""
    settle(run)
    series = tracker(run, "memory_growth").series[field].get(rank)
    return _growth(series) if series is not None else None


def detect(run: RunState, now: float, final: bool) -> list[wire.Verdict]:
    settle(run, final)
    findings = tracker(run, "memory_growth").findings
    for field, what in FIELDS:
        found = findings.get(field)
        if found is None:
            continue
        leaking = found["leaking"]
        rank = max(leaking, key=lambda r: leaking[r]["bytes_per_step"])
        g = leaking[rank]
        eta = _time_to_exhaustion(run, rank, g, field)
        began = f" from step {g['onset_step']}" if g["onset_step"] > g["first_step"] else ""
        summary = (f"{ranks_text(leaking).capitalize()} leaks {what}{began}: +{human(g['bytes_per_step'])} per step "
                   f"({human(g['bytes_per_second'])}/s) over steps {g['first_step']}-{g['last_step']}, "
                   f"against +{human(max(g['peer_bytes_per_step'], 0))} per step on its peers")
        if eta:
            summary += (f"; at this rate memory runs out in about {eta:.0f} s." if eta < 120
                        else f"; at this rate memory runs out in about {eta / 60:.0f} min.")
        else:
            summary += "."
        evidence = {"memory": field, "ranks": {str(r): dict(d) for r, d in leaking.items()},
                    "seconds_to_exhaustion": eta}
        # The verdict's step: where the growth began (steps before it in the window were flat).
        return [verdict("memory_growth", leaking, g["onset_step"], g["onset_at"], now, summary, evidence)]
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
