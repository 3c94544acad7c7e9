"""`straggler`: a rank whose *own* time per step (data + forward + backward,
up to the moment it reaches the last gradient allreduce) is persistently
slower than its peers'.

In synchronous DDP every rank shows the same step time (the allreduce makes
the fast ranks wait), so the step time says nothing; the time before the wait
does. Score = own median / peers' median over a window (NVIDIA's straggler
detector uses the inverse, with a 0.75 threshold); persistence = the rank is
over the threshold on most steps of the window, so one slow step is not a
verdict.

A step counts against a rank only when its gap also clears the job's own
jitter: the bound is THRESHOLD x e^sigma, where sigma is the step-to-step
spread of the log time ratio, measured on this run (median |x_t - x_(t-1)|
/ 0.954, the normal's, over the last JITTER_STEPS steps of a sample of
ranks). Consecutive differences see jitter and not a steady gap, so a rank
that is steadily slow does not raise its own bar. On a quiet GPU job sigma
is a few hundredths and the bound stays ~1.33x; on an oversubscribed CPU
host (two gloo ranks on two cores, the zoo) step times jitter by 13-20 %,
and healthy ranks drift ~25 % apart for tens of steps as the scheduler
moves work between cores: before, that put a healthy rank over 1.33x on 7
of 12 steps (docs/zoo.md, hf_t5_trainer).

Persistence is counted in time as well as in steps: the window is the last
WINDOW steps or the steps of the last MIN_SPAN_S seconds, whichever is
longer. A step's time here is its slowest rank's own time (the least the
step can take), not the host's clock: a GPU's host queues work ahead of the
device, so host time runs ahead of the work being judged. A slow device or host stays slow for minutes; what moves CPU time
between co-located ranks (the scheduler's migrations, writeback, another
process's burst) comes and goes within seconds, and on a short step it can
fill twelve steps: on the zoo's diffusers UNet (80 ms steps, two gloo ranks
on two cores) rank 1 took 40 ms where rank 0 took 67 on 8 of 12 steps,
about 1.3 s, while the job's step time did not move (its margin was 0.89).
With steps of 0.4 s or more (most GPU jobs) twelve steps already span the
5 s and nothing changes; on shorter steps a verdict waits for 5 s of
evidence, at most MAX_WINDOW_STEPS steps.
"""

from __future__ import annotations

import collections
import math
import operator
import re
import statistics
from typing import Optional

import numpy as np

from rankwatch import wire

from ..state import RunState
from .common import note_margin, paced, peer_medians_of, ranks_text, register_tracker, settle, tracker, verb, verdict

THRESHOLD = 1.33  # own / peers' median time (1 / 0.75)
WINDOW = 12  # steps
PERSISTENCE = 0.75  # fraction of the window's steps that must be over the threshold
# Differences below a millisecond are the host's timer and scheduler
# granularity whatever their ratio. It was 20 ms, which hid a rank three
# times slower on every job whose steps take under 10 ms (bench/sensitivity.py:
# 3x named in 57 % of the zoo's trials, now in all); the jitter bound above it
# already scales with the run's own noise (0 false alarms in the zoo at 1 ms).
MIN_EXCESS_S = 0.001
MIN_SPAN_S = 5.0  # the window covers at least this much of the run's time (see the module's docstring)
MAX_WINDOW_STEPS = 512  # ... and at most this many steps (steps under 10 ms)
WINDOW_ENTRIES = 1_200_000  # ... and at most this many (step, rank) entries: 12 steps of 100,000 ranks
SKIP_FIRST = 3  # start-up steps (bucket rebuild, warm caches)
JITTER_STEPS = 48  # steps of consecutive-difference samples behind the jitter estimate
JITTER_RANKS = 64  # ranks sampled per step for it (a stride over the ranks)
HALF_NORMAL_DIFF = 0.954  # median |a - b| of two independent N(0, s^2) draws, in units of s


def own_time(record: wire.StepRecord) -> Optional[float]:
    if record.compute_s is None:
        return None
    return record.compute_s  # measured from the step's start: includes data loading


_COMPUTE_S, _DATA_S = operator.attrgetter("compute_s"), operator.attrgetter("data_s")


class _Step:
    """One scored step in columns, ordered by rank: each rank's own time, its
    peers' median, whether it was over the bound, and its data-loading time
    (nan where not reported). Columns, not a tuple per rank: at 100,000 ranks
    the per-rank Python of a sealed step cost ~0.7 s on a slow machine."""
    __slots__ = ("step", "ranks", "own", "peers", "over", "data")

    def __init__(self, step: int, ranks: np.ndarray, own: np.ndarray, peers: np.ndarray, over: np.ndarray,
                 data: np.ndarray) -> None:
        self.step, self.ranks, self.own, self.peers, self.over, self.data = step, ranks, own, peers, over, data

    def index(self, rank: int) -> Optional[int]:
        i = int(np.searchsorted(self.ranks, rank))
        return i if i < len(self.ranks) and self.ranks[i] == rank else None


