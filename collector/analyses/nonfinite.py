"""`nonfinite`: NaN/Inf in a rank's local loss or local gradients, before
they were averaged. Every rank is NaN one step later; the origin is the rank
(or ranks) that were non-finite at the earliest step.

Under AMP's GradScaler an overflow step that the scaler skips is normal; many
skips in a row are not (the scale collapses and training stalls).

A dead run: every rank's loss non-finite at DEAD_STEPS optimizer steps in a
row. Each of those steps applied the gradients of a non-finite loss, so the
weights are non-finite too and nothing in training can bring them back; the
job only burns compute (and may overwrite good checkpoints). It is the same
incident as the non-finite origin: one verdict, with ``evidence.dead_run``.
A step the scaler skipped is no optimizer step (no record): a skipped fp16
step, or a run of them, is never counted here. What happens then is
``on_dead_run``: ``report`` (default: one loud live line, and the evidence),
``abort`` (bundles, then end the job), ``ignore``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from rankwatch import wire

from ..state import RunState
from .common import ranks_text, register_tracker, settle, tracker, verb, verdict

REPEATED_SKIPS = 20  # consecutive skipped overflow steps that make a verdict


KEPT_STEPS = 4  # the earliest non-finite steps kept (the origin and what followed)
# Optimizer steps in a row with every rank's loss non-finite that make a run
# dead: the first may be the one whose update brought the non-finite values
# in (the origin's step is one before); two more that applied non-finite
# gradients to those weights leave no doubt.
DEAD_STEPS = 3


class _Skips:
    __slots__ = ("length", "best", "previous", "start")

    def __init__(self) -> None:
        self.length, self.best, self.previous, self.start = 0, 0, None, None


class Tracker:
    """The earliest non-finite steps (step -> rank -> what), from events and
    step records in any order (an event's details win over a record's), and
    per rank the running count of consecutive skipped overflow steps."""

    def __init__(self) -> None:
        self.bad: dict[int, dict[int, tuple[int, dict[str, Any]]]] = {}
        self.skips: dict[int, _Skips] = {}
        self.repeated: set[int] = set()  # ranks with REPEATED_SKIPS in a row, at some point
        # step -> ranks whose loss itself was not finite (the earliest steps):
        # the forward already made it, so the input batch or the forward is the cause.
        self.bad_loss: dict[int, set[int]] = {}
        # The run of consecutive steps with every rank's loss non-finite: (first step, last step, at).
        self.all_bad: Optional[tuple[int, int, float]] = None
        self.dead: Optional[dict[str, Any]] = None  # set once: the run is dead from here on

    def _note(self, step: int, rank: int, priority: int, details: dict[str, Any]) -> None:
        at_step = self.bad.get(step)
        if at_step is None:
            if len(self.bad) >= KEPT_STEPS:
                latest = max(self.bad)
                if step > latest:
                    return
                del self.bad[latest]
            at_step = self.bad[step] = {}
        known = at_step.get(rank)
        if known is None or priority > known[0]:
            at_step[rank] = (priority, details)

    def on_nonfinite(self, run: RunState, records: list[tuple[int, wire.StepRecord]]) -> None:
        for rank, record in records:
            self._note_record(run, rank, record)

    def _note_record(self, run: RunState, rank: int, record: wire.StepRecord) -> None:
        """One record ingest picked: its loss, its gradients or both were not finite."""
        bad_loss = record.loss is not None and not math.isfinite(record.loss)
        if bad_loss:
            self.bad_loss.setdefault(record.step, set()).add(rank)
            if len(self.bad_loss) > KEPT_STEPS:
                del self.bad_loss[max(self.bad_loss)]
        if record.nonfinite_grads or bad_loss:
            self._note(record.step, rank, 0, {
                "at": record.ended_at, "source": "local_gradients" if record.nonfinite_grads else "loss",
                "parameters": [], "loss": record.loss})

    def on_step(self, run: RunState, step: int, records: dict[int, wire.StepRecord]) -> None:
        # Each non-finite record of this step came to on_nonfinite when
        # settle took it, and no record changes after: a record comes to the
        # analyses once (a re-sent one stops at RankState.add_step), and a GPU
        # rank's agent holds a step's record until its loss is read (or sends
        # it without one when held too long: agent/watch/progress.py). So only
        # the whole step is judged here; a walk of 100,000 records cost ~0.1 s
        # a step on a slow machine.
        if self.dead is None:
            self._judge_dead(run, step, records)

    def _judge_dead(self, run: RunState, step: int, records: dict[int, wire.StepRecord]) -> None:
        world = max(run.world_size, len(run.ranks))
        every_rank_bad = (len(records) >= world > 0 and all(
            r.loss is not None and not math.isfinite(r.loss) for r in records.values()))
        if not every_rank_bad:
            self.all_bad = None
            return
        at = max(r.ended_at for r in records.values())
        run_of = self.all_bad
        if run_of is None or step != run_of[1] + 1:
            run_of = (step, step, at)
        else:
            run_of = (run_of[0], step, run_of[2])
        self.all_bad = run_of
        if run_of[1] - run_of[0] + 1 >= DEAD_STEPS:
            self.dead = {"since_step": run_of[0], "confirmed_at_step": step, "steps": DEAD_STEPS,
                         "since_at": run_of[2], "at": at}

    def on_event(self, run: RunState, rank: int, event: wire.Event) -> None:
        if event.kind == "nonfinite" and event.step is not None:
            self._note(event.step, rank, 1, {"at": event.at, **event.details})
        elif event.kind == "overflow_skipped":
            s = self.skips.get(rank)
            if s is None:
                s = self.skips[rank] = _Skips()
            s.length = s.length + 1 if s.previous is not None and event.step == s.previous else 1
            s.previous = event.step  # skipped steps do not advance the optimizer step
            if s.length == 1:
                s.start = event
            s.best = max(s.best, s.length)
            if s.best >= REPEATED_SKIPS:
                self.repeated.add(rank)


register_tracker("nonfinite", Tracker)


def _bad_steps(run: RunState) -> dict[int, dict[int, dict[str, Any]]]:
    """step -> rank -> what was non-finite there (the earliest steps)."""
    settle(run)
    bad = tracker(run, "nonfinite").bad
    return {step: {r: d for r, (_, d) in per.items()} for step, per in bad.items()}


def detect(run: RunState, now: float, final: bool) -> list[wire.Verdict]:
    settle(run, final)
    found = []
    state = tracker(run, "nonfinite")
    bad = {step: {r: d for r, (_, d) in per.items()} for step, per in state.bad.items()}
    if bad:
        step = min(bad)
        origin = bad[step]
        first = min(d["at"] for d in origin.values())
        rank = min(origin)
        params = origin[rank].get("parameters") or []
        source = origin[rank].get("source", "local_gradients")
        what = "local gradients" if source == "local_gradients" else "loss"
        forward = sorted(state.bad_loss.get(step, set()) & set(origin))
        summary = f"{ranks_text(origin).capitalize()} produced non-finite {what} at step {step}, before the allreduce"
        if forward:
            summary += (f"; the loss of {ranks_text(forward)} was already non-finite in the forward, so the NaN/Inf "
                        f"came from that rank's input batch or its forward pass, not the backward: look at its "
                        f"batch at that step")
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
            "loss_nonfinite_in_forward": forward,
            "contaminated_from_step": later[0] if later else None,
        }
        if state.dead is not None:
            dead = state.dead
            summary += (f" Training is dead: the loss has been non-finite on every rank at every optimizer step "
                        f"since step {dead['since_step']} ({dead['steps']} in a row by step "
                        f"{dead['confirmed_at_step']}), so the weights are non-finite and the job only burns compute "
                        f"(on_dead_run: abort ends such a run).")
            evidence["dead_run"] = dict(dead)
        found.append(verdict("nonfinite", origin, step, first, now, summary, evidence))
    found.extend(_repeated_skips(run, now))
    return found


def _repeated_skips(run: RunState, now: float) -> list[wire.Verdict]:
    culprits, evidence, first_at, first_step = [], {}, None, None
    t = tracker(run, "nonfinite")
    for rank in sorted(t.repeated):
        s = t.skips[rank]
        best, start = s.best, s.start
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
