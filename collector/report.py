"""The report a run's verdicts make (CONTRACT.md `report.json`); written and
printed by `rankwatch.outputs.report`."""

from __future__ import annotations

import dataclasses

from rankwatch import wire

from .analyses.common import where
from .state import RunState


def build(run: RunState, verdicts: list[wire.Verdict]) -> wire.Report:
    world = run.world_size or (max(run.ranks) + 1 if run.ranks else 0)
    ordered = list(verdicts)  # run_all orders them: root causes first
    seen: set[str] = set()
    for i, v in enumerate(ordered):
        base = v.id or wire.verdict_id(v.kind, v.step, v.ranks)
        vid, n = base, 1
        while vid in seen:  # unique within the report
            n += 1
            vid = f"{base}#{n}"
        seen.add(vid)
        if vid != v.id:
            ordered[i] = dataclasses.replace(v, id=vid)
    return wire.Report(run_id=run.run_id, world_size=world,
                       status="faulty" if ordered else "healthy", verdicts=ordered, notes=notes(run),
                       margins=margins(run, ordered), termination=run.termination)


def margins(run: RunState, verdicts: list[wire.Verdict]) -> dict[str, dict]:
    """Each check's worst margin in the run (analyses/common.note_margin): 1.0
    where it fired (its verdict, or a consequence folded into one), else the
    largest statistic / threshold seen; checks without a graded statistic
    are 0.0 until they fire."""
    from .analyses import ANALYSES, common

    out: dict[str, dict] = {}
    for module in ANALYSES:
        check = module.__name__.rsplit(".", 1)[-1]
        out[check] = {"margin": 0.0, "step": None, "rank": None, "graded": False}
    for check, worst in common.margins(run).items():
        out[check] = {**worst, "margin": round(worst["margin"], 4), "graded": True}
    fired = [(v.kind, v.step, v.ranks) for v in verdicts]
    for v in verdicts:
        fired.extend((c.get("kind"), c.get("step"), c.get("ranks")) for c in (v.evidence or {}).get("consequences", [])
                     if isinstance(c, dict))
    for kind, step, ranks in fired:
        if isinstance(kind, str):
            out[kind] = {**out.get(kind, {"graded": False}), "margin": 1.0, "step": step,
                         "rank": (ranks or [None])[0]}
    return out


def notes(run: RunState) -> list[str]:
    """Stalls that ended by themselves, then gradient-flow observations, once
    per kind (every rank reports the same)."""
    out = stall_notes(run)
    for kind, text in (("unused_parameters", "never received a gradient in the first steps"),
                       ("zero_gradients", "always had an exactly zero gradient")):
        for rank in sorted(run.ranks):
            event = next((e for e in run.ranks[rank].events if e.kind == kind), None)
            if event is not None:
                names = event.details.get("parameters") or []
                out.append(f"parameters that {text} (rank {rank}): {', '.join(map(str, names[:10]))}")
                break
    shadowed = [(rank, e) for rank in sorted(run.ranks)
                for e in run.ranks[rank].events if e.kind == "join_shadowed"][:1]
    for rank, event in shadowed:
        more = len({r for r in run.ranks for e in run.ranks[r].events if e.kind == "join_shadowed"}) - 1
        out.append(f"rank {rank}{f' and {more} other rank(s)' if more else ''} ran out of inputs in a DDP Join and "
                   f"shadowed its peers from step {event.step}: its optimizer skipped steps they took, so its "
                   f"state (momentum, Adam's moments and step count) differs from theirs and its weights drift "
                   f"between Join's re-syncs, by design; weight_divergence no longer compares such a rank's "
                   f"weights (the others are still compared among themselves)")
    for rank in sorted(run.ranks):
        event = next((e for e in run.ranks[rank].events if e.kind == "update_unjudged"), None)
        if event is not None:
            names = event.details.get("parameters") or []
            out.append(f"broken_update could not judge parameters whose update is below their float resolution "
                       f"(rank {rank}, step {event.step}; a healthy step leaves them unchanged): "
                       f"{', '.join(map(str, names[:10]))}")
            break
    return out


MAX_STALL_NOTES = 20


def stall_notes(run: RunState) -> list[str]:
    """A stall that was named and then ended by itself (a checkpoint upload,
    a long rank-0 evaluation) is not a verdict (CONTRACT.md, 2026-11-25):
    one note each, with its rank, place and duration."""
    out = []
    diagnosed = run.trackers.get("_hang_diagnoses", {})
    ended = [i for i in run.incidents if i.kind == "hang" and "ended_at" in i.details]
    for incident in ended[:MAX_STALL_NOTES]:
        found = diagnosed.get(incident.id)
        v = found[1] if found else None
        seconds = incident.details.get("stalled_s")
        lasted = f"{seconds:.1f} s" if isinstance(seconds, (int, float)) else "a while"
        if v is None:
            out.append(f"stall (not a hang, it ended by itself): no rank made progress for {lasted} "
                       f"(incident {incident.id})")
            continue
        stack = v.evidence.get("culprit_stack") or []
        place = where(stack) if stack else "an unknown place"
        ranks = ", ".join(map(str, v.ranks))
        named = incident.details.get("diagnosed_at")
        after = (f"named {named - incident.last_progress_at:.1f} s after the last progress"
                 if isinstance(named, (int, float)) else "named")
        out.append(f"stall (not a hang, it ended by itself): rank(s) {ranks} made no progress for {lasted} at "
                   f"{place} (step {v.step}) while the others waited for it; {after} "
                   f"(hang timeout {incident.timeout or 0:.1f} s, incident {incident.id})")
    if len(ended) > MAX_STALL_NOTES:
        out.append(f"{len(ended) - MAX_STALL_NOTES} more stalls ended by themselves (not listed)")
    return out
