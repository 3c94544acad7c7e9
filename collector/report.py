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
                       termination=run.termination)


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
    return out
