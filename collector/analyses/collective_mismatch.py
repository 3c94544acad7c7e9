"""`collective_mismatch`: ranks issued different collectives at the same
sequence number.

Two sources, both from torch's own records:
- collective marks: each rank's last enqueued sequence number per process
  group at the end of marked steps. An extra (or missing) collective on one
  rank shows as a different count at the same step, even when gloo pairs the
  calls off silently (same op and size).
- Flight Recorder entries from bundles, aligned by (process group, sequence
  number): op / sizes / dtypes compared, and the call site (Python call site
  vs DDP's internal allreduce) for same-shape extras.
The culprits are the ranks that differ from the majority; with no majority
(two ranks), the rank whose call departs from the run's own history.
"""

from __future__ import annotations

import operator
import os
from collections import Counter
from typing import Optional

from rankwatch import wire

from ..evidence import CollectiveEntry, RankEvidence, _short_site
from ..state import RunState
from .common import is_machinery, majority, ranks_text, register_tracker, settle, tracker, verdict


def detect(run: RunState, now: float, final: bool) -> list[wire.Verdict]:
    for source in (_from_flight_recorder, _from_dying_call, _from_marks):
        found = source(run, now)
        if found is not None:
            return [found]
    return []


# -- Flight Recorder entries -------------------------------------------------


def _latest_evidence(run: RunState) -> dict[int, RankEvidence]:
    """Per rank, the evidence with the most collectives (latest wins ties)."""
    best: dict[int, RankEvidence] = {}
    for state in run.notable_ranks():
        for ev in state.evidence.values():
            if not ev.collectives:
                continue
            cur = best.get(state.rank)
            if cur is None or (ev.collectives[-1].seq, ev.created_at) > (cur.collectives[-1].seq, cur.created_at):
                best[state.rank] = ev
    return best


def _from_flight_recorder(run: RunState, now: float) -> Optional[wire.Verdict]:
    evidence = _latest_evidence(run)
    if len(evidence) < 2:
        return None
    tables: dict[int, dict[tuple[str, int], CollectiveEntry]] = {
        r: {(e.pg, e.seq): e for e in ev.collectives} for r, ev in evidence.items()
    }
    keys = sorted({k for t in tables.values() for k in t})
    for key in keys:
        present = {r: t[key] for r, t in tables.items() if key in t}
        if len(present) < 2:
            continue
        culprits, how = _odd_ones(present, tables, key)
        if culprits:
            return _verdict_from_entries(run, evidence, present, culprits, how, key, now)
    return None


def _odd_ones(present: dict[int, CollectiveEntry], tables, key) -> tuple[list[int], str]:
    signatures = {r: e.signature for r, e in present.items()}
    if len(set(signatures.values())) > 1:
        _, minority = majority(signatures)
        if minority:
            return minority, "op/size/dtype"
        return _novel(present, tables, key, lambda e: e.signature), "op/size/dtype"
    origins = {r: e.origin for r, e in present.items()}
    if len(set(origins.values())) > 1:
        # Same shape, different issuer: an extra Python-API collective paired
        # off with DDP's gradient allreduce. Flag it only when the odd call
        # site never appears on the other ranks while the usual one does
        # appear on the odd rank (a rank-dependent but legal branch does not).
        _, minority = majority(origins)
        candidates = minority or _novel(present, tables, key, lambda e: e.origin)
        confirmed = []
        for r in candidates:
            odd_site = present[r].origin
            usual = {present[o].origin for o in present if o not in candidates}
            seen_elsewhere = any(
                e.origin == odd_site for o, t in tables.items() if o not in candidates for e in t.values()
            )
            usual_seen_here = any(e.origin in usual for e in tables[r].values())
            if not seen_elsewhere and usual_seen_here:
                confirmed.append(r)
        return confirmed, "call site"
    return [], ""


