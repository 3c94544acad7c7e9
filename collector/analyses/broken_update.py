"""`broken_update`: the optimizer step does not do what training needs.

From the agents' `broken_update` events (agent/checks/update_checks.py), taken in
at the seal of their step so that every rank's finding of that step is in:

- `not_in_optimizer`: parameters that get gradients but are in no optimizer
  (a layer replaced after the optimizer was built: the optimizer keeps
  updating the old tensors, the model's new ones never learn);
- `not_updated`: parameters with a non-zero gradient in an optimizer group
  with a learning rate above 0 that do not change when it steps;
- `grads_not_cleared`: gradients never cleared between optimizer steps, so
  every step applies the sum of all gradients so far.

The culprits are the ranks where it happens (usually all); the step is the
first one; one verdict names every check that failed.
"""

from __future__ import annotations

from typing import Optional

from rankwatch import wire

from ..state import RunState
from .common import StepEvents, ranks_text, register_tracker, settle, tracker, verdict

MAX_NAMES = 16


class Tracker:
    def __init__(self) -> None:
        self._events = StepEvents(("broken_update",))
        self.finding: Optional[dict] = None

    def on_event(self, run: RunState, rank: int, event: wire.Event) -> None:
        self._events.add(rank, event)

    def on_step(self, run: RunState, step: int, records: dict[int, wire.StepRecord]) -> None:
        due = self._events.due(step)
        if not due:
            return
        first_seal = self.finding is None
        finding = self.finding
        if finding is None:
            first = min(e.step or 0 for _, e in due)
            ended = [records[r].ended_at for r, e in due if (e.step or 0) == first and r in records]
            finding = self.finding = {"step": first, "checks": {}, "first_at": min(ended) if ended else None}
        for rank, event in due:
            check = event.details.get("check")
            if not isinstance(check, str) or check not in SUMMARIES:
                continue
            entry = finding["checks"].get(check)
            if entry is None:
                entry = finding["checks"][check] = {"ranks": [], "later": [], "step": event.step,
                                                    "details": {k: v for k, v in event.details.items()
                                                                if k != "check"}}
                entry["new"] = True
            # A check's ranks are those of the seal that found it; a rank that reports it later is in
            # its evidence (the verdict's ranks do not move once announced).
            target = entry["ranks"] if entry.get("new") or first_seal else entry["later"]
            if rank not in entry["ranks"] and rank not in target:
                target.append(rank)
        for entry in finding["checks"].values():
            entry.pop("new", None)


def _names(details: dict) -> str:
    names = [str(n) for n in (details.get("parameters") or [])][:6]
    count = details.get("count")
    more = f" ({count} tensors)" if isinstance(count, int) and count > len(names) else ""
    return ", ".join(names) + more if names else "some parameters"


def _not_in_optimizer(d: dict) -> str:
    stale = d.get("optimizer_tensors_not_in_model")
    extra = (f" The optimizers hold {stale} tensor(s) that are no longer in the model: a module replaced after "
             f"the optimizer was built." if isinstance(stale, int) and stale > 0 else "")
    return (f"Parameters {_names(d)} get gradients but are in no optimizer: they never learn.{extra} Build the "
            f"optimizer after the model is final, or add them (optimizer.add_param_group).")


def _not_updated(d: dict) -> str:
    return (f"Parameters {_names(d)} have non-zero gradients and a learning rate above 0, yet are exactly the "
            f"same after the optimizer step: the optimizer does not update the tensors the model uses.")


def _grads_not_cleared(d: dict) -> str:
    return (f"Gradients are never cleared between optimizer steps (checked on {_names(d)}): each step adds the "
            f"new gradients to all the old ones, so the updates grow step after step. Call optimizer.zero_grad() "
            f"(or model.zero_grad()) once per optimizer step.")


SUMMARIES = {"not_in_optimizer": _not_in_optimizer, "not_updated": _not_updated,
             "grads_not_cleared": _grads_not_cleared}


register_tracker("broken_update", Tracker)


def detect(run: RunState, now: float, final: bool) -> list[wire.Verdict]:
    settle(run, final)
    finding = tracker(run, "broken_update").finding
    if finding is None or not finding["checks"]:
        return []
    checks = finding["checks"]
    ranks = sorted({r for entry in checks.values() for r in entry["ranks"]})
    order = [c for c in SUMMARIES if c in checks]
    every = len(ranks) == len(run.ranks) and len(ranks) > 1
    where = "every rank" if every else ranks_text(ranks)
    summary = f"On {where}, from step {finding['step']}: " + " ".join(SUMMARIES[c](checks[c]["details"]) for c in order)
    evidence = {"checks": {c: {"ranks": sorted(checks[c]["ranks"]), "step": checks[c]["step"],
                               "later_ranks": sorted(checks[c]["later"]),
                               **{k: v for k, v in checks[c]["details"].items() if k in (
                                   "parameters", "count", "optimizer_tensors_not_in_model", "confirmed_at",
                                   "checked_after_step")}} for c in order}}
    return [verdict("broken_update", ranks, finding["step"], finding["first_at"] or now, now, summary, evidence)]
