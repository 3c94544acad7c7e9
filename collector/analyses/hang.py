"""`hang`: no progress past the hang timeout. The culprits are the ranks that
did not reach the collective the others wait in, or that left the loop.

Heartbeats alone cannot tell (a side thread keeps beating while the loop is
stuck, and every rank stops stepping at once). The evidence is each rank's
collective sequence number (Flight Recorder's pg_status, from its bundle or
last heartbeat) and its main-thread stack:
1. ranks that exited while the others wait left the training loop;
2. per process group, ranks whose last enqueued collective is behind the
   others' never reached the collective the others wait in;
3. otherwise, stack outliers: ranks whose main thread is not parked in a
   collective while the majority is.
"""

from __future__ import annotations

from typing import Any, Optional

from rankwatch import wire

from ..evidence import RankEvidence
from ..state import Incident, RunState
from .common import in_dataloader, located, ranks_text, verb, verdict, waits_in_collective, where


def detect(run: RunState, now: float, final: bool) -> list[wire.Verdict]:
    out = []
    for incident in run.incidents:
        if incident.kind == "hang" and incident.ready:
            found = diagnose(run, incident)
            if found is not None:
                out.append(found)
    return out


def diagnose(run: RunState, incident: Incident) -> Optional[wire.Verdict]:
    evidence = run.evidence_for(incident.id)
    ranks = sorted(run.ranks)
    if not ranks:
        return None
    exited = [r for r in ranks if run.ranks[r].exit_code is not None
              and (run.ranks[r].exited_at or 0) <= incident.opened_at and not run.ranks[r].killed_by_rankwatch]
    live = [r for r in ranks if r not in exited]
    seqs = {r: _enqueued(run, r, evidence.get(r)) for r in ranks}
    details: dict[str, Any] = {"ranks": {}}
    for r in ranks:
        ev = evidence.get(r)
        state = run.ranks[r]
        stack = ev.main_stack if ev else []
        details["ranks"][str(r)] = {
            "step": state.step,
            "phase": state.phase,
            "collective_seq": seqs[r],
            "exited": r in exited,
            "exit_code": state.exit_code,
            "where": where(stack) if stack else None,
            "waiting_in_collective": waits_in_collective(stack) if stack else None,
            "bundle": ev.bundle_path if ev else None,
            "native_stack": bool(ev and ev.native_stacks),
        }

    culprits: list[int] = []
    reason = ""
    if exited and live:
        culprits = exited
        reason = "left the training loop and exited while the others still wait for it"
    if not culprits:
        culprits, reason = _behind_in_collectives(seqs, live, details)
    if not culprits:
        culprits, reason = _stack_outliers(live, evidence)
    if not culprits:
        culprits = live or ranks
        reason = "every rank stopped making progress and no rank stands out (a stuck collective or a shared dependency)"

    first = culprits[0]
    state = run.ranks[first]
    ev = evidence.get(first)
    stack = ev.main_stack if ev else []
    step = state.step
    others = [r for r in ranks if r not in culprits]
    summary = f"{ranks_text(culprits).capitalize()} {reason}"
    if stack:
        location = where(stack)
        if in_dataloader(stack):
            summary += f"; its main thread waits for a DataLoader worker at {location}"
        else:
            summary += f"; its main thread is at {location}"
    elif ev and ev.native_stacks:
        summary += "; see its native stack (py-spy) in the bundle"
    summary += f" (step {step}, phase {state.phase}; {located(run, culprits[:1])})."
    if others:
        summary += f" {ranks_text(others).capitalize()} {verb(others, 'waits', 'wait')} for it."
    stalled = max(0.0, incident.opened_at - incident.last_progress_at)
    details.update({
        "incident": incident.id,
        "hosts": {str(r): run.ranks[r].host for r in culprits},
        "located": located(run, culprits),
        "hang_timeout_s": incident.timeout,
        "stalled_for_s": round(stalled, 3),
        "reason": reason,
        "culprit_stack": stack[-12:],
    })
    return verdict("hang", culprits, step, incident.last_progress_at, incident.details.get("diagnosed_at"),
                   summary, details)


def _enqueued(run: RunState, rank: int, ev: Optional[RankEvidence]) -> Optional[dict[str, int]]:
    if ev is not None and ev.pg_enqueued:
        return dict(ev.pg_enqueued)
    state = run.ranks[rank]
    return dict(state.enqueued) if state.enqueued else None


def _behind_in_collectives(seqs: dict[int, Optional[dict[str, int]]], live: list[int],
                           details: dict[str, Any]) -> tuple[list[int], str]:
    known = {r: seqs[r] for r in live if seqs.get(r)}
    if len(known) < 2:
        return [], ""
    pgs = sorted({pg for s in known.values() for pg in s})
    behind: set[int] = set()
    waiting_at: dict[str, int] = {}
    for pg in pgs:
        members = {r: s[pg] for r, s in known.items() if pg in s}
        if len(members) < 2:
            continue
        top = max(members.values())
        lagging = [r for r, v in members.items() if v < top]
        if lagging and len(lagging) < len(members):
            behind.update(lagging)
            waiting_at[pg] = top
    if not behind:
        return [], ""
    details["waiting_at"] = waiting_at
    pg, seq = next(iter(waiting_at.items()))
    return sorted(behind), f"never reached collective #{seq} of process group {pg}"


def _stack_outliers(live: list[int], evidence: dict[int, RankEvidence]) -> tuple[list[int], str]:
    waiting = {r: waits_in_collective(evidence[r].main_stack) for r in live if r in evidence and evidence[r].main_stack}
    if len(waiting) < 2:
        return [], ""
    not_waiting = [r for r, w in waiting.items() if not w]
    if not_waiting and len(not_waiting) < len(waiting):
        return sorted(not_waiting), "is not in a collective while the others wait in one"
    return [], ""
