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
   collective while the majority is. A rank counts as waiting too when a
   collective of its is in flight (enqueued, not completed): on NCCL a
   collective returns once queued, so a waiting rank sits in `loss.item()`,
   a GradScaler read or `work.wait()`, not inside torch.distributed.

A rank that leaves the loop and exits cleanly while its peers are inside a
collective with it is found without an incident too (`left_the_loop`): gloo
fails the peers at once ("Connection closed by peer"), so no stall ever
reaches the hang timeout. The peers' failures are its consequences.

So is a stall that the collective timeout ended before the hang timeout
(`waited_out`: a stall at start-up, whose allowance is longer, or a short
--pg-timeout): ranks failed with the timeout inside a collective that a live
rank had not issued. That rank is the culprit; the timeouts (which alone
read as a crash of the first rank to time out) are consequences.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from rankwatch import wire
from rankwatch.cadence import longest_relay_silence, node_report_interval
from rankwatch.config import Config

from ..evidence import RankEvidence, fill_source
from ..state import Incident, RunState
from .common import dataloader_worker_frame, in_dataloader, iso, located, ranks_text, verb, verdict, waits_in_collective, where


def detect(run: RunState, now: float, final: bool) -> list[wire.Verdict]:
    out = []
    left = left_the_loop(run, now)
    if left is not None:
        out.append(left)
    for incident in run.incidents:
        # A stall that ended by itself is a note in the report (collector/report.py).
        if incident.kind == "hang" and incident.ready and "ended_at" not in incident.details:
            found = diagnose(run, incident, now, final)
            if found is not None:
                out.append(found)
    if not out:
        timed_out = waited_out(run, now)
        if timed_out is not None:
            out.append(timed_out)
    return out


# -- whom to ask for evidence ------------------------------------------------------------

STALE_HEARTBEATS = 3  # a rank silent for this many heartbeat intervals is asked about from outside
EVIDENCE_FROM_EVERY_RANK = 256  # live ranks up to which every one sends a bundle
MAX_SUSPECTS = 256  # beyond: the ranks that stand out (most behind first) ...
REFERENCE_RANKS = 8  # ... and a few that do not, whose stacks show where the others wait
LISTED_RANKS = 64  # ranks listed one by one in the evidence beyond the culprits and those asked


def evidence_ranks(run: RunState, live: list[int], at: float, stale_after: float) -> list[int]:
    """The live ranks a hang incident asks for bundles and outside stacks.
    Every one on a small job; on a big one (100,000 ranks would send 100,000
    bundles to one collector) the suspects, from what the heartbeats already
    say: ranks whose heartbeat thread went silent, whose last enqueued
    collective is behind the others' in a process group, or whose step is
    behind; then a few references. O(ranks)."""
    if len(live) <= EVIDENCE_FROM_EVERY_RANK:
        return list(live)
    furthest = _furthest(run, live)
    top, max_step = furthest.enqueued, furthest.step
    scored = []
    for r in live:
        state = run.ranks[r]
        silent = state.silent_for(at) > stale_after
        behind = max((top[pg] - seq for pg, seq in list(state.enqueued.items()) if pg in top), default=0)
        late = max_step - state.step
        if silent or behind > 0 or late > 0:
            scored.append((not silent, -behind, -late, r))
    suspects = [r for *_, r in sorted(scored)[:MAX_SUSPECTS]]
    if len(suspects) >= len(live) // 2:
        suspects = []  # most ranks "behind": heartbeats in flight, not suspects; references only
    return with_references(live, suspects)


def with_references(live: list[int], chosen: list[int]) -> list[int]:
    """`chosen` plus REFERENCE_RANKS others (every live rank on a small job)."""
    if len(live) <= EVIDENCE_FROM_EVERY_RANK:
        return list(live)
    picked = set(chosen)
    references = [r for r in live if r not in picked][:REFERENCE_RANKS]
    return sorted(picked.union(references))


FRESH_SHARE = 0.9  # big jobs: share of ranks heard from since the stall began before judging by numbers
STALE_WAIT_S = 30.0  # ... or this long after the incident opened (a judgement on what is known)
NOT_YET_RECHECK_S = 1.0  # big jobs: a diagnosis waiting for fresher numbers is asked again at most this often