def _novel(present: dict[int, CollectiveEntry], tables, key, attribute) -> list[int]:
    """No majority (two ranks): the rank whose call at ``key`` was never issued
    before on any rank, while the other ranks' calls were."""
    pg, seq = key
    history: Counter = Counter()
    for table in tables.values():
        for (epg, eseq), entry in table.items():
            if epg == pg and eseq < seq:
                history[attribute(entry)] += 1
    novel = [r for r, e in present.items() if history[attribute(e)] == 0]
    if novel and len(novel) < len(present):
        return sorted(novel)
    return []


def _verdict_from_entries(run, evidence, present, culprits, how, key, now) -> wire.Verdict:
    pg, seq = key
    odd = present[culprits[0]]
    others = [r for r in present if r not in culprits]
    usual = present[others[0]] if others else None
    step = odd.step
    summary = (
        f"{ranks_text(culprits).capitalize()} issued {odd.shape_text}"
        + (f" from {odd.origin}" if odd.origin != "internal" else "")
        + f" as collective #{seq} of process group {pg}, where "
        + (f"{ranks_text(others)} issued {usual.shape_text}"
           + (" (issued inside torch: DDP's gradient allreduce or the like)" if usual.origin == "internal"
              else f" from {usual.origin}")
           if usual else "the others issued something else")
        + f"; the ranks' collectives no longer pair up (mismatch by {how})."
    )
    first_seen = odd.created_ns / 1e9 if odd.created_ns else now
    ev = {
        "process_group": pg,
        "sequence": seq,
        "mismatch_by": how,
        "calls": {
            str(r): {"op": e.op, "input_sizes": e.input_sizes, "input_dtypes": e.input_dtypes,
                     "origin": e.origin, "step": e.step}
            for r, e in sorted(present.items())
        },
        "bundles": {str(r): ev.bundle_path for r, ev in evidence.items() if ev.bundle_path},
    }
    return verdict("collective_mismatch", culprits, step, first_seen, now, summary, ev)


# -- a rank that died inside a collective its peers never issued ---------------

_STEP_OF = operator.attrgetter("step")

_PY_API = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "broadcast", "reduce", "barrier", "all_to_all", "all_to_all_single", "gather", "scatter",
    "all_gather_object", "broadcast_object_list", "monitored_barrier",
}


def python_collective_call(frames: list[dict]) -> Optional[tuple[str, str]]:
    """(op, call site) when the stack is inside a torch.distributed Python-API collective."""
    for i in range(len(frames) - 1, -1, -1):
        frame = frames[i]
        if str(frame.get("file", "")).endswith("distributed_c10d.py") and frame.get("name") in _PY_API:
            for caller in reversed(frames[:i]):
                if not is_machinery(str(caller.get("file", ""))):
                    return str(frame["name"]), f"{os.path.basename(str(caller.get('file')))}:{caller.get('line')} in {caller.get('name')}"
            return str(frame["name"]), "<unknown>"
    return None


def _dying_stack(state) -> list[dict]:
    for ev in state.evidence.values():
        if ev.main_stack:
            return ev.main_stack
    for ev in state.evidence.values():
        if ev.exception and isinstance(ev.exception.get("frames"), list):
            return ev.exception["frames"]
    return []


# gloo and NCCL end a rank whose collective met a different one with SIGABRT:
# a victim of a mismatch may die that way. Any other death of its own (a
# SIGKILL from the OOM killer or a user, a segfault, an exception that no
# peer caused) is a cause in its own right.
_MISMATCH_ABORT = -6


def _died_on_its_own(found, others: list[int]):
    """A peer that "did not issue" the culprit's collective because it was
    already dead of its own failure: the call was the next one every rank
    makes (a framework's per-step broadcast, a SIGTERM handler's collective
    during teardown), not a mismatch; the death is the verdict (crash)."""
    from .crash import TEARDOWN_SIGNALS

    for failure in found:
        if failure.rank not in others or failure.peer_caused or failure.collective_error:
            continue
        if failure.kind == "signal" and failure.exit_code is not None and (
                -failure.exit_code in TEARDOWN_SIGNALS or failure.exit_code == _MISMATCH_ABORT):
            continue
        return failure
    return None


