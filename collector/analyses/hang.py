"""`hang`: no progress past the hang timeout. The culprits are the ranks that
did not reach the collective the others wait in, or that left the loop.

Heartbeats alone cannot tell (a side thread keeps beating while the loop is
stuck, and every rank stops stepping at once). The evidence is each rank's
collective sequence number (Flight Recorder's pg_status, from its bundle or
last heartbeat) and its main-thread stack:
1. ranks that exited while the others wait left the training loop;
2. ranks frozen with the GIL held: their heartbeat thread stopped too (the
   supervisor then took their stacks from outside) and their main thread is
   in their own code, not waiting for a peer. This outranks the sequence
   numbers: a frozen rank's last report can be ahead of a peer that waits
   for it (it enqueued an asynchronous collective before it froze, or its
   numbers come from a heartbeat older than the peers' bundles);
3. per process group, ranks whose last enqueued collective is behind the
   others' never reached the collective the others wait in;
4. otherwise, stack outliers: ranks whose main thread is not parked in a
   collective while the majority is.

A rank that leaves the loop and exits cleanly while its peers are inside a
collective with it is found without an incident too (`left_the_loop`): gloo
fails the peers at once ("Connection closed by peer"), so no stall ever
reaches the hang timeout. The peers' failures are its consequences.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from rankwatch import wire

from ..evidence import RankEvidence, fill_source
from ..state import Incident, RunState
from .common import in_dataloader, iso, located, ranks_text, verb, verdict, waits_in_collective, where


def detect(run: RunState, now: float, final: bool) -> list[wire.Verdict]:
    out = []
    left = left_the_loop(run, now)
    if left is not None:
        out.append(left)
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
            "exited_at": state.exited_at if r in exited else None,
            "where": where(stack) if stack else None,
            "waiting_in_collective": waits_in_collective(stack) if stack else None,
            "bundle": ev.bundle_path if ev else None,
            "native_stack": bool(ev and ev.native_stacks),
        }

    culprits: list[int] = []
    reason = ""
    if exited and live:
        culprits = exited
        codes = sorted({run.ranks[r].exit_code for r in exited})
        reason = (f"left the training loop and exited (exit code {', '.join(map(str, codes))}) "
                  f"while the others still wait for it")
    frozen = False
    if not culprits:
        culprits, reason = _frozen(run, incident, live, evidence)
        frozen = bool(culprits)
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
    stack = (outside_frames(ev) if frozen else ev.main_stack) if ev else []
    stack = fill_source(stack, run.all_evidence())
    step = _step_at_stall(state, incident, ev) if frozen else state.step
    others = [r for r in ranks if r not in culprits]
    summary = f"{ranks_text(culprits).capitalize()} {reason}"
    if stack:
        location = where(stack)
        if in_dataloader(stack):
            summary += f"; its main thread waits for a DataLoader worker at {location}"
        else:
            summary += f"; its main thread is at {location}"
    if ev and ev.native_stacks:
        native = _native_top(ev.native_stacks)
        summary += (f"; its native stack (py-spy --native) is in {native}" if native
                    else "; see its native stack (py-spy) in the bundle")
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


# -- a rank frozen with the GIL held ------------------------------------------------

STALE_HEARTBEAT_S = 3.0  # the collector asks for outside stacks past 3 heartbeat intervals (1 s default)


def _frozen(run: RunState, incident: Incident, live: list[int],
            evidence: dict[int, RankEvidence]) -> tuple[list[int], str]:
    """Ranks whose heartbeat thread stopped while their peers' kept beating
    (the supervisor took their native stack: it does so only for such ranks,
    which also keeps this rule working offline from the bundles), and whose
    main thread, seen from outside, is in their own code rather than waiting
    for a peer."""
    frozen = []
    for r in live:
        ev = evidence.get(r)
        if ev is None:
            continue
        stale = bool(ev.native_stacks or ev.faulthandler)
        last = run.ranks[r].last_heartbeat_at
        if not stale and last:
            stale = incident.opened_at - last > STALE_HEARTBEAT_S
        if not stale:
            continue
        stack = outside_frames(ev)
        if (stack and not waits_in_collective(stack)) or (not stack and _main_owns_gil(ev)):
            frozen.append(r)
    if not frozen or len(frozen) == len(live):
        return [], ""  # every rank silent: a node-wide freeze, not one culprit
    held = any(_main_owns_gil(evidence[r]) for r in frozen)
    return sorted(frozen), ("is frozen in its own code" + (" holding the GIL" if held else "")
                            + " (its heartbeat thread stopped too), so the others wait for it")


def outside_frames(ev: RankEvidence) -> list[dict[str, Any]]:
    """The main thread as the supervisor saw it while the rank was silent:
    py-spy's Python stack, else the Python frames of its native dump, else
    faulthandler's. (An agent bundle that arrives later, after the rank came
    back, shows where it went next, not where it was stuck.)"""
    if ev.source != "agent" and ev.main_stack:
        return ev.main_stack
    frames = _native_python_frames(ev.native_stacks)
    if frames:
        return frames
    if ev.faulthandler:
        from rankwatch.faulttext import parse

        threads = parse(ev.faulthandler)
        main = next((t for t in threads if t.get("main")), None)
        if main and main.get("frames"):
            return main["frames"]
    return ev.main_stack


_NATIVE_PY_FRAME = re.compile(r"^\s+(\S.*?) \((\S+\.py):(\d+)\)\s*$")


def _native_python_frames(text: str) -> list[dict[str, Any]]:
    """Python frames of the main thread in `py-spy dump --native` text,
    outermost first (py-spy lists innermost first)."""
    block = _main_block(text)
    frames = []
    for line in block:
        m = _NATIVE_PY_FRAME.match(line)
        if m:
            frames.append({"file": m.group(2), "line": int(m.group(3)), "name": m.group(1), "code": ""})
    return list(reversed(frames))


def _main_block(text: str) -> list[str]:
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Thread ") and '"MainThread"' in line), None)
    if start is None:
        start = next((i for i, line in enumerate(lines) if line.startswith("Thread ")), None)
    if start is None:
        return []
    block = []
    for line in lines[start + 1:]:
        if not line.startswith((" ", "\t")):
            break
        block.append(line)
    return block


def _step_at_stall(state, incident: Incident, ev=None) -> int:
    """The step a frozen rank was in when the stall was diagnosed: a C call
    that a signal ends (the supervisor's faulthandler dump) lets it go on, so
    its latest step says where it went next, not where it froze. A rank still
    frozen sends no bundle of its own; its black box, read from outside by the
    supervisor, has the step its stopped heartbeat thread could not report."""
    offset = getattr(state, "clock_offset", None) or 0.0  # collector clock - agent clock
    done = [record.step for record in list(state.steps.values()) if record.ended_at + offset <= incident.opened_at]
    step = min(state.step, max(done) + 1) if done else state.step
    box = (ev.progress or {}).get("step") if ev is not None and ev.source == "supervisor" else None
    if type(box) is int and box > step:
        step = box
    return step


def _main_owns_gil(ev: RankEvidence) -> bool:
    return any(t.get("main") and t.get("owns_gil") is True for t in ev.stacks)


_GLUE = ("ffi_call", "_ctypes", "PyCFuncPtr", "_PyEval", "PyObject_", "_PyObject", "cfunction_", "method_vectorcall")


def _native_top(text: str) -> str:
    """The innermost native frames of the main thread in a `py-spy dump
    --native` text, down to the first interpreter glue or Python frame."""
    names = []
    for line in _main_block(text):
        frame = line.strip()
        if frame.startswith("0x"):
            continue
        if _NATIVE_PY_FRAME.match(line) or any(g in frame for g in _GLUE):
            break
        names.append(frame)
    if len(names) > 3:  # the innermost (where it waits) and the call the Python code made
        names = [names[0], "...", names[-1]]
    return " <- ".join(names)


# -- a rank that left the loop while its peers were in a collective with it ------------

def left_the_loop(run: RunState, now: float) -> Optional[wire.Verdict]:
    """A rank exited cleanly (exit code 0: it ran out of data, returned from
    main, called sys.exit) and after that its peers failed with a peer error
    ("Connection closed by peer"): they were still inside a collective with
    it. It is the culprit; their failures are consequences. A rank that
    exited non-zero is `crash`'s."""
    from .crash import LEFT_SLACK_S, failures

    found = failures(run)
    if not found or run.interrupted:
        return None
    leavers = {r: s for r, s in run.ranks.items()
               if s.exit_code == 0 and s.exited_at is not None and not s.killed_by_rankwatch}
    if not leavers:
        return None
    first_leave = min(s.exited_at for s in leavers.values())
    others = [f for f in found if f.rank not in leavers]
    if any(not f.peer_caused and not f.collective_error for f in others):
        return None  # an independent failure: crash names it
    victims = [f for f in others if f.at >= first_leave - LEFT_SLACK_S]
    if not victims:
        return None
    first_victim = min(v.at for v in victims)
    culprits = sorted(r for r, s in leavers.items() if s.exited_at <= first_victim + LEFT_SLACK_S)
    if not culprits:
        return None
    first = culprits[0]
    state = leavers[first]
    exit_event = next((e for e in reversed(state.events) if e.kind == "exit"), None)
    step = exit_event.step if exit_event is not None and exit_event.step is not None else state.step
    phase = str(exit_event.details.get("phase", "")) if exit_event is not None else state.phase
    victim_ranks = sorted({v.rank for v in victims})
    seq = _victims_collective(run, victim_ranks)
    where_text = f"collective #{seq[1]} of process group {seq[0]}" if seq else "a collective"
    # What the peers themselves said (torchrun's SIGTERM of the rest says nothing).
    causes = sorted({_peer_error(v.cause) for v in victims if v.kind == "exception"}
                    or {_peer_error(v.cause) for v in victims})
    summary = (f"{ranks_text(culprits).capitalize()} left the training loop and exited cleanly (exit code 0) "
               f"at step {step}" + (f", phase {phase}" if phase not in ("", "exited", "unknown") else "")
               + f" ({located(run, culprits[:1])}), while {ranks_text(victim_ranks)} "
               f"{verb(victim_ranks, 'was', 'were')} still in {where_text} with it: "
               f"{verb(victim_ranks, 'its', 'their')} failure ({'; '.join(causes[:2])}) follows from it. "
               f"Every rank must run the same number of steps (uneven data per rank, or a break, return or "
               f"sys.exit on one rank).")
    details: dict[str, Any] = {
        "reason": "left the training loop and exited cleanly while peers were in a collective with it",
        "ranks": {str(r): {"exited": r in culprits, "exit_code": run.ranks[r].exit_code,
                           "exited_at": run.ranks[r].exited_at, "step": run.ranks[r].step,
                           "phase": run.ranks[r].phase} for r in sorted(run.ranks)},
        "hosts": {str(r): run.ranks[r].host for r in culprits},
        "located": located(run, culprits),
        "waiting_at": {seq[0]: seq[1]} if seq else {},
        "consequences": [{"kind": "crash", "ranks": [v.rank], "step": v.step, "first_seen_at": iso(v.at),
                          "summary": v.cause[:500], "exit_code": v.exit_code} for v in victims],
    }
    return verdict("hang", culprits, step, state.exited_at, max(now, state.exited_at or now), summary, details)


def _peer_error(cause: str) -> str:
    """The peer error itself ("Connection closed by peer") rather than the
    wrapping it comes in ("Got the following error when running the callback: ...")."""
    from .crash import PEER_FAILURE

    m = PEER_FAILURE.search(cause)
    return f"'{m.group(0)}'" if m else cause.split("\n")[0][:120]


def _victims_collective(run: RunState, ranks: list[int]) -> Optional[tuple[str, int]]:
    """(process group, sequence number) the failed peers were in: the highest
    enqueued collective any of them reported, in the busiest process group."""
    best: Optional[tuple[str, int]] = None
    for r in ranks:
        state = run.ranks[r]
        seqs = dict(state.enqueued)
        for ev in state.evidence.values():
            for pg, v in ev.pg_enqueued.items():
                seqs[pg] = max(seqs.get(pg, -1), v)
        for pg, v in seqs.items():
            if v >= 0 and (best is None or v > best[1]):
                best = (pg, v)
    return best