def diagnose(run: RunState, incident: Incident, now: Optional[float] = None,
             final: bool = True) -> Optional[wire.Verdict]:
    """The hang verdict of a ready incident. Computed once per incident and
    evidence (cached: a big job's diagnosis reads every rank once)."""
    evidence = run.evidence_for(incident.id)
    signature = (tuple(sorted((r, ev.source, len(ev.notes)) for r, ev in evidence.items())),
                 len(run.notable), final, "stuck" in incident.details)
    cache = run.trackers.setdefault("_hang_diagnoses", {})
    cached = cache.get(incident.id)
    now = time.time() if now is None else now
    if cached is not None and cached[0] == signature:
        if cached[1] is not None or 0.0 <= now - cached[2] < NOT_YET_RECHECK_S:
            return cached[1]
    found = _diagnose(run, incident, evidence, now, final)
    if found is not None or len(run.ranks) > EVIDENCE_FROM_EVERY_RANK:
        # A big job's "not yet" too: asked again once its numbers may have
        # changed, not by every caller of every tick (each asking reads every
        # rank, under the ingest lock: ~0.3 s at 100,000 ranks).
        cache[incident.id] = (signature, found, now)
    return found


def _diagnose(run: RunState, incident: Incident, evidence: dict[int, RankEvidence], now: float,
              final: bool) -> Optional[wire.Verdict]:
    ranks = sorted(run.ranks)
    if not ranks:
        return None
    exited = [s.rank for s in run.notable_ranks() if s.exit_code is not None
              and (s.exited_at or 0) <= incident.opened_at and not s.killed_by_rankwatch]
    exited_set = set(exited)
    live = [r for r in ranks if r not in exited_set]
    seqs = {r: _enqueued(run, r, evidence.get(r)) for r in ranks}
    details: dict[str, Any] = {"ranks": {}}

    culprits: list[int] = []
    reason = ""
    leavers = left_early(run, exited, live) if live else []
    if leavers:
        culprits = leavers
        codes = sorted({run.ranks[r].exit_code for r in leavers})
        reason = (f"left the training loop and exited (exit code {', '.join(map(str, codes))}) "
                  f"while the others still wait for it")
    frozen = False
    if not culprits:
        culprits, reason = _frozen(run, incident, live, evidence, others_left=bool(exited))
        frozen = bool(culprits)
    if not culprits:
        if len(ranks) > EVIDENCE_FROM_EVERY_RANK:
            fresh = _fresh(run, incident, evidence, live)
            waited = now - incident.opened_at >= STALE_WAIT_S or final
            if len(fresh) < FRESH_SHARE * len(live) and not waited:
                return None  # not yet: the next pass has fresher numbers
            culprits, reason = _behind_in_collectives(seqs, fresh, details, minority=True)
            if not culprits and len(fresh) < len(live):
                # Every rank heard since the stall began is at the front: the
                # one holding them up is among those not heard since. Saying
                # "no rank stands out" would name every rank.
                if not waited:
                    return None
                found = _behind_unheard(run, incident, seqs, fresh, live, details, now, final)
                if found is None:
                    return None  # some of them may still report (their relays paused, or turned away)
                culprits, reason = found
            if not culprits and len(fresh) < FRESH_SHARE * len(live) and not final:
                # Too few ranks heard since the stall (a collector far behind,
                # relays shed and backing off) for "no rank stands out": with
                # no bundle from most ranks, the stack outliers and the
                # fallback below would name every rank on what is not known.
                return None
        else:
            culprits, reason = _behind_in_collectives(seqs, live, details)
    if not culprits:
        culprits, reason = _stack_outliers(live, evidence, {r: _in_flight(run, r, evidence.get(r)) for r in live})
    if not culprits:
        culprits = live or ranks
        if len(culprits) == 1:
            reason = ("stopped making progress, and no other rank's evidence is here to tell it from its peers "
                      "(a stuck collective or a shared dependency?)")
        else:
            reason = "all stopped making progress and no rank stands out (a stuck collective or a shared dependency)"

    # Each rank's figures: every rank on a small job; on a big one the
    # culprits, the ranks asked for evidence, those that exited and the first
    # few (the evidence of a 100,000-rank hang is not 100,000 entries).
    listed = ranks
    if len(ranks) > EVIDENCE_FROM_EVERY_RANK:
        listed = sorted(set(culprits) | set(evidence) | set(incident.requested_ranks) | exited_set
                        | set(ranks[:LISTED_RANKS]))
        details["ranks_total"] = len(ranks)
    for r in listed:
        ev = evidence.get(r)
        state = run.ranks[r]
        stack = ev.main_stack if ev else []
        details["ranks"][str(r)] = {
            "step": state.step,
            "phase": state.phase,
            "collective_seq": seqs[r],
            # exited: the rank's process has ended (maybe only when the job was
            # torn down); exited_before_hang: it had ended when the others stalled.
            "exited": state.exit_code is not None,
            "exited_before_hang": r in exited_set,
            "exit_code": state.exit_code,
            "exited_at": state.exited_at,
            "where": where(stack) if stack else None,
            "waiting_in_collective": waits_in_collective(stack) if stack else None,
            "bundle": ev.bundle_path if ev else None,
            "native_stack": bool(ev and ev.native_stacks),
        }

    first = culprits[0]
    state = run.ranks[first]
    ev = evidence.get(first)
    stack = (outside_frames(ev) if frozen else ev.main_stack) if ev else []
    stack = fill_source(stack, run.all_evidence())
    step = _step_at_stall(state, incident, ev) if frozen else state.step
    culprit_set = set(culprits)
    others = [r for r in ranks if r not in culprit_set and r not in exited_set]  # those that wait
    if culprits and not leavers and _on_the_way_out(run, culprits, exited):
        # Training is over on every rank: the stall is in the exit (torch's
        # teardown), and no peer waits for the culprit.
        reason = _the_way_out(run, culprits, exited, reason)
        details["teardown"] = True
    summary = f"{ranks_text(culprits).capitalize()} {reason}"
    if stack:
        location = where(stack)
        if in_dataloader(stack):
            summary += f"; its main thread waits for a DataLoader worker at {location}"
            busy = dataloader_worker_frame(ev.worker_stacks) if ev else None
            if busy is not None:
                summary += f", and that worker (pid {busy[0]}) is at {where(busy[1])}"
                details["dataloader_worker"] = {"pid": busy[0], "stack": busy[1][-12:]}
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
        "hosts": {str(r): run.ranks[r].host for r in culprits[:LISTED_RANKS]},
        "located": located(run, culprits),
        "hang_timeout_s": incident.timeout,
        "stalled_for_s": round(stalled, 3),
        "reason": reason,
        "culprit_stack": stack[-12:],
    })
    if "stuck" in incident.details:  # why rankwatch ended the job (collector/stuck.py)
        details["ended_because"] = incident.details["stuck"]
        details["ended_after_s"] = round(float(incident.details.get("stuck_at", 0.0)) - incident.last_progress_at, 3)
        summary += f" rankwatch ended the job: {incident.details['stuck'].get('rule')}."
    return verdict("hang", culprits, step, incident.last_progress_at, incident.details.get("diagnosed_at"),
                   summary, details)


