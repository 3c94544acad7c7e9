"""`weight_divergence`: replicas that must hold identical parameters do not.

Compares the per-tensor fingerprints that every rank sends out of band for
the same step. The culprits are the ranks that differ from the majority;
with no majority (two ranks), the ranks that differ from rank 0, whose
weights DDP itself broadcasts as the reference.
"""

from __future__ import annotations

import math

from rankwatch import wire

from ..state import RunState
from .common import ranks_text, verb, verdict

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


def detect(run: RunState, now: float, final: bool) -> list[wire.Verdict]:
    by_step: dict[int, dict[int, dict]] = {}
    for rank, state in run.ranks.items():
        for fp in state.fingerprints:
            step = fp.get("step")
            if isinstance(step, int) and isinstance(fp.get("norms"), list):
                by_step.setdefault(step, {})[rank] = fp
    for step in sorted(by_step):
        prints = by_step[step]
        if len(prints) < 2:
            continue
        groups: list[list[int]] = []
        for rank in sorted(prints):
            for group in groups:
                if _same(prints[group[0]]["norms"], prints[rank]["norms"]):
                    group.append(rank)
                    break
            else:
                groups.append([rank])
        if len(groups) == 1:
            continue
        groups.sort(key=len, reverse=True)
        if len(groups[0]) > len(groups[1]):
            reference = groups[0]
        else:
            reference = next((g for g in groups if 0 in g), groups[0])
        culprits = sorted(r for g in groups if g is not reference for r in g)
        ref = prints[reference[0]]
        odd = prints[culprits[0]]
        names = ref.get("names") or []
        differing = [names[i] if i < len(names) else f"#{i}"
                     for i, (x, y) in enumerate(zip(ref["norms"], odd["norms"]))
                     if not math.isclose(x, y, rel_tol=RTOL, abs_tol=1e-12)]
        summary = (f"{ranks_text(culprits).capitalize()} {verb(culprits, 'holds', 'hold')} different weights from {ranks_text(reference)} after "
                   f"step {step}: {len(differing)} tensor(s) differ, first {', '.join(differing[:3])}. "
                   f"The replicas no longer train the same model (a missed broadcast, a rank-local update, or "
                   f"silent data corruption).")
        first = min((run.ranks[r].steps[step].ended_at for r in culprits if step in run.ranks[r].steps), default=now)
        evidence = {"reference_ranks": reference, "differing_tensors": differing[:32],
                    "norms": {str(r): {n: v for n, v in zip(names, prints[r]["norms"]) if n in differing[:8]}
                              for r in sorted(prints)}}
        return [verdict("weight_divergence", culprits, step, first, now, summary, evidence)]
    return []
