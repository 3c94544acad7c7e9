"""`weight_divergence`: replicas that must hold identical parameters do not.

Compares the per-tensor fingerprints that every rank sends out of band for
the same step. The culprits are the ranks that differ from the majority.
With no majority (two ranks, or groups of equal size) every rank compared is
named: the fingerprints show that the replicas differ, not which one
changed. Every rank applies the same averaged update, so a change on either
rank leaves the same difference, and rank 0 is no more the reference after
DDP's first broadcast than any other rank. A tie at a step some rank sampled
out decides nothing (a later step with every rank may have a majority).
Parameters only: buffers (BatchNorm running statistics) differ legitimately
between DDP's broadcasts.

Two ranks agree on a tensor when their norms are within RTOL of each other
and, where both agents sent them, their bit checksums are equal
(agent/checks/fingerprints.py): the checksum sees a difference of any size,
which a norm misses when it is small or zero-mean (`bits_only_tensors` in
the evidence).

The evidence says the cause (`cause`) when it is visible:
- `unreduced_gradients`: a rank stepped its optimizer on gradients whose
  backward DDP never reduced (a forward through ``ddp.module``, or inside
  ``no_sync()``): its agent's `unreduced_backward` event. The weights drift
  apart from that step on, so the verdict comes at that step, before any
  fingerprint can show it; the ranks are the ones that did it.
- `unsynced_start`: without DDP, the fingerprint taken before the first
  optimizer step (``"at": "start"``, parameters and gradients) shows ranks
  whose averaged gradients are equal (replicas) but whose parameters are
  not: they started apart (no broadcast at start). With no majority, every
  rank is named. Ranks whose gradients differ are not replicas (model or
  pipeline parallelism): their fingerprints are never compared.
- a `config_divergence` that came first: then this verdict is its
  consequence (analyses/__init__.py).

A rank that shadowed its peers in DDP's `Join` (uneven inputs: its agent's
`join_shadowed` event, agent/watch/join.py) skipped optimizer steps they took:
Join re-syncs the weights when it ends, not the optimizer state, so with
momentum or Adam its weights drift from theirs from then on, by design. Its
fingerprints are not compared after that step (the others still are among
themselves), and the report's notes say so (collector/report.py).
"""

from __future__ import annotations

import math
from typing import Any, Optional

from rankwatch import wire

from ..state import RunState
from .common import StepEvents, ranks_text, register_tracker, settle, tracker, verb, verdict

RTOL = 1e-5