# A rank's beat interval before two of its beats measured it: the agents' default.
ASSUMED_BEAT_S = Config.heartbeat_interval


def _fresh(run: RunState, incident: Incident, evidence: dict[int, RankEvidence], live: list[int]) -> list[int]:
    """Big jobs: not every rank was asked for evidence, so the others' numbers
    come from their heartbeats, and only one sent after the stall began says
    where the rank waits (through relays at scale, up to an interval late).

    "After" with a margin of the rank's own beat interval: a beat's time on
    the collector's clock carries the rank's clock offset, the lowest transit
    its reports had, and through a relay that includes how long the newest
    beat had waited there (up to one beat interval). A beat sent just before
    the rank entered the collective could otherwise read as sent after the
    job's last progress, and its rank as behind."""
    since = incident.last_progress_at
    fresh = []
    for r in live:
        state = run.ranks[r]
        if ((r in evidence and evidence[r].pg_enqueued)
                or (state.beat_at or state.last_heartbeat_at) >= since + (state.beat_every or ASSUMED_BEAT_S)):
            fresh.append(r)
    return fresh


def conclusive(run: RunState, incident: Incident, stale_after: float) -> bool:
    """Whether a big job's hang is named by the heartbeats' numbers alone:
    a rank exited while the others wait, or, with fresh numbers from most
    ranks and no heartbeat thread silent, a minority is behind in a process
    group. Its verdict then need not wait for bundles, which come at the
    relays' cadence (10 s at 100,000 ranks) and add stacks when they arrive.
    Small jobs always wait for their ranks' evidence."""
    if len(run.ranks) <= EVIDENCE_FROM_EVERY_RANK:
        return False
    notable = run.notable_ranks()
    exited = {s.rank for s in notable if s.exit_code is not None}
    live = [r for r in run.ranks if r not in exited]
    before = [s.rank for s in notable if s.exit_code is not None and (s.exited_at or 0) <= incident.opened_at
              and not s.killed_by_rankwatch]
    if left_early(run, before, live):
        return True
    if any(run.ranks[r].silent_for(incident.opened_at) > stale_after for r in live):
        return False  # a frozen rank is told by its outside stacks
    evidence = run.evidence_for(incident.id)
    fresh = _fresh(run, incident, evidence, live)
    if len(fresh) < FRESH_SHARE * len(live):
        return False
    seqs = {r: _enqueued(run, r, evidence.get(r)) for r in fresh}
    culprits, _ = _behind_in_collectives(seqs, fresh, {}, minority=True)
    return bool(culprits)