def _in_flight(state) -> tuple[bool, Optional[tuple[str, str, int]]]:
    """(known, (op, call site, numel)) of the Python-API collective a dead
    rank was inside: from its black box, else from its last stack."""
    known = False
    for ev in state.evidence.values():
        progress = ev.progress if isinstance(ev.progress, dict) else {}
        if ev.source == "supervisor" and progress:
            known = True
            call = progress.get("collective")
            if isinstance(call, dict) and call.get("op"):
                return True, (str(call["op"]), _short_site(str(call.get("callsite", ""))), int(call.get("numel") or 0))
    stack = _dying_stack(state)
    if stack:
        call = python_collective_call(stack)
        if call:
            return True, (call[0], call[1], -1)
        known = True
    return known, None


def _from_dying_call(run: RunState, now: float) -> Optional[wire.Verdict]:
    """gloo aborts (SIGABRT, "Received data size doesn't match") a rank when
    an extra collective meets a peer's different one, and torchrun then kills
    the rest: often no Flight Recorder dump survives. The black boxes (and
    last stacks) still show which rank was inside a Python-API collective
    that its peers were not in."""
    from .crash import failures

    from .crash import left_cleanly_before

    found = failures(run)
    if not found or any(f.kind == "exception" and not f.peer_caused and not f.collective_error for f in found):
        return None  # nobody died, or an independent exception explains it
    if left_cleanly_before(run, found):
        # A rank exited 0 before anyone failed: its peers' failures follow from
        # its leaving (hang's left_the_loop), and a collective one of them was
        # in as it died was the teardown's (a SIGTERM handler's broadcast),
        # never a call that met a wrong partner.
        return None
    groups: dict[Optional[str], list[int]] = {}
    calls: dict[int, tuple[str, str, int]] = {}
    for state in run.notable_ranks():  # the others have no evidence: nothing known
        r = state.rank
        known, call = _in_flight(state)
        if not known:
            continue
        site = call[1] if call else None
        groups.setdefault(site, []).append(r)
        if call:
            calls[r] = call
    if len(groups) < 2 or not calls:
        return None
    biggest = max(len(v) for v in groups.values())
    culprits = sorted(r for r in calls if len(groups[calls[r][1]]) < biggest
                      or (len(groups[calls[r][1]]) == biggest and None in groups and len(groups[None]) == biggest
                          and len(groups) == 2))
    if not culprits:
        return None
    from .crash import collective_timeout

    timed_out = {f.rank for f in found if collective_timeout(f)}
    if None in groups and set(culprits) <= timed_out:
        # They waited in their call until the collective timeout while the others
        # were in none: the others never came (a stall: hang's waited_out), no
        # call met a wrong partner.
        return None
    op, site, numel = calls[culprits[0]]
    failure = next((f for f in found if f.rank == culprits[0]), None)
    others = sorted(r for site_, ranks in groups.items() if site_ != site for r in ranks)
    if _died_on_its_own(found, others) is not None:
        return None
    phases = sorted({run.ranks[r].phase for r in others})
    peers_now = {r: ev.collectives[-1] for r, ev in _latest_evidence(run).items() if r in others and ev.collectives}
    if peers_now:
        sample = next(iter(peers_now.values()))
        who = "issued inside torch: DDP's gradient allreduce or the like" if sample.origin == "internal" else f"from {sample.origin}"
        peer_text = f"{ranks_text(others)} {_were(others)} in collective #{sample.seq}, {sample.shape_text} ({who})"
    else:
        peer_text = f"{ranks_text(others)} {_were(others)} in no collective (phase {', '.join(phases)})"
    size = f" of {numel} element{'' if numel == 1 else 's'}" if numel > 0 else ""
    summary = (f"{ranks_text(culprits).capitalize()} called {op}{size} at {site}, a collective its peers "
               f"did not issue: {peer_text}. The collectives paired with the wrong partner and the job aborted"
               + (f" ({failure.cause})." if failure else "."))
    step = run.ranks[culprits[0]].step
    ev = {"calls": {str(r): {"op": c[0], "callsite": c[1], "numel": c[2]} for r, c in calls.items()},
          "others": {str(r): {"phase": run.ranks[r].phase, "step": run.ranks[r].step} for r in others},
          "peers": {str(r): {"sequence": e.seq, "op": e.op, "input_sizes": e.input_sizes, "origin": e.origin}
                    for r, e in peers_now.items()}}
    first = min((f.at for f in found), default=now)
    return verdict("collective_mismatch", culprits, step, first, now, summary, ev)


