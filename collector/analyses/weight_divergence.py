"""`weight_divergence`: replicas that must hold identical parameters do not.

Compares the per-tensor fingerprints that every rank sends out of band for
the same step. The culprits are the ranks that differ from the majority;
with no majority (two ranks), the ranks that differ from rank 0, whose
weights DDP itself broadcasts as the reference; a tie without rank 0 (it
sampled that step out) decides nothing. Parameters only: buffers
(BatchNorm running statistics) differ legitimately between DDP's broadcasts.
"""

from __future__ import annotations

import math
from typing import Optional

from rankwatch import wire

from ..state import RunState
from .common import ranks_text, register_tracker, settle, tracker, verb, verdict

RTOL = 1e-5


def _same(a: list[float], b: list[float]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if math.isnan(x) and math.isnan(y):
            continue
        if not math.isclose(x, y, rel_tol=RTOL, abs_tol=1e-12):
            return False
    return True


def _compared(names) -> Optional[list[int]]:
    """Indices of the tensors DDP keeps identical at step end: parameters.
    Buffers (BatchNorm running statistics, anything with broadcast_buffers=False)
    legitimately differ between replicas until DDP's next broadcast: not compared.
    None: compare everything (no names, or no buffers)."""
    if not names:
        return None
    keep = [i for i, n in enumerate(names) if not str(n).startswith("buffer:")]
    return None if len(keep) == len(names) else keep


class Tracker:
    """The first fingerprint step at which the replicas disagree. Per sealed
    fingerprint step: ranks grouped by their exact norms first (a hash, O(ranks
    x tensors) in C), then the groups merged within tolerance."""

    def __init__(self) -> None:
        self.finding: Optional[dict] = None
        self._selection: dict[int, Optional[list[int]]] = {}  # id(names list) -> compared indices

    def _values(self, fp: dict) -> Optional[tuple]:
        norms = fp.get("norms")
        if not isinstance(norms, list):
            return None
        names = fp.get("names")
        key = id(names)
        if key not in self._selection:
            self._selection[key] = _compared(names)
        keep = self._selection[key]
        if keep is None:
            return tuple(norms)
        return tuple(norms[i] for i in keep if i < len(norms))

    def on_prints(self, run: RunState, step: int, prints: dict[int, dict]) -> None:
        if self.finding is not None or len(prints) < 2:
            return
        exact: dict[tuple, list[int]] = {}
        for rank in sorted(prints):
            values = self._values(prints[rank])
            if values is not None:
                exact.setdefault(values, []).append(rank)
        groups: list[tuple[tuple, list[int]]] = []
        for values, ranks in exact.items():
            for group_values, group in groups:
                if _same(list(group_values), list(values)):
                    group.extend(ranks)
                    break
            else:
                groups.append((values, list(ranks)))
        if len(groups) <= 1:
            return
        ordered = sorted((sorted(g) for _, g in groups), key=lambda g: (-len(g), g[0]))
        if len(ordered[0]) > len(ordered[1]):
            reference = ordered[0]
        else:
            reference = next((g for g in ordered if 0 in g), None)
            if reference is None:
                # A tie without rank 0 (whose weights DDP broadcasts): a rank that
                # sampled this step out would be the tie-breaker. Undecidable here;
                # a step with a majority or with rank 0 decides.
                return
        culprits = sorted(r for g in ordered if g is not reference for r in g)
        ref, odd = prints[reference[0]], prints[culprits[0]]
        names = list(ref.get("names") or [])
        keep = _compared(names)
        indices = range(min(len(ref["norms"]), len(odd["norms"]))) if keep is None else keep
        differing = [names[i] if i < len(names) else f"#{i}" for i in indices
                     if i < len(ref["norms"]) and i < len(odd["norms"])
                     and not _close(ref["norms"][i], odd["norms"][i])]
        shown = set(differing[:8])
        sample = sorted(prints) if len(prints) <= 64 else sorted(set(reference[:32]) | set(culprits[:32]))
        ended = [run.ranks[r].steps[step].ended_at for r in culprits[:64]
                 if r in run.ranks and step in run.ranks[r].steps]
        self.finding = {
            "step": step, "reference": reference, "culprits": culprits, "differing": differing,
            "first_at": min(ended) if ended else None,
            "norms": {str(r): {n: v for n, v in zip(names, prints[r]["norms"]) if n in shown} for r in sample},
        }


def _close(x: float, y: float) -> bool:
    if math.isnan(x) and math.isnan(y):
        return True
    return math.isclose(x, y, rel_tol=RTOL, abs_tol=1e-12)


register_tracker("weight_divergence", Tracker)


def detect(run: RunState, now: float, final: bool) -> list[wire.Verdict]:
    settle(run, final)
    finding = tracker(run, "weight_divergence").finding
    if finding is None:
        return []
    step, reference, culprits, differing = (finding["step"], finding["reference"], finding["culprits"],
                                            finding["differing"])
    summary = (f"{ranks_text(culprits).capitalize()} {verb(culprits, 'holds', 'hold')} different weights from "
               f"{ranks_text(reference)} after step {step}: {len(differing)} tensor(s) differ, first "
               f"{', '.join(differing[:3])}. The replicas no longer train the same model (a missed broadcast, "
               f"a rank-local update, or silent data corruption).")
    first = finding["first_at"] if finding["first_at"] is not None else now
    evidence = {"reference_ranks": reference, "differing_tensors": differing[:32], "norms": finding["norms"]}
    return [verdict("weight_divergence", culprits, step, first, now, summary, evidence)]