def _enqueued(run: RunState, rank: int, ev: Optional[RankEvidence]) -> Optional[dict[str, int]]:
    if ev is not None and ev.pg_enqueued:
        return dict(ev.pg_enqueued)
    state = run.ranks[rank]
    return dict(state.enqueued) if state.enqueued else None


def _front(seqs: dict[int, Optional[dict[str, int]]], ranks) -> dict[str, int]:
    """Per process group, the furthest collective any of `ranks` enqueued."""
    top: dict[str, int] = {}
    for r in ranks:
        for pg, seq in (seqs.get(r) or {}).items():
            if seq > top.get(pg, -1):
                top[pg] = seq
    return top


def _behind_in_collectives(seqs: dict[int, Optional[dict[str, int]]], live: list[int],
                           details: dict[str, Any], minority: bool = False) -> tuple[list[int], str]:
    """Per process group, the ranks whose last enqueued collective is behind
    the others'. With `minority` (big jobs), only when they are fewer than
    half: most ranks "behind" is numbers in flight, not a culprit."""
    known = {r: seqs[r] for r in live if seqs.get(r)}
    if len(known) < 2:
        return [], ""
    front = _front(seqs, known)
    behind: set[int] = set()
    waiting_at: dict[str, int] = {}
    for pg in sorted(front):
        members = {r: s[pg] for r, s in known.items() if pg in s}
        if len(members) < 2:
            continue
        top = front[pg]
        lagging = [r for r, v in members.items() if v < top]
        if lagging and len(lagging) < len(members) and (not minority or 2 * len(lagging) < len(members)):
            behind.update(lagging)
            waiting_at[pg] = top
    if not behind:
        return [], ""
    details["waiting_at"] = waiting_at
    pg, seq = next(iter(waiting_at.items()))
    return sorted(behind), f"never reached collective #{seq} of process group {pg}"


