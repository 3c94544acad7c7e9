"""The report a run's verdicts make (CONTRACT.md `report.json`); written and
printed by `rankwatch.outputs.report`."""

from __future__ import annotations

import dataclasses

from rankwatch import wire

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
                       margins=margins(run, ordered))


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
    """Gradient-flow observations, once per kind (every rank reports the same)."""
    out = []
    for kind, text in (("unused_parameters", "never received a gradient in the first steps"),
                       ("zero_gradients", "always had an exactly zero gradient")):
        for rank in sorted(run.ranks):
            event = next((e for e in run.ranks[rank].events if e.kind == kind), None)
            if event is not None:
                names = event.details.get("parameters") or []
                out.append(f"parameters that {text} (rank {rank}): {', '.join(map(str, names[:10]))}")
                break
    for rank in sorted(run.ranks):
        event = next((e for e in run.ranks[rank].events if e.kind == "update_unjudged"), None)
        if event is not None:
            names = event.details.get("parameters") or []
            out.append(f"broken_update could not judge parameters whose update is below their float resolution "
                       f"(rank {rank}, step {event.step}; a healthy step leaves them unchanged): "
                       f"{', '.join(map(str, names[:10]))}")
            break
    return out
