"""`duplicate_data`: ranks train on identical input batches.

Two ways, both from fingerprints of a few sampled elements of each step's
input batches (`StepRecord.batch_fp`, agent/checks/batch_fingerprints.py):

- across ranks: at each sealed step, ranks of one data-parallel group (the
  ranks one DDP averages over; without DDP, ranks the start fingerprints
  showed are replicas) whose fingerprints are equal. The same ranks must
  share their batches on STREAK consecutive compared steps (a coincidence,
  or one fixed warm-up batch, is not a dataset fed twice): no
  DistributedSampler, or one built without the rank and world size.
  Rank-dependent augmentation, per-rank randomness and uneven last batches
  give different fingerprints.
- over time: the rank's agent saw the same batch on consecutive steps from
  a DataLoader that has more batches and finished no epoch in between
  (`batch_repeat` event: typically `next(iter(loader))` every step). A
  dataset seen again each epoch is not that.

The culprits are the ranks involved; the step is the first of the run.
"""

from __future__ import annotations

from typing import Optional

from rankwatch import wire

from ..state import RunState
from .common import StepEvents, event_pairs, ranks_text, register_tracker, settle, tracker, verb, verdict
from .weight_divergence import start_replicas

STREAK = 3  # compared steps in a row (the bound is 8)
WAITING = 16  # steps held back until the start fingerprints say whether ranks without DDP are replicas


class Tracker:
    def __init__(self) -> None:
        self.groups: dict[int, str] = {}  # rank -> its data-parallel group (train_config facts)
        self.replicas: Optional[bool] = None
        self.finding: Optional[dict] = None
        self.repeat: Optional[dict] = None
        self._events = StepEvents(("train_config", "batch_repeat"))
        self._streak: Optional[dict] = None
        self._waiting: list[tuple[int, dict]] = []  # steps of ranks without DDP, until replicas are known

    def on_event(self, run: RunState, rank: int, event: wire.Event) -> None:
        self._events.add(rank, event)

    def on_prints(self, run: RunState, step: int, prints: dict[int, dict]) -> None:
        if self.replicas is None and any(fp.get("at") == "start" for fp in prints.values()):
            self.replicas = start_replicas(prints)
            waiting, self._waiting = self._waiting, []
            if self.replicas:  # the ranks without DDP are replicas after all: judge the steps held back
                for held in waiting:
                    self._judge(*held)

    def on_step(self, run: RunState, step: int, records: dict[int, wire.StepRecord]) -> None:
        repeats = []
        for rank, event in self._events.due(step):
            if event.kind == "train_config":
                group = event_pairs(event.details, "facts").get("replicas")
                if group:
                    self.groups[rank] = group
            elif event.kind == "batch_repeat":
                repeats.append((rank, event))
        if repeats and self.repeat is None:
            first = min(e.step or 0 for _, e in repeats)
            ranks = sorted({r for r, e in repeats if (e.step or 0) == first})
            details = next(e.details for r, e in repeats if (e.step or 0) == first)
            ended = [records[r].ended_at for r in ranks if r in records]
            self.repeat = {"step": first, "ranks": ranks, "details": dict(details),
                           "first_at": min(ended) if ended else None}
        if self.finding is not None:
            return
        if self._streak is None and not self._waiting:
            # Every rank's batch its own (a healthy step) and no streak to
            # carry on: nothing to judge, without a tuple per rank.
            batches = [rec.batch_fp for rec in records.values()]
            missing = batches.count(None)
            if len(set(batches)) - (1 if missing else 0) == len(batches) - missing:
                return
        fps = {r: (self.groups.get(r, "none"), rec.batch_fp, rec.ended_at) for r, rec in records.items()
               if rec.batch_fp is not None}
        if self.replicas is None and any(g == "none" for g, _, _ in fps.values()):
            # Without DDP, only replicas must see different data: wait for the start fingerprints.
            if len(self._waiting) < WAITING:
                self._waiting.append((step, fps))
            return
        self._judge(step, fps)

    def _judge(self, step: int, fps: dict[int, tuple[str, int, float]]) -> None:
        if self.finding is not None:
            return
        by_group: dict[tuple[str, int], list[int]] = {}
        seen: set[int] = set()
        for rank, (group, fp, _) in fps.items():
            if group == "none" and not self.replicas:
                continue
            seen.add(rank)
            by_group.setdefault((group, fp), []).append(rank)
        shared = {r for ranks in by_group.values() if len(ranks) >= 2 for r in ranks}
        streak = self._streak
        if streak is None:
            if shared:
                self._streak = {"start": step, "ranks": shared, "steps": 1, "fps": fps}
            return
        # A rank without a fingerprint at this step neither confirms nor breaks its streak.
        kept = {r for r in streak["ranks"] if r in shared or r not in seen}
        if len(kept) < 2:
            self._streak = {"start": step, "ranks": shared, "steps": 1, "fps": fps} if shared else None
            return
        streak["ranks"], streak["steps"] = kept, streak["steps"] + 1
        if streak["steps"] >= STREAK:
            first = streak["fps"]
            ended = [first[r][2] for r in kept if r in first]
            groups = {}
            for (group, fp), ranks in by_group.items():
                mine = sorted(r for r in ranks if r in kept)
                if len(mine) >= 2:
                    groups[f"#{fp:013x}"] = mine
            self.finding = {"step": streak["start"], "ranks": sorted(kept), "last_step": step,
                            "groups": groups, "first_at": min(ended) if ended else None}