def _behind_unheard(run: RunState, incident: Incident, seqs: dict[int, Optional[dict[str, int]]],
                    fresh: list[int], live: list[int], details: dict[str, Any], now: float,
                    final: bool) -> Optional[tuple[list[int], str]]:
    """Big jobs, once waiting for fresher numbers is over: the ranks not heard
    since the stall began whose last numbers were behind the collective every
    rank heard since has reached (when they are a minority). None: wait.

    Every such rank's last numbers predate the stall, so they are behind as
    every rank's were then; not being heard since is what tells, and it
    tells only when the rank could have been heard:
    - *silent*: its node reported since the stall began, vouching for it,
      without a beat of it for the incident's `stale_after_s` (its heartbeat
      thread stopped). Named at once.
    - *lost*: nothing of it arrived for longer than its relay's longest
      pause between tries and a cadence (`cadence.longest_relay_silence`), while the
      collector turned no report away (`RunState.reports_refused_at`).
    - otherwise *unknown*: its node's report may be on its way, or was one
      the collector shed unread while behind (at 100,000 ranks on a slow
      machine it took in a ninth of what was offered, and this rule named ten
      bystanders before the culprit's report got in). While any rank is
      unknown the verdict waits, unless the job has ended: each node report
      taken in makes its ranks fresh, so the wait ends.
    The reason says they were not heard from since: some may have entered."""
    top = _front(seqs, fresh)
    heard = set(fresh)
    since = incident.last_progress_at
    limit = incident.details.get("stale_after_s")
    stale_after = limit if isinstance(limit, (int, float)) else STALE_HEARTBEAT_S
    cadence = node_report_interval(run.world_size or len(run.ranks), incident.timeout or 20.0) or ASSUMED_BEAT_S
    pause = longest_relay_silence(cadence)
    nothing_refused = now - run.reports_refused_at > pause
    silent: list[int] = []
    lost: list[int] = []
    unknown: list[int] = []
    waiting_at: dict[str, int] = {}
    for r in live:
        last = seqs.get(r)
        if r in heard or not last:
            continue
        lagging = [pg for pg, seq in last.items() if pg in top and seq < top[pg]]
        if not lagging:
            continue
        state = run.ranks[r]
        if state.vouched_at > since and state.silent_for(now) > stale_after:
            silent.append(r)
        elif nothing_refused and now - state.last_heartbeat_at > pause:
            lost.append(r)
        else:
            unknown.append(r)
        waiting_at.setdefault(lagging[0], top[lagging[0]])
    if silent and 2 * len(silent) < len(live):
        behind, kind = silent, "silent"
    elif (unknown or silent) and not final:
        return None  # reports still to come, or most ranks silent at once (not one culprit)
    else:
        behind, kind = sorted(silent + lost + unknown), "unheard"
    if not behind or 2 * len(behind) >= len(live):
        return [], ""
    details["waiting_at"] = waiting_at
    details["not_heard_since_stall"] = True
    details["unheard_ranks"] = {"silent": len(silent), "lost": len(lost), "unknown": len(unknown),
                                "refused_at": run.reports_refused_at or None}
    pg, seq = next(iter(waiting_at.items()))
    how = (f"{verb(behind, 'has', 'have')} sent no heartbeat since the stall began though "
           f"{verb(behind, 'its', 'their')} node reported (a stopped heartbeat thread)" if kind == "silent"
           else f"{verb(behind, 'was', 'were')} not heard from since the stall began")
    return sorted(behind), (f"{how}, and {verb(behind, 'its', 'their')} last numbers had not reached collective "
                            f"#{seq} of process group {pg}, which every rank heard from since has reached")


def _in_flight(run: RunState, rank: int, ev: Optional[RankEvidence]) -> bool:
    """A collective of this rank was enqueued and has not completed (the
    completion counter is known: >= 0)."""
    if ev is not None and ev.pg_enqueued:
        enqueued, completed = ev.pg_enqueued, ev.pg_completed
    else:
        state = run.ranks[rank]
        enqueued, completed = state.enqueued, state.completed
    for pg, seq in list(enqueued.items()):
        done = completed.get(pg, -1)
        if done >= 0 and seq > done:
            return True
    return False


def _stack_outliers(live: list[int], evidence: dict[int, RankEvidence],
                    in_flight: Optional[dict[int, bool]] = None) -> tuple[list[int], str]:
    in_flight = in_flight or {}
    waiting = {r: waits_in_collective(evidence[r].main_stack) or in_flight.get(r, False)
               for r in live if r in evidence and evidence[r].main_stack}
    if len(waiting) < 2:
        return [], ""
    not_waiting = [r for r, w in waiting.items() if not w]
    if not_waiting and len(not_waiting) < len(waiting):
        return sorted(not_waiting), "is not in a collective while the others wait in one"
    return [], ""


# -- ranks that left, and ranks on their way out ------------------------------------------

MID_STEP_PHASES = ("forward", "backward", "optimizer")


def left_early(run: RunState, exited: list[int], live: list[int]) -> list[int]:
    """The ranks of ``exited`` that left before the others were done with
    them: exited non-zero, or a live rank got further, by steps, forward
    passes or collectives enqueued in a process group they share, or is in
    the middle of a step. A rank that exited cleanly where the others
    finished too trained to the end like them; a stall after it is not a
    wait for it (a peer stuck in torch's teardown). O(live + exited): the
    live ranks' furthest point is taken once."""
    if not exited:
        return []
    ahead = _furthest(run, live)
    out = []
    for r in exited:
        gone = run.ranks[r]
        if (gone.exit_code != 0 or ahead.mid_step or ahead.step > gone.step or ahead.forwards > gone.forwards
                or any(seq > gone.enqueued.get(pg, seq) for pg, seq in ahead.enqueued.items())):
            out.append(r)
    return out