def _were(ranks: list[int]) -> str:
    return "was" if len(ranks) == 1 else "were"


# -- collective marks ------------------------------------------------------------


LISTED_RANKS = 64  # ranks listed one by one in a marks verdict
MARKS_SETTLE_STEPS = 64  # a mark step this far behind the newest gets no more marks: judged one last time
# ... nor one every live rank has passed: a mark for (0-based) step S comes
# with the rank's report of S + 1 steps done; one step more for slack.
MARKS_PASSED_STEPS = 2


class MarksTracker:
    """The open mark steps (compared, not yet settled), built from the marks
    as they arrive (the feed): per step each rank's marks, and per process
    group how many ranks hold each sequence number. A step whose every group
    has one number has no mismatch, so a pass over the open steps costs
    O(steps x groups), not O(steps x ranks); only a step with two numbers
    in a group is compared rank by rank. Settled steps (every live rank
    agreed, or every live rank is past them, or too old to change) leave,
    in step order, with each rank's marks as of the last one (`previous`)."""

    def __init__(self) -> None:
        self.settled_upto = -1
        self.previous: dict[int, dict[str, int]] = {}
        self.marks: dict[int, dict[int, dict[str, int]]] = {}  # open step -> rank -> {pg: seq}
        self.counts: dict[int, dict[str, Counter]] = {}  # open step -> pg -> Counter(seq)

    def on_mark(self, run: RunState, rank: int, item: tuple[int, dict[str, int]]) -> None:
        step, seqs = item
        if step <= self.settled_upto:
            return  # judged already (a re-sent or late mark)
        if step not in self.marks:
            # Bounded without the passes (they settle steps MARKS_SETTLE_STEPS
            # old, judged on every pass while open): a settle with no pass
            # between (offline, or a stalled analysis thread) drops the oldest.
            for old_step in [s for s in self.marks if s < step - 2 * MARKS_SETTLE_STEPS]:
                self.settle(old_step)
        marks = self.marks.setdefault(step, {})
        counts = self.counts.setdefault(step, {})
        old = marks.get(rank)
        if old is not None:
            for pg, seq in old.items():
                counter = counts[pg]
                counter[seq] -= 1
                if not counter[seq]:
                    del counter[seq]
        marks[rank] = seqs
        for pg, seq in seqs.items():
            counter = counts.get(pg)
            if counter is None:
                counter = counts[pg] = Counter()
            counter[seq] += 1

    def agreed(self, step: int) -> bool:
        return all(len(c) <= 1 for c in self.counts.get(step, {}).values())

    def settle(self, step: int) -> None:
        self.previous.update(self.marks.pop(step, {}))
        self.counts.pop(step, None)
        self.settled_upto = max(self.settled_upto, step)


register_tracker("collective_marks", MarksTracker)


