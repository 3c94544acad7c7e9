"""Scoring: pure functions from run records (one JSON object per run, the
format of runs.jsonl) to recall, culprit accuracy, precision and time to
verdict, each with its count and a 95 % interval.

A run record: {"run_id", "shape", "kind", "rank", "step", "expected", ...,
"tools": {tool: {"injected": {"rank", "step", "time"} | null,
                 "verdicts": [{"kind", "ranks", "time"}, ...], ...}}}.
`kind` is a fault kind or "healthy"; `expected` the verdict kind the fault
should get. Each tool's answer is judged against the fault injected in the run
it watched ("injected", written by the injector); a fault run whose fault
never fired (the job ended first) is left out and counted as not injected.

Definitions (per tool):
- a verdict is *correct* when its kind is the run's expected kind and its
  ranks are exactly the culprit, or, for a fault that is a difference between
  replicas (SYMMETRIC) in a two-rank run, both ranks: the difference is the
  same whichever rank changed, so no tool can say more (culprit accuracy still
  asks for the culprit alone); every verdict on a healthy run is wrong;
- recall (per fault kind): runs with at least one correct verdict / runs;
- culprit accuracy: runs with a verdict naming exactly the culprit, any kind;
- precision (per verdict kind, and over all verdicts): correct verdicts /
  verdicts, healthy runs included;
- time to verdict: the first correct verdict's time minus the injection time.
Intervals: Wilson score for proportions; distribution-free order-statistic
intervals (binomial) for the median and the 95th percentile, open-ended
(None) when too few runs pin a bound down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

Z95 = 1.959963984540054
HEALTHY = "healthy"


@dataclass(frozen=True)
class Proportion:
    hits: int
    n: int
    low: Optional[float]
    high: Optional[float]

    @property
    def value(self) -> Optional[float]:
        return self.hits / self.n if self.n else None


@dataclass(frozen=True)
class Quantile:
    q: float
    n: int
    value: Optional[float]
    low: Optional[float]  # None: not bounded by the sample
    high: Optional[float]


def wilson(hits: int, n: int, z: float = Z95) -> Proportion:
    if hits < 0 or n < 0 or hits > n:
        raise ValueError(f"wilson: need 0 <= hits <= n, got {hits}/{n}")
    if n == 0:
        return Proportion(0, 0, None, None)
    p = hits / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return Proportion(hits, n, max(0.0, centre - half), min(1.0, centre + half))


def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(B <= k), B ~ Binomial(n, p)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))


def _interpolated(sorted_values: list[float], q: float) -> float:
    """The q-quantile with linear interpolation between order statistics
    (numpy's default, Hyndman-Fan type 7)."""
    h = (len(sorted_values) - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (h - lo) * (sorted_values[hi] - sorted_values[lo])


def quantile(values: Iterable[float], q: float, confidence: float = 0.95) -> Quantile:
    """Point estimate and a distribution-free interval [x_(l), x_(u)] with
    P(x_(l) <= true quantile <= x_(u)) >= confidence (order statistics,
    1-based l, u from Binomial(n, q))."""
    if not 0 < q < 1:
        raise ValueError(f"quantile: q must be in (0, 1), got {q}")
    xs = sorted(float(v) for v in values)
    n = len(xs)
    if n == 0:
        return Quantile(q, 0, None, None, None)
    alpha = 1 - confidence
    low_index = 0  # largest l with P(B <= l - 1) <= alpha / 2; 0: none
    for l in range(1, n + 1):
        if _binom_cdf(l - 1, n, q) <= alpha / 2:
            low_index = l
        else:
            break
    high_index = n + 1  # smallest u with P(B <= u - 1) >= 1 - alpha / 2; n + 1: none
    for u in range(1, n + 1):
        if _binom_cdf(u - 1, n, q) >= 1 - alpha / 2:
            high_index = u
            break
    low = xs[low_index - 1] if low_index >= 1 else None
    high = xs[high_index - 1] if high_index <= n else None
    return Quantile(q, n, _interpolated(xs, q), low, high)


# ------------------------------------------------------------------ judging --

# Verdict kinds whose evidence is a difference between replicas: with two
# ranks there is no majority to say which one departed.
SYMMETRIC = ("weight_divergence", "config_divergence")


def is_correct(verdict: dict, run: dict) -> bool:
    if run["kind"] == HEALTHY or run.get("rank") is None or verdict.get("kind") != run.get("expected"):
        return False
    ranks = sorted(verdict.get("ranks") or [])
    if ranks == [run["rank"]]:
        return True
    return run.get("expected") in SYMMETRIC and run.get("world_size") == 2 and ranks == [0, 1]


def names_culprit(verdict: dict, run: dict) -> bool:
    if run["kind"] == HEALTHY or run.get("rank") is None:
        return False
    return sorted(verdict.get("ranks") or []) == [run["rank"]]


def status(run: dict, tool: str) -> str:
    """"absent" (the tool does not apply to this run's shape), "not_injected"
    (a fault run whose fault never fired in the run the tool watched) or
    "scored"."""
    answer = (run.get("tools") or {}).get(tool)
    if not answer or not answer.get("applies", True):
        return "absent"
    if run["kind"] != HEALTHY and not _acted(answer.get("injected")):
        return "not_injected"
    return "scored"


def _acted(injected: Optional[dict]) -> bool:
    """The injector wrote its record and the fault did something: a
    straggler whose added time came out 0 s (armed before any step time was
    known, faultbench at a50cb18) slowed nothing down."""
    if not injected:
        return False
    extra = (injected.get("detail") or {}).get("extra_s_per_step")
    return not (isinstance(extra, (int, float)) and extra <= 0)


def scored(run: dict, tool: str) -> Optional[dict]:
    """The tool's answer on this run if it counts."""
    return run["tools"][tool] if status(run, tool) == "scored" else None


def time_to_verdict(run: dict, answer: dict) -> Optional[float]:
    injected = answer.get("injected") or {}
    times = [v["time"] for v in answer.get("verdicts") or [] if is_correct(v, run) and v.get("time") is not None]
    if not times or injected.get("time") is None:
        return None
    return max(0.0, min(times) - injected["time"])


def step_lag(run: dict, answer: dict) -> Optional[int]:
    """The first correct verdict's step minus the step the injector recorded
    (its rank's completed optimizer steps when the fault fired); None when
    either is unknown (torchrun and fr_trace name no step)."""
    injected = answer.get("injected") or {}
    steps = [v["step"] for v in answer.get("verdicts") or []
             if is_correct(v, run) and isinstance(v.get("step"), int)]
    if not steps or not isinstance(injected.get("step"), int):
        return None
    return steps[0] - injected["step"]


@dataclass
class KindScore:
    """One tool on the runs of one fault kind."""
    tool: str
    kind: str
    expected: Optional[str]
    runs: int = 0
    not_injected: int = 0
    hits: int = 0
    culprit_hits: int = 0
    verdicts: int = 0
    correct_verdicts: int = 0
    latencies: list = field(default_factory=list)
    misses: list = field(default_factory=list)  # run ids without a correct verdict
    step_lags: list = field(default_factory=list)  # correct verdict's step - the injection's step

    @property
    def recall(self) -> Proportion:
        return wilson(self.hits, self.runs)

    @property
    def culprit_accuracy(self) -> Proportion:
        return wilson(self.culprit_hits, self.runs)

    @property
    def median(self) -> Quantile:
        return quantile(self.latencies, 0.5)

    @property
    def p95(self) -> Quantile:
        return quantile(self.latencies, 0.95)


@dataclass
class PrecisionScore:
    """One tool's verdicts of one verdict kind (or of every kind: "all")."""
    tool: str
    verdict_kind: str
    verdicts: int = 0
    correct: int = 0
    on_healthy: int = 0
    wrong: list = field(default_factory=list)  # (run id, verdict kind, ranks)

    @property
    def precision(self) -> Proportion:
        return wilson(self.correct, self.verdicts)


def score_kinds(runs: list[dict], tool: str) -> dict[str, KindScore]:
    """Per fault kind (and "healthy": runs and the verdicts given on them)."""
    out: dict[str, KindScore] = {}
    for run in runs:
        kind = run["kind"]
        s = out.setdefault(kind, KindScore(tool, kind, run.get("expected")))
        state = status(run, tool)
        if state == "not_injected":
            s.not_injected += 1
        if state != "scored":
            continue
        answer = run["tools"][tool]
        s.runs += 1
        verdicts = answer.get("verdicts") or []
        s.verdicts += len(verdicts)
        s.correct_verdicts += sum(1 for v in verdicts if is_correct(v, run))
        if kind == HEALTHY:
            continue
        if any(is_correct(v, run) for v in verdicts):
            s.hits += 1
            latency = time_to_verdict(run, answer)
            if latency is not None:
                s.latencies.append(latency)
            lag = step_lag(run, answer)
            if lag is not None:
                s.step_lags.append(lag)
        else:
            s.misses.append(run["run_id"])
        if any(names_culprit(v, run) for v in verdicts):
            s.culprit_hits += 1
    return out


def score_precision(runs: list[dict], tool: str) -> dict[str, PrecisionScore]:
    """Per verdict kind the tool gave, and "all"."""
    out: dict[str, PrecisionScore] = {"all": PrecisionScore(tool, "all")}
    for run in runs:
        answer = scored(run, tool)
        if answer is None:
            continue
        for v in answer.get("verdicts") or []:
            for key in (v.get("kind") or "?", "all"):
                p = out.setdefault(key, PrecisionScore(tool, key))
                p.verdicts += 1
                if is_correct(v, run):
                    p.correct += 1
                else:
                    if run["kind"] == HEALTHY:
                        p.on_healthy += 1
                    if key != "all":
                        p.wrong.append((run["run_id"], v.get("kind"), list(v.get("ranks") or [])))
    return out


def score_overall(runs: list[dict], tool: str) -> KindScore:
    """Every fault run of every kind together (healthy runs excluded: they
    have no culprit; they count in precision)."""
    total = KindScore(tool, "all faults", None)
    for kind, s in score_kinds(runs, tool).items():
        if kind == HEALTHY:
            continue
        total.runs += s.runs
        total.not_injected += s.not_injected
        total.hits += s.hits
        total.culprit_hits += s.culprit_hits
        total.verdicts += s.verdicts
        total.correct_verdicts += s.correct_verdicts
        total.latencies += s.latencies
        total.step_lags += s.step_lags
        total.misses += s.misses
    return total