@dataclass
class _Furthest:
    step: int = 0
    forwards: int = 0
    mid_step: bool = False  # some rank is in a forward, backward or optimizer step
    enqueued: dict[str, int] = field(default_factory=dict)  # per process group, the highest sequence number


def _furthest(run: RunState, ranks: list[int]) -> _Furthest:
    """How far the furthest of ``ranks`` got, by each measure. O(ranks)."""
    out = _Furthest()
    for r in ranks:
        state = run.ranks[r]
        out.step, out.forwards = max(out.step, state.step), max(out.forwards, state.forwards)
        out.mid_step = out.mid_step or state.phase in MID_STEP_PHASES
        for pg, seq in list(state.enqueued.items()):
            if seq > out.enqueued.get(pg, -1):
                out.enqueued[pg] = seq
    return out


def _on_the_way_out(run: RunState, culprits: list[int], exited: list[int]) -> bool:
    """The culprits stalled after their training: in torch's teardown
    (destroy_process_group, seen by the agent), or at the step where the
    ranks that exited cleanly finished."""
    if all(run.ranks[r].phase == "teardown" for r in culprits):
        return True
    return bool(exited) and not left_early(run, exited, culprits)


def _the_way_out(run: RunState, culprits: list[int], exited: list[int], how: str) -> str:
    steps = sorted({run.ranks[r].step for r in culprits})
    in_teardown = all(run.ranks[r].phase == "teardown" for r in culprits)
    text = (f"finished training (step {', '.join(map(str, steps))}) and {verb(culprits, 'is', 'are')} stuck on "
            f"{verb(culprits, 'its', 'their')} way out{' (in destroy_process_group or after it)' if in_teardown else ''}")
    if "holding the GIL" in how:
        text += ", frozen holding the GIL"
    if exited:
        text += f"; {ranks_text(exited)} finished too and exited cleanly"
    return text


# -- a rank frozen with the GIL held ------------------------------------------------

STALE_HEARTBEAT_S = 3.0  # an incident that does not say (older index): 3 heartbeat intervals of 1 s


def _frozen(run: RunState, incident: Incident, live: list[int],
            evidence: dict[int, RankEvidence], others_left: bool = False) -> tuple[list[int], str]:
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
        if not stale:
            limit = incident.details.get("stale_after_s")
            limit = limit if isinstance(limit, (int, float)) else STALE_HEARTBEAT_S
            stale = run.ranks[r].silent_for(incident.opened_at) > limit
        if not stale:
            continue
        stack = outside_frames(ev)
        if (stack and not waits_in_collective(stack)) or (not stack and _main_owns_gil(ev)):
            frozen.append(r)
    if not frozen or (len(frozen) == len(live) and not others_left):
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
    if len(names) > 3:
        # The innermost (where it waits), the innermost of the program's own
        # libraries (what it was doing: ~ProcessGroupGloo under a thread join),
        # and the call the Python code made.
        own = next((n for n in names[1:-1] if not _SYSTEM_FRAME.search(n)), None)
        names = [names[0], *([own] if own else []), "...", names[-1]]
    return " <- ".join(names)


_SYSTEM_FRAME = re.compile(r"^(std|__gnu_cxx)::|\((libc|libstdc\+\+|libpthread|libgcc_s|ld-linux)[-.\w]*\)")


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
    leavers = {s.rank: s for s in run.notable_ranks()
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
               + _uneven_steps_text(run, culprits, victim_ranks))
    details: dict[str, Any] = {
        "reason": "left the training loop and exited cleanly while peers were in a collective with it",
        "ranks": {str(r): {"exited": run.ranks[r].exit_code is not None, "left_the_loop": r in culprits,
                           "exit_code": run.ranks[r].exit_code,
                           "batches_per_epoch": _batches_per_epoch(run, r),
                           "exited_at": run.ranks[r].exited_at, "step": run.ranks[r].step,
                           "phase": run.ranks[r].phase} for r in _listed(run, culprits + victim_ranks)},
        "hosts": {str(r): run.ranks[r].host for r in culprits},
        "located": located(run, culprits),
        "waiting_at": {seq[0]: seq[1]} if seq else {},
        "consequences": [{"kind": "crash", "ranks": [v.rank], "step": v.step, "first_seen_at": iso(v.at),
                          "summary": v.cause[:500], "exit_code": v.exit_code} for v in victims],
    }
    return verdict("hang", culprits, step, state.exited_at, max(now, state.exited_at or now), summary, details)


