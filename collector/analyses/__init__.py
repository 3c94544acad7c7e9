"""The collector's analyses: one module per verdict kind.

Each module exposes ``detect(run, now, final) -> list[Verdict]``, a pure
function of the `RunState`; the live collector calls it every tick, and
``rankwatch analyze`` calls the same function on a state rebuilt from disk.
`run_all` then keeps root causes and drops their consequences.
"""

from __future__ import annotations

import datetime as _dt

from rankwatch import wire

from ..state import RunState
from . import (collective_mismatch, crash, grad_spike, hang, memory_growth, nonfinite, oom, straggler,
               weight_divergence)

# Order matters only for reading: root causes first.
ANALYSES = [
    collective_mismatch,
    hang,
    crash,
    nonfinite,
    grad_spike,
    weight_divergence,
    straggler,
    memory_growth,
    oom,
]


def register(module) -> None:
    """Add an analysis module (used by the optional numerical/memory analyses)."""
    if module not in ANALYSES:
        ANALYSES.append(module)


def run_all(run: RunState, now: float, final: bool) -> list[wire.Verdict]:
    found: list[wire.Verdict] = []
    for module in ANALYSES:
        found.extend(module.detect(run, now, final))
    return explain_away(found)


def _t(text: str) -> float:
    return _dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def explain_away(verdicts: list[wire.Verdict]) -> list[wire.Verdict]:
    return _after_spikes(_after_mismatch(verdicts))


def _after_spikes(verdicts: list[wire.Verdict]) -> list[wire.Verdict]:
    """One rank's gradient spike, averaged into every replica, can blow every
    rank's weights up a step later: a non-finite on all ranks after a spike
    is the spike's consequence."""
    spikes = [v for v in verdicts if v.kind == "grad_spike" and v.step is not None]
    if not spikes:
        return verdicts
    first = min(v.step for v in spikes)
    culprits = {r for v in spikes for r in v.ranks}
    return [v for v in verdicts if not (v.kind == "nonfinite" and v.step is not None and v.step > first
                                        and not set(v.ranks) <= culprits)]


def _after_mismatch(verdicts: list[wire.Verdict]) -> list[wire.Verdict]:
    """A collective mismatch makes ranks hang or abort ("size doesn't match",
    "Connection closed by peer"). A hang or crash verdict that blames other
    ranks than the mismatch is blaming its victims: dropped. One that names
    the same ranks says something true (it did hang, it did die): kept,
    after the root cause."""
    mismatches = [v for v in verdicts if v.kind == "collective_mismatch"]
    if not mismatches:
        return sorted(verdicts, key=lambda v: v.first_seen_at)
    first = min(_t(v.first_seen_at) for v in mismatches)
    culprits = {r for v in mismatches for r in v.ranks}
    kept = []
    for v in verdicts:
        consequence = (v.kind == "crash" and _t(v.first_seen_at) >= first - 1.0) or (
            v.kind == "hang" and _t(v.detected_at) >= first)
        if consequence and not set(v.ranks) <= culprits:
            continue
        kept.append(v)
    return sorted(kept, key=lambda v: (v.kind != "collective_mismatch", v.first_seen_at))