def _from_marks(run: RunState, now: float) -> Optional[wire.Verdict]:
    settle(run)
    marks_of = tracker(run, "collective_marks")
    steps = sorted(marks_of.marks)
    if not steps:
        return None
    newest = steps[-1]
    exited = {s.rank for s in run.notable_ranks() if s.exit_code is not None}
    expected = len(run.ranks) - len(exited)
    frontier: Optional[int] = None
    previous: Optional[dict[int, dict[str, int]]] = None  # built only for a step compared rank by rank
    in_order = True  # settle only a prefix: `previous` must follow step order
    for step in steps:
        marks = marks_of.marks[step]
        if not marks_of.agreed(step):
            if previous is None:
                previous = dict(marks_of.previous)
                for earlier in steps[:steps.index(step)]:
                    previous.update(marks_of.marks.get(earlier, {}))
            found = _compare_marks(run, step, marks, previous, now)
            if found is not None:
                return found
        if previous is not None:
            previous.update(marks)
        if not in_order:
            continue
        settles = len(marks) >= expected or step < newest - MARKS_SETTLE_STEPS
        if not settles:
            # Every live rank has reported steps past it: a rank without a mark
            # there never sends one (it joined the watch later: a cold start at
            # scale, where waiting for MARKS_SETTLE_STEPS newer steps kept ~64
            # steps open; or the job hangs, and no newer step ever comes).
            if frontier is None:
                states = list(run.ranks.values()) if not exited else [
                    st for r, st in list(run.ranks.items()) if r not in exited]
                frontier = min(map(_STEP_OF, states), default=0)  # in C: every rank, each analysis pass
            settles = step + MARKS_PASSED_STEPS <= frontier
        if settles:
            marks_of.settle(step)
        else:
            in_order = False
    return None


def _compare_marks(run: RunState, step: int, marks: dict[int, dict[str, int]],
                   previous: dict[int, dict[str, int]], now: float) -> Optional[wire.Verdict]:
    if len(marks) >= 2:
        pgs = sorted({pg for m in marks.values() for pg in m})
        for pg in pgs:
            counts = {r: m[pg] for r, m in marks.items() if pg in m}
            if len(counts) < 2 or len(set(counts.values())) == 1:
                continue
            _, culprits = majority(counts)
            if not culprits:
                # Two ranks: the rank whose collectives per step changed.
                culprits = _changed_rate(counts, previous, pg)
            if not culprits:
                continue
            # Every rank's count on a small job; the culprits and a few others on a big one.
            shown = sorted(counts) if len(counts) <= LISTED_RANKS else sorted(
                set(culprits[:LISTED_RANKS]) | set(sorted(counts)[:8]))
            counts_text = ", ".join(f"rank {r}: #{counts[r]}" for r in shown)
            if len(shown) < len(counts):
                counts_text += f", ... ({len(counts) - len(shown)} more)"
            summary = (
                f"{ranks_text(culprits).capitalize()} had issued a different number of collectives "
                f"by the end of step {step} in process group {pg} "
                f"({counts_text}): "
                f"an extra or missing collective; later collectives pair with the wrong partner."
            )
            first = max((run.ranks[r].steps[step].ended_at for r in shown if step in run.ranks[r].steps),
                        default=now)
            ev = {"process_group": pg, "step_end_sequence": {str(r): counts[r] for r in shown},
                  "previous_agreement": {str(r): previous.get(r, {}).get(pg) for r in shown}}
            if len(shown) < len(counts):
                ev["ranks_total"] = len(counts)
            return verdict("collective_mismatch", culprits, step, first, now, summary, ev)
    return None


def _changed_rate(counts: dict[int, int], previous: dict[int, dict[str, int]], pg: str) -> list[int]:
    base = {r: previous.get(r, {}).get(pg) for r in counts}
    if any(v is None for v in base.values()) or len(set(base.values())) != 1:
        return []
    deltas = {r: counts[r] - base[r] for r in counts}
    # All ranks agreed before; the rank with more collectives since then made the extra call.
    top = max(deltas.values())
    if list(deltas.values()).count(top) == 1:
        return [r for r, d in deltas.items() if d == top]
    return []