DEFAULT_PG = "0"  # torch's default process group: every rank is a member


def timed_out_waiting(run: RunState) -> Optional[tuple[list[int], list, dict[str, int]]]:
    """(culprits, the timed-out failures, per process group the collective
    they waited in) when ranks failed with the collective timeout waiting for
    a collective that live ranks had not issued; None otherwise (an
    independent failure, a mismatch, a rank that left the loop, or no rank
    behind). The timeouts are crashes that `explain_away` makes its
    consequences. It reads every rank's counts (a culprit still alive is not notable), so
    it is computed once per set of failures and notable ranks, not per tick."""
    from .crash import failures

    found = failures(run)
    if not found or run.interrupted or run.aborted:
        return None
    cache = run.trackers.setdefault("_timed_out_waiting", {})
    key = (len(run.notable), tuple((f.rank, f.at, f.peer_caused) for f in found))
    if cache.get("key") != key:
        cache["key"], cache["value"] = key, _timed_out_waiting(run, found)
    return cache["value"]


def _timed_out_waiting(run: RunState, found: list) -> Optional[tuple[list[int], list, dict[str, int]]]:
    from .crash import LEFT_SLACK_S, collective_timeout

    if any(f.collective_error or (not f.peer_caused and not collective_timeout(f)) for f in found):
        return None  # a mismatch, or a failure of its own: collective_mismatch / crash name it
    waiters = [f for f in found if collective_timeout(f)]
    if not waiters:
        return None
    first = min(f.at for f in waiters)
    if any(s.exit_code == 0 and s.exited_at is not None and s.exited_at <= first + LEFT_SLACK_S
           for s in run.notable_ranks()):
        return None  # a rank left the loop: left_the_loop
    waiting: dict[str, int] = {}
    for f in waiters:
        for pg, seq in (_enqueued(run, f.rank, None) or {}).items():
            waiting[pg] = max(waiting.get(pg, -1), seq)
    timed_out = {f.rank for f in waiters}
    behind = []
    for rank, state in run.ranks.items():
        if rank in timed_out or (state.exited_at is not None and state.exited_at < first - LEFT_SLACK_S):
            continue  # a waiter, or gone before the wait ended (its own failure would show above)
        mine = _enqueued(run, rank, None) or {}
        # A rank with no count in a group is behind only in the default group
        # (in another it may not be a member).
        if any(mine.get(pg, -1) < top and (pg in mine or pg == DEFAULT_PG) for pg, top in waiting.items()):
            behind.append(rank)
    if not behind:
        return None
    from .collective_mismatch import _from_dying_call, _from_flight_recorder, _from_marks

    now = time.time()
    if _from_flight_recorder(run, now) or _from_marks(run, now) or _from_dying_call(run, now):
        # The collectives no longer pair up (a rank "behind" is one short), or a
        # rank is inside a collective its peers never issued: collective_mismatch's.
        # One judgement for both rules, so one incident never reads as both.
        return None
    return sorted(behind), waiters, waiting