register_tracker("duplicate_data", Tracker)


def detect(run: RunState, now: float, final: bool) -> list[wire.Verdict]:
    settle(run, final)
    state = tracker(run, "duplicate_data")
    out = []
    finding, repeat = state.finding, state.repeat
    if finding is not None:
        ranks = finding["ranks"]
        sets = list(finding["groups"].values())
        together = ("every rank of the group" if len(sets) == 1 and len(sets[0]) == len(ranks) else
                    "; ".join(ranks_text(s) for s in sets[:4]) + " each")
        summary = (f"{ranks_text(ranks).capitalize()} trained on identical input batches from step {finding['step']} "
                   f"(to step {finding['last_step']} at least; {together} with the same batch): the ranks read "
                   f"the same data, so the job trains on 1/{max(2, len(sets[0]) if sets else 2)} of what it pays "
                   f"for. Cause: no DistributedSampler (or one built without num_replicas/rank), or the same seed "
                   f"and the same data source on every rank. Shard the data per rank "
                   f"(DistributedSampler(dataset), sampler.set_epoch(epoch)).")
        out.append(verdict("duplicate_data", ranks, finding["step"], finding["first_at"] or now, now, summary,
                           {"shared_batches": finding["groups"], "steps": [finding["step"], finding["last_step"]],
                            "across_ranks": True}))
    if repeat is not None:
        ranks, details = repeat["ranks"], repeat["details"]
        fresh = bool(details.get("new_iterator_every_step"))
        how = ("a new DataLoader iterator is made every step (next(iter(loader))), so it always yields the "
               "same first batch" if fresh else "the batch is not taken from the loader anew at each step")
        summary = (f"{ranks_text(ranks).capitalize()} trained on the same input batch at "
                   f"{details.get('repeats', 'several')} steps in a row from step {details.get('first_step', repeat['step'])}, "
                   f"although {verb(ranks, 'its', 'their')} DataLoader has {details.get('batches_per_epoch')} "
                   f"batches per epoch and finished no epoch in between: {how}. Iterate the loader "
                   f"(it = iter(loader) once per epoch, then next(it)).")
        out.append(verdict("duplicate_data", ranks, repeat["step"], repeat["first_at"] or now, now, summary,
                           {"same_batch_repeated": {k: details.get(k) for k in (
                               "repeats", "first_step", "batches_per_epoch", "new_iterator_every_step", "sampler",
                               "dataset")}, "across_ranks": False}))
    return out