def _stacked(window: list[_Step]) -> bool:
    """Whether every step of the window holds the same ranks (the usual case):
    then a rank's column is the same index in each, and the window is scored
    in 2-D arrays."""
    first = window[0].ranks
    return all(len(e.ranks) == len(first) and (e.ranks is first or np.array_equal(e.ranks, first))
               for e in window[1:])


class Tracker:
    """The window's steps that every rank reported (the last WINDOW steps or
    MIN_SPAN_S seconds, whichever is longer), each rank's time next to its
    peers' median at that step (computed once per step for all ranks), and a
    running count of the steps each rank was over the threshold. A rank is
    scored over the window only when that count makes it a candidate."""

    def __init__(self) -> None:
        self.window: collections.deque[_Step] = collections.deque()
        self.window_s: collections.deque[float] = collections.deque()  # each window step's slowest own time
        self.span_s = 0.0  # their sum
        self.max_steps = MAX_WINDOW_STEPS
        self.over: dict[int, int] = {}
        self.finding: Optional[dict] = None
        self.scores: dict[int, dict] = {}  # latest window, every rank (metrics)
        self.scored_step = -1
        # rank -> (step, started_at) since which it has been over the threshold
        # without WINDOW steps in a row clear of it: the verdict's step (a rank
        # slow from step 0 is labelled 0, not the step its window filled). The
        # start-up steps are not scored but do say where a streak began. A
        # window of seconds holds stray steps over the bound long before a
        # slowdown: they do not start its streak.
        self.since: dict[int, tuple[int, float]] = {}
        self.last_over: dict[int, int] = {}  # rank -> the latest step it was over (ranks in `since`)
        self.early: dict[int, tuple[int, float]] = {}  # the first start-up step each rank was over
        # The job's own step-to-step jitter of log(own / peers): |x_t - x_(t-1)|
        # of a sample of ranks, and each sampled rank's last x.
        self.jitter: collections.deque[float] = collections.deque(maxlen=JITTER_STEPS * 2)
        self.last_x: dict[int, float] = {}
        self.sigma = 0.0
        self.bound = THRESHOLD

    def _update_jitter(self, ranks: np.ndarray, own: np.ndarray, peers: np.ndarray) -> None:
        """Sample this step's log ratios and re-estimate sigma and the bound
        (one sort of at most JITTER_STEPS x JITTER_RANKS floats a step)."""
        n = len(ranks)
        sample = slice(None) if n <= JITTER_RANKS else slice(None, None, n // JITTER_RANKS)  # ranks are sorted
        need = JITTER_STEPS * len(range(n)[sample])
        if self.jitter.maxlen != need:
            self.jitter = collections.deque(self.jitter, maxlen=need)
        for rank, mine, others in zip(ranks[sample].tolist(), own[sample].tolist(), peers[sample].tolist()):
            if mine <= 0 or others <= 0:
                continue
            x = math.log(mine / others)
            last = self.last_x.get(rank)
            if last is not None:
                self.jitter.append(abs(x - last))
            self.last_x[rank] = x
        if len(self.jitter) >= 8:
            self.sigma = statistics.median(self.jitter) / HALF_NORMAL_DIFF
            self.bound = THRESHOLD * math.exp(self.sigma)

    def _over(self, own, peers):
        """Over the bound: beyond the jitter-raised ratio and by more than the
        timer's granularity (floats or arrays alike)."""
        return (own > self.bound * peers) & (own - peers > MIN_EXCESS_S)

    def on_step(self, run: RunState, step: int, records: dict[int, wire.StepRecord]) -> None:
        if len(records) != len(run.ranks) or len(records) < 2:
            return
        ranks = np.fromiter(records, np.int64, len(records))
        kept = list(records.values())  # read by attrgetter: ~10 ms less a 100,000-rank step than a comprehension
        own = np.array(list(map(_COMPUTE_S, kept)), dtype=float)  # None -> nan
        if np.isnan(own).any():  # a rank without its own time: the step is not comparable
            return
        order = np.argsort(ranks, kind="stable")
        ranks, own = ranks[order], own[order]
        peers = peer_medians_of(own)
        self._update_jitter(ranks, own, peers)
        over = self._over(own, peers)
        if step < SKIP_FIRST:
            for rank in ranks[over].tolist():  # start-up steps: not scored, only where a streak began
                if rank not in self.early:
                    self.early[rank] = (step, records[rank].started_at)
            return
        data = np.array(list(map(_DATA_S, kept)), dtype=float)[order]  # None -> nan
        for rank in ranks[over].tolist():
            self.over[rank] = self.over.get(rank, 0) + 1
            if rank not in self.since or step - self.last_over[rank] > WINDOW:
                self.since[rank] = self.early.get(rank, (step, records[rank].started_at))
            self.last_over[rank] = step
        self.early.clear()  # counts only for a rank over from the first scored step
        if self.window and np.array_equal(self.window[-1].ranks, ranks):
            ranks = self.window[-1].ranks  # shared: the window's steps compare by identity
        self.window.append(_Step(step, ranks, own, peers, over, data))
        # A record may stand for several steps: the agent thins them on short
        # steps, so the ones in between count at this one's pace. A step's
        # least duration is its slowest rank's own time.
        slowest = float(own.max())
        span = slowest * min(max(1, step - self.window[-2].step) if len(self.window) > 1 else 1, WINDOW)
        self.window_s.append(span)
        self.span_s += span
        self.max_steps = max(WINDOW, min(MAX_WINDOW_STEPS, WINDOW_ENTRIES // len(ranks)))
        while len(self.window) > WINDOW and (len(self.window) > self.max_steps
                                             or self.span_s - self.window_s[0] >= MIN_SPAN_S):
            self._drop_oldest()
        needed = self.steps_needed()
        if self.over:  # margin: the steps over the threshold in the window, against the persistence needed
            worst = max(self.over, key=self.over.get)
            note_margin(run, "straggler", self.over[worst] / (PERSISTENCE * needed), step, worst)
        if len(self.window) < needed:
            return
        if self.finding is None:
            self._evaluate(run)

    def _drop_oldest(self) -> None:
        old = self.window.popleft()
        self.span_s -= self.window_s.popleft()
        for rank in old.ranks[old.over].tolist():
            left = self.over[rank] - 1
            if left:
                self.over[rank] = left
            else:
                del self.over[rank]
                self.since.pop(rank, None)  # a whole window clear: a later slowness is a new one
                self.last_over.pop(rank, None)

    def steps_needed(self) -> int:
        """The steps a full window holds at the run's current pace: WINDOW,
        or as many as span MIN_SPAN_S (at most max_steps)."""
        n = len(self.window)
        if n == 0:
            return WINDOW
        if self.span_s >= MIN_SPAN_S:
            return max(WINDOW, n)
        pace = self.span_s / n
        more = math.ceil(MIN_SPAN_S / pace) + 1 if pace > 0 else self.max_steps
        return max(WINDOW, min(self.max_steps, more))

    def latest_scores(self) -> dict[int, dict]:
        """Every rank's score over the latest window (a metric): computed when
        asked, at most once a window; in 2-D arrays when the window's steps
        hold the same ranks."""
        window = list(self.window)
        if len(window) < self.steps_needed():
            return self.scores
        step = window[-1].step
        if step - self.scored_step >= len(window) or not self.scores:
            if _stacked(window):
                own = np.median(np.stack([e.own for e in window]), axis=0).tolist()
                peer = np.median(np.stack([e.peers for e in window]), axis=0).tolist()
                over = np.stack([e.over for e in window]).sum(axis=0).tolist()
                self.scores = {r: {"score": o / max(p, 1e-9), "own_median_s": o, "peer_median_s": p, "steps_over": c}
                               for r, o, p, c in zip(window[-1].ranks.tolist(), own, peer, over)}
            else:
                self.scores = {r: self._score(r, window) for r in paced(window[-1].ranks.tolist())}
            self.scored_step = step
        return self.scores

    def _score(self, rank: int, window=None) -> dict:
        own, peer, over = [], [], 0
        for entry in (self.window if window is None else window):
            i = entry.index(rank)
            if i is None:
                continue
            own.append(float(entry.own[i]))
            peer.append(float(entry.peers[i]))
            if entry.over[i]:
                over += 1
        if not own:
            return {"score": 0.0, "own_median_s": 0.0, "peer_median_s": 0.0, "steps_over": 0}
        own_median, peer_median = statistics.median(own), statistics.median(peer)
        return {"score": own_median / max(peer_median, 1e-9), "own_median_s": own_median,
                "peer_median_s": peer_median, "steps_over": over}

    def _evaluate(self, run: RunState) -> None:
        # Only a rank over the threshold on most of the window can be slow.
        candidates = [r for r, n in self.over.items() if n >= PERSISTENCE * len(self.window)]
        slow = {}
        for rank in candidates:
            d = self._score(rank)
            if d["score"] >= THRESHOLD:
                slow[rank] = d
        if not slow:
            return
        minority = len(slow) < len(run.ranks) / 2 or (len(run.ranks) == 2 and len(slow) == 1)
        if not minority:
            return
        steps = [e.step for e in self.window]
        worst_rank = max(slow, key=lambda r: slow[r]["score"])
        start, first_at = self.since[worst_rank]  # a candidate has been over the threshold: never missing
        ranks = self.window[-1].ranks.tolist()
        if len(ranks) > 64:  # evidence stays small at any size: the slow ranks and a sample of the others
            ranks = sorted(set(slow) | set(ranks[:: max(1, len(ranks) // 64)]))
        self.finding = {
            "slow": slow, "worst_rank": worst_rank, "steps": steps, "start": start, "first_at": first_at,
            "phase": self._phase(worst_rank),
            "bound": {"ratio": round(self.bound, 3), "jitter_sigma": round(self.sigma, 3)},
            "scores": {str(r): round(self._score(r)["score"], 3) for r in ranks},
        }

    def _phase(self, rank: int) -> str:
        """Where the extra time goes: data loading or forward/backward."""
        data: dict[int, list[float]] = {}
        compute: dict[int, list[float]] = {}
        for entry in self.window:
            d = np.nan_to_num(entry.data, nan=0.0)
            for r, di, ci in zip(entry.ranks.tolist(), d.tolist(), (entry.own - d).tolist()):
                data.setdefault(r, []).append(di)
                compute.setdefault(r, []).append(ci)
        split = {r: (statistics.median(data[r]), statistics.median(compute[r])) for r in data}
        mine = split[rank]
        peers = [v for r, v in split.items() if r != rank]
        peer_data = statistics.median(p[0] for p in peers)
        peer_compute = statistics.median(p[1] for p in peers)
        return "data loading" if mine[0] - peer_data >= mine[1] - peer_compute else "forward/backward"


register_tracker("straggler", Tracker)


def scores(run: RunState) -> dict[int, dict]:
    """Per rank, the straggler score over the latest window (also for metrics).
    Reads the running summary only: safe from any thread, never a rescan."""
    found = run.trackers.get("straggler")
    return found.latest_scores() if found is not None else {}


def detect(run: RunState, now: float, final: bool) -> list[wire.Verdict]:
    # The earliest window in which a minority of ranks is persistently slow:
    # the step the straggler was first observed, live or offline alike.
    settle(run, final)
    finding = tracker(run, "straggler").finding
    if finding is None:
        return []
    slow, worst_rank = finding["slow"], finding["worst_rank"]
    worst = slow[worst_rank]
    phase, window = finding["phase"], finding["steps"]
    extra = worst["own_median_s"] - worst["peer_median_s"]
    summary = (f"{ranks_text(slow).capitalize()} {verb(slow, 'is', 'are')} a straggler: its own work takes "
               f"{worst['own_median_s'] * 1e3:.0f} ms per step against {worst['peer_median_s'] * 1e3:.0f} ms on its "
               f"peers ({worst['score']:.1f}x, +{extra * 1e3:.0f} ms, mostly in {phase}) on "
               f"{worst['steps_over']} of the last {len(window)} steps; every other rank waits for it in the allreduce.")
    start = finding["start"]
    first = finding["first_at"] if finding["first_at"] is not None else now
    evidence = {"ranks": {str(r): d | {"window": window}
                          for r, d in slow.items()},
                "phase": phase, "steps": [window[0], window[-1]],
                # the per-step bound: THRESHOLD raised by the run's own step-to-step jitter
                "bound": dict(finding["bound"]),
                "scores": dict(finding["scores"])}
    diff = profile_difference(run, worst_rank)
    if diff:
        evidence["profile"] = diff
        top = diff["operations"][0]
        summary += f" Profiler: the largest difference is {top['name']} (+{top['extra_ms']:.1f} ms)."
    return [verdict("straggler", slow, start, first, now, summary, evidence)]


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_PYBIND = re.compile(r"pybind11_builtins\.pybind11_detail_function_record\w*")


def op_name(name: str) -> str:
    """A profiler key as it reads in any process: torch's Python tracer names
    built-ins with their object's address (`<built-in method wait of ...
    object at 0x7f7c...>`), which differs between ranks, so the same wait
    on two ranks never matched and was called the slow rank's extra time."""
    return _PYBIND.sub("pybind11", _ADDRESS.sub("", name))


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
        out: dict[str, float] = {}
        for op in ev.profile.get("operations", []):
            if isinstance(op, dict) and "name" in op:
                name = op_name(str(op["name"]))
                out[name] = out.get(name, 0.0) + float(op.get("self_ms", 0.0))
        return out
    a, b = table(mine), table(theirs)
    rows = [{"name": name, "slow_ms": a.get(name, 0.0), "healthy_ms": b.get(name, 0.0),
             "extra_ms": a.get(name, 0.0) - b.get(name, 0.0)} for name in set(a) | set(b)]
    rows.sort(key=lambda r: r["extra_ms"], reverse=True)
    return {"slow_rank": slow, "healthy_rank": healthy, "operations": rows[:10],
            "traces": {str(slow): mine.bundle_path, str(healthy): theirs.bundle_path}}