def waited_out(run: RunState, now: float) -> Optional[wire.Verdict]:
    """The `hang` verdict of `timed_out_waiting`."""
    from .collective_mismatch import _in_flight

    found = timed_out_waiting(run)
    if found is None:
        return None
    culprits, waiters, waiting = found
    waiter_ranks = sorted({f.rank for f in waiters})
    calls = {f.rank: _in_flight(run.ranks[f.rank])[1] for f in waiters}
    entered = [t for t in (_entered_at(run.ranks[r]) for r in waiter_ranks) if t is not None]
    call = next((c for c in calls.values() if c), None)
    pg, seq = max(waiting.items(), key=lambda kv: kv[1])
    what = f"collective #{seq} of process group {pg}" + (f" ({call[0]} at {call[1]})" if call else "")
    first = waiters[0]
    state = run.ranks[culprits[0]]
    stack = next((ev.main_stack for ev in state.evidence.values() if ev.main_stack), [])
    at = f", at {where(stack)}" if stack else ""
    summary = (f"{ranks_text(culprits).capitalize()} never reached {what}, which {ranks_text(waiter_ranks)} "
               f"waited in until the collective timeout ended {verb(waiter_ranks, 'it', 'them')} "
               f"({_peer_error(first.cause)}): {verb(culprits, 'it was', 'they were')} at step {state.step}, "
               f"phase {state.phase}{at}. The timeouts follow from it. A rank that does not come to a "
               f"collective: its data loading, a lock, or a section only it runs (a download, a checkpoint, an "
               f"evaluation) that takes longer than the timeout.")
    details: dict[str, Any] = {
        "reason": "never reached the collective its peers waited in until the collective timeout",
        "waiting_at": waiting,
        "ranks": {str(r): {"step": run.ranks[r].step, "phase": run.ranks[r].phase,
                           "enqueued": _enqueued(run, r, None) or {}, "exit_code": run.ranks[r].exit_code}
                  for r in _listed(run, culprits + waiter_ranks)},
        "calls": {str(r): {"op": c[0], "callsite": c[1], "numel": c[2]} for r, c in calls.items() if c},
        "located": located(run, culprits),
    }
    started = min(entered) if entered else first.at
    return verdict("hang", culprits, state.step, started, max(now, first.at), summary, details)


def _entered_at(state) -> Optional[float]:
    """When the rank entered the collective it died in (its black box, read by the supervisor)."""
    for ev in state.evidence.values():
        call = ev.progress.get("collective") if isinstance(ev.progress, dict) else None
        if isinstance(call, dict) and isinstance(call.get("entered_at"), (int, float)):
            return float(call["entered_at"])
    return None


def _uneven_steps_text(run: RunState, culprits: list[int], waiting: list[int]) -> str:
    """Say outright who ran fewer steps, and how to even them out."""
    done = sorted({run.ranks[r].step for r in culprits})
    ahead = sorted({run.ranks[r].step for r in waiting})
    fix = ("Give every rank the same number of batches: shard with DistributedSampler (it pads every "
           "rank to the same length), drop the remainder (drop_last=True, or cut the data to a multiple of "
           "world size x batch size), or wrap the loop in torch.distributed.algorithms.Join.")
    per_epoch = {r: _batches_per_epoch(run, r) for r in culprits + waiting}
    few = sorted({per_epoch[r] for r in culprits})
    many = sorted({per_epoch[r] for r in waiting})
    if None not in few + many and len(few) == 1 and len(many) == 1 and few[0] < many[0]:
        return (f"{ranks_text(culprits).capitalize()} had {few[0]} batches per epoch, {ranks_text(waiting)} "
                f"had {many[0]}: the data is split unevenly between ranks. " + fix)
    if len(done) == 1 and ahead and min(ahead) >= done[0]:
        steps = done[0]
        return (f"{ranks_text(culprits).capitalize()} ran out of work after {steps} optimizer steps while "
                f"{ranks_text(waiting)} had more ({verb(waiting, 'it was', 'they were')} in step {min(ahead) + 1}): "
                f"uneven data per rank, or a break, return or sys.exit on one rank. " + fix)
    return ("Every rank must run the same number of steps (uneven data per rank, or a break, return or "
            "sys.exit on one rank). " + fix)


def _batches_per_epoch(run: RunState, rank: int) -> Optional[int]:
    """The length of the rank's training DataLoader (its agent's last
    `loader_epoch` event), when it has one."""
    state = run.ranks.get(rank)
    event = next((e for e in reversed(state.events) if e.kind == "loader_epoch"), None) if state else None
    batches = event.details.get("batches") if event is not None else None
    return batches if isinstance(batches, int) and not isinstance(batches, bool) and batches >= 0 else None


def _listed(run: RunState, ranks: list[int]) -> list[int]:
    """The ranks a verdict lists one by one: all of a small job; of a big
    one, those named and the first few."""
    everyone = sorted(run.ranks)
    if len(everyone) <= EVIDENCE_FROM_EVERY_RANK:
        return everyone
    return sorted(set(ranks) | set(everyone[:LISTED_RANKS]))


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
