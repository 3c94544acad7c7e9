"""`nonfinite`: NaN/Inf in a rank's local loss or local gradients, before
they were averaged. Every rank is NaN one step later; the origin is the rank
(or ranks) that were non-finite at the earliest step.

Under AMP's GradScaler an overflow step that the scaler skips is normal; many
skips in a row are not (the scale collapses and training stalls).
"""

from __future__ import annotations

import math
from typing import Any

from rankwatch import wire

from ..state import RunState
from .common import ranks_text, verb, verdict

REPEATED_SKIPS = 20  # consecutive skipped overflow steps that make a verdict


def _bad_steps(run: RunState) -> dict[int, dict[int, dict[str, Any]]]:
    """step -> rank -> what was non-finite there."""
    out: dict[int, dict[int, dict[str, Any]]] = {}
    for rank, state in run.ranks.items():
        for event in state.events:
            if event.kind == "nonfinite" and event.step is not None:
                out.setdefault(event.step, {})[rank] = {"at": event.at, **event.details}
        for record in state.steps.values():
            bad_loss = record.loss is not None and not math.isfinite(record.loss)
            if (record.nonfinite_grads or bad_loss) and rank not in out.get(record.step, {}):
                out.setdefault(record.step, {})[rank] = {
                    "at": record.ended_at, "source": "local_gradients" if record.nonfinite_grads else "loss",
                    "parameters": [], "loss": record.loss}
    return out


def detect(run: RunState, now: float, final: bool) -> list[wire.Verdict]:
    found = []
    bad = _bad_steps(run)
    if bad:
        step = min(bad)
        origin = bad[step]
        first = min(d["at"] for d in origin.values())
        rank = min(origin)
        params = origin[rank].get("parameters") or []
        source = origin[rank].get("source", "local_gradients")
        what = "local gradients" if source == "local_gradients" else "loss"
        summary = f"{ranks_text(origin).capitalize()} produced non-finite {what} at step {step}, before the allreduce"
        if len(origin) == len(run.ranks) > 1:
            summary += " (every rank at once: a common cause, such as weights already blown up by an earlier update)"
        if params:
            summary += f"; first parameter(s) affected: {', '.join(params[:4])}"
        others = sorted(set(run.ranks) - set(origin))
        if others:
            summary += (f". {ranks_text(others).capitalize()} {verb(others, 'was', 'were')} finite at that step and "
                        f"{verb(others, 'was', 'were')} contaminated by the average")
        summary += "."
        later = sorted(s for s in bad if s > step)
        evidence = {
            "origin": {str(r): d for r, d in sorted(origin.items())},
            "parameters": params,
            "source": source,
            "contaminated_from_step": later[0] if later else None,
        }
        found.append(verdict("nonfinite", origin, step, first, now, summary, evidence))
    found.extend(_repeated_skips(run, now))
    return found


def _repeated_skips(run: RunState, now: float) -> list[wire.Verdict]:
    culprits, evidence, first_at, first_step = [], {}, None, None
    for rank, state in run.ranks.items():
        skips = [e for e in state.events if e.kind == "overflow_skipped"]
        run_length, best, start = 0, 0, None
        previous_step = None
        for event in skips:
            run_length = run_length + 1 if previous_step is not None and event.step == previous_step else 1
            previous_step = event.step  # skipped steps do not advance the optimizer step
            if run_length == 1:
                start = event
            best = max(best, run_length)
        if best >= REPEATED_SKIPS and start is not None:
            culprits.append(rank)
            evidence[str(rank)] = {"consecutive_skipped_steps": best, "parameters": start.details.get("parameters")}
            if first_at is None or start.at < first_at:
                first_at, first_step = start.at, start.step
    if not culprits:
        return []
    summary = (f"{ranks_text(culprits).capitalize()} overflowed {max(v['consecutive_skipped_steps'] for v in evidence.values())} "
               f"steps in a row: the gradient scaler skips every step, training has stalled.")
    return [verdict("nonfinite", culprits, first_step, first_at, now, summary, {"repeated_skips": evidence})]