def _same(a: list[float], b: list[float]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if math.isnan(x) and math.isnan(y):
            continue
        if not math.isclose(x, y, rel_tol=RTOL, abs_tol=1e-12):
            return False
    return True


def _compared(names) -> Optional[list[int]]:
    """Indices of the tensors DDP keeps identical at step end: parameters.
    Buffers (BatchNorm running statistics, anything with broadcast_buffers=False)
    legitimately differ between replicas until DDP's next broadcast: not compared.
    None: compare everything (no names, or no buffers)."""
    if not names:
        return None
    keep = [i for i, n in enumerate(names) if not str(n).startswith(("buffer:", "grad:"))]
    return None if len(keep) == len(names) else keep


def start_replicas(prints: dict[int, dict]) -> Optional[bool]:
    """From the fingerprints taken before the first optimizer step without
    DDP: True when every rank's gradients are equal (data-parallel replicas:
    the script averages them), False when they differ (not replicas), None
    when there are none to judge."""
    grads: dict[int, list[float]] = {}
    for rank, fp in prints.items():
        if fp.get("at") != "start":
            continue
        names, norms = fp.get("names") or [], fp.get("norms") or []
        values = [v for n, v in zip(names, norms) if str(n).startswith("grad:")]
        if values:
            grads[rank] = values
    if len(grads) < 2:
        return None
    first = next(iter(grads.values()))
    return all(_same(first, values) for values in grads.values())


class Tracker:
    """The first fingerprint step at which the replicas disagree. Per sealed
    fingerprint step: ranks grouped by their exact norms first (a hash, O(ranks
    x tensors) in C), then the groups merged within tolerance."""

    def __init__(self) -> None:
        self.finding: Optional[dict] = None
        # rank, or (rank, model) past a rank's first model -> (names, compared indices)
        self._selection: dict[Any, tuple[Any, Optional[list[int]]]] = {}
        self._read: tuple[Any, Optional[list[int]]] = (None, None)  # the last list read, and its reading
        self.replicas: Optional[bool] = None  # without DDP: are the ranks replicas (start fingerprint)?
        self.unreduced: Optional[dict] = None
        self._events = StepEvents(("unreduced_backward",))
        self.shadowed: dict[int, int] = {}  # rank -> the first step it shadowed its peers in a DDP Join

    def on_event(self, run: RunState, rank: int, event: wire.Event) -> None:
        if event.kind == "join_shadowed":
            step = event.step if isinstance(event.step, int) and event.step >= 0 else 0
            self.shadowed[rank] = min(step, self.shadowed.get(rank, step))
            return
        self._events.add(rank, event)

    def on_step(self, run: RunState, step: int, records: dict) -> None:
        due = self._events.due(step)
        if not due or self.unreduced is not None:
            return
        first = min(e.step or 0 for _, e in due)
        ranks = sorted({r for r, e in due if (e.step or 0) == first})
        rank, event = next((r, e) for r, e in due if (e.step or 0) == first)
        ended = [run.ranks[r].steps[first].ended_at for r in ranks
                 if r in run.ranks and first in run.ranks[r].steps]
        self.unreduced = {"step": first, "ranks": ranks, "via": str(event.details.get("via", "")),
                          "site": str(event.details.get("site", ""))[:200],
                          "module": str(event.details.get("module", ""))[:64],
                          "first_at": min(ended) if ended else event.at}

    def _values(self, rank: int, fp: dict) -> Optional[tuple[tuple, Optional[tuple]]]:
        """The compared tensors' norms, and their bit checksums when the
        agent sent them (None otherwise: an older agent)."""
        norms = fp.get("norms")
        if not isinstance(norms, list):
            return None
        names = fp.get("names")
        # Each rank's (and model's) names list is read once, and kept only
        # while it is that rank's: a rank whose names change gets the new
        # list's reading, and the old list is not held here (kept by id, a
        # cache of up to MAX_WORLD_SIZE lists held every list it saw).
        model = wire.fingerprint_model(fp)
        key = rank if model == 0 else (rank, model)
        entry = self._selection.get(key)
        if entry is None or entry[0] is not names:
            if len(self._selection) >= wire.MAX_WORLD_SIZE:  # a rank sending ever new model numbers
                self._selection.clear()
            if self._read[0] is not names:  # ranks share their run's one list (state.FingerprintLog): read once
                self._read = (names, _compared(names))
            entry = self._selection[key] = self._read
        keep = entry[1]
        sums = _sums(fp)
        if keep is None:
            return tuple(norms), (tuple(sums) if sums is not None else None)
        return (tuple(norms[i] for i in keep if i < len(norms)),
                tuple(sums[i] for i in keep if i < len(sums)) if sums is not None else None)

    def on_prints(self, run: RunState, step: int, prints: dict[int, dict]) -> None:
        start = any(fp.get("at") == "start" for fp in prints.values())
        if start and self.replicas is None:
            self.replicas = start_replicas(prints)
        # Fingerprints taken through the optimizers (no DDP) count only between replicas.
        prints = {r: fp for r, fp in prints.items() if fp.get("source") != "optimizer" or self.replicas}
        if self.shadowed:  # a rank whose optimizer skipped steps in a Join: not a replica's state any more
            prints = {r: fp for r, fp in prints.items() if not (r in self.shadowed and step >= self.shadowed[r])}
        if self.finding is not None or len(prints) < 2:
            return
        exact: dict[tuple, list[int]] = {}
        for rank in sorted(prints):
            values = self._values(rank, prints[rank])
            if values is not None:
                exact.setdefault(values, []).append(rank)
        groups: list[tuple[tuple, list[int]]] = []
        for values, ranks in exact.items():
            for group_values, group in groups:
                if _agree(group_values, values):
                    group.extend(ranks)
                    break
            else:
                groups.append((values, list(ranks)))
        if len(groups) <= 1:
            return
        ordered = sorted((sorted(g) for _, g in groups), key=lambda g: (-len(g), g[0]))
        at_start = start and all(fp.get("at") == "start" for fp in prints.values())
        if len(ordered[0]) > len(ordered[1]):
            reference = ordered[0]
        elif at_start or len(prints) >= _replicas(run):
            reference = []  # no majority among every replica: every rank is named
        else:
            # A tie with a rank missing (it sampled this step out): that rank
            # would break it. A later step with every rank decides.
            return
        culprits = sorted(r for g in ordered if g is not reference for r in g)
        ref, odd = prints[(reference or ordered[0])[0]], prints[(ordered[1] if not reference else culprits)[0]]
        names = list(ref.get("names") or [])
        keep = _compared(names)
        indices = range(min(len(ref["norms"]), len(odd["norms"]))) if keep is None else keep
        ref_sums, odd_sums = _sums(ref), _sums(odd)
        differing, bits_only = [], []
        for i in indices:
            if i >= len(ref["norms"]) or i >= len(odd["norms"]):
                continue
            name = names[i] if i < len(names) else f"#{i}"
            if not _close(ref["norms"][i], odd["norms"][i]):
                differing.append(name)
            elif ref_sums is not None and odd_sums is not None and ref_sums[i] != odd_sums[i]:
                differing.append(name)
                bits_only.append(name)
        shown = set(differing[:8])
        sample = sorted(prints) if len(prints) <= 64 else sorted(set(reference[:32]) | set(culprits[:32]))
        ended = [run.ranks[r].steps[step].ended_at for r in culprits[:64]
                 if r in run.ranks and step in run.ranks[r].steps]
        self.finding = {
            "step": step, "reference": reference, "culprits": culprits, "differing": differing,
            "first_at": min(ended) if ended else None, "at_start": at_start, "bits_only": bits_only,
            "norms": {str(r): {n: v for n, v in zip(names, prints[r]["norms"]) if n in shown} for r in sample},
        }


def _replicas(run: RunState) -> int:
    """How many ranks the run has (the launcher's world size, else the ranks seen)."""
    return max(run.world_size, len(run.ranks))


def _agree(a: tuple[tuple, Optional[tuple]], b: tuple[tuple, Optional[tuple]]) -> bool:
    """Two ranks' fingerprints: norms within tolerance, and the same bits
    where both sent checksums."""
    if not _same(list(a[0]), list(b[0])):
        return False
    return a[1] is None or b[1] is None or a[1] == b[1]


def _sums(fp: dict) -> Optional[list]:
    sums = fp.get("sums")
    return sums if isinstance(sums, list) and len(sums) == len(fp.get("norms") or ()) else None


def _close(x: float, y: float) -> bool:
    if math.isnan(x) and math.isnan(y):
        return True
    return math.isclose(x, y, rel_tol=RTOL, abs_tol=1e-12)


register_tracker("weight_divergence", Tracker)


def detect(run: RunState, now: float, final: bool) -> list[wire.Verdict]:
    settle(run, final)
    state = tracker(run, "weight_divergence")
    finding, unreduced = state.finding, state.unreduced
    if unreduced is not None:
        return [_unreduced_verdict(unreduced, finding, now)]
    if finding is None:
        return []
    step, reference, culprits, differing = (finding["step"], finding["reference"], finding["culprits"],
                                            finding["differing"])
    evidence = {"reference_ranks": reference, "differing_tensors": differing[:32], "norms": finding["norms"]}
    bits_only = finding.get("bits_only") or []
    if bits_only:
        # Norms equal within RTOL, checksums not: a difference too small (or too
        # zero-mean) for a norm to show, still a divergence DDP never repairs.
        evidence["bits_only_tensors"] = bits_only[:32]
    if finding.get("at_start"):
        evidence["cause"] = "unsynced_start"
        against = f"from {ranks_text(reference)}" if reference else "from each other"
        summary = (f"{ranks_text(culprits).capitalize()} started training with different weights {against} "
                   f"(before the first optimizer step; {len(differing)} tensor(s) differ, first "
                   f"{', '.join(differing[:3])}), while their averaged gradients are equal: the replicas were "
                   f"never synchronised at the start (no DDP, no broadcast). Broadcast the parameters from rank 0 "
                   f"before training (dist.broadcast of each, or wrap the model in DDP), or seed every rank alike "
                   f"before building the model.")
    else:
        small = ""
        if bits_only and len(bits_only) == len(differing):
            small = (f" Their norms agree within {RTOL:g}: the difference is small, seen in the tensors' bit "
                     f"checksums.")
        against = ranks_text(reference) if reference else "each other"
        undecided = ("" if reference else
                     " No majority: the fingerprints show that the replicas differ, not which one changed.")
        summary = (f"{ranks_text(culprits).capitalize()} {verb(culprits, 'holds', 'hold')} different weights from "
                   f"{against} after step {step}: {len(differing)} tensor(s) differ, first "
                   f"{', '.join(differing[:3])}.{small}{undecided} The replicas no longer train the same model (a missed "
                   f"broadcast, a rank-local update, or silent data corruption); DDP averages gradients, never "
                   f"weights, so the difference stays.")
    first = finding["first_at"] if finding["first_at"] is not None else now
    return [verdict("weight_divergence", culprits, step, first, now, summary, evidence)]


_VIA = {"module": "the DDP model's `.module` (DDP's forward, which prepares the gradient allreduce, never ran)",
        "no_sync": "DDP inside `no_sync()` with no synchronised backward before the optimizer step"}


def _unreduced_verdict(unreduced: dict, finding: Optional[dict], now: float) -> wire.Verdict:
    ranks, step = unreduced["ranks"], unreduced["step"]
    where = f" at {unreduced['site']}" if unreduced.get("site") else ""
    how = _VIA.get(unreduced.get("via", ""), "a path DDP does not see")
    summary = (f"{ranks_text(ranks).capitalize()} stepped the optimizer at step {step} on gradients DDP never "
               f"averaged: the backward followed a forward through {how}{where}. Each replica then applies "
               f"its own gradients and the weights drift apart. Call the DDP-wrapped model itself "
               f"(model(x), not model.module(x)), and step only after a synchronised backward.")
    evidence: dict = {"cause": "unreduced_gradients", "via": unreduced.get("via"), "site": unreduced.get("site"),
                      "module": unreduced.get("module")}
    if finding is not None:
        evidence.update({"reference_ranks": finding["reference"], "differing_tensors": finding["differing"][:32],
                         "norms": finding["norms"], "fingerprint_step": finding["step"]})
    return verdict("weight_divergence", ranks, step, unreduced.get("first_at") or now, now, summary, evidence)
