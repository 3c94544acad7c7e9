"""`config_divergence`: ranks that must train the same way do not.

Each rank's agent sends its training facts when they change
(`train_config` events, agent/checks/train_config.py): module train/eval modes,
gradient clipping, autocast, micro-batches per optimizer step, the
GradScaler's loss scale, the trained parameters' count, shapes and dtypes,
the batches per epoch of the loader feeding the training forwards, and the
values the user declared with `expect_same`. Optimizer hyper-parameters
come with every step record as a digest (`optim_fp`, and `lr`).

At each sealed step (every live rank has reported a later one, so every
rank's facts up to this step are in) the ranks are compared within their
data-parallel group (the ranks their DDP averages over; without DDP, all
ranks, and the parameter facts only when the start fingerprints showed the
ranks are replicas). Facts are compared only when some rank's facts
changed; the digest on every step (O(ranks)). The culprits are the ranks
that differ from the majority. With none (two ranks), the ranks whose value
departs from the one every rank of the group last agreed on (a scheduler
stepped on rank 0 only, a model.eval() left on one rank: the rank that
changed); with no such history (a difference from the first step), every
rank compared. For
batches per epoch (no `Join` in use), the ranks with fewer batches: they
leave the epoch first and the others wait for them (the hang that follows
is this verdict's consequence). The loss scale, read late from a GPU, must
differ on two sealed steps in a row.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, Optional

from rankwatch import wire

from ..state import RunState
from .common import (StepEvents, event_pairs, majority, ranks_text, record_frontier, register_tracker, settle, tracker,
                     verb, verdict)
from .weight_divergence import start_replicas

NOT_COMPARED = ("replicas", "join")
SLOW_KEYS = ("loss_scale",)  # read from the device a step late: must differ on two sealed steps
LISTED_RANKS = 64
OPTIMIZER = "optimizer"
_OPTIM_FP, _LR = operator.attrgetter("optim_fp"), operator.attrgetter("lr")


def describe(key: str) -> str:
    if key == "mode" or key.startswith("mode."):
        which = key.split(".", 1)[1] if "." in key else ""
        return f"Train/eval mode{' of ' + which if which else ''}"
    if key.startswith("user."):
        return f"The value declared with expect_same({key[5:]!r})"
    return {
        "clip": "Gradient clipping",
        "autocast": "Autocast (mixed precision)",
        "micro_batches": "The number of micro-batches (backwards) per optimizer step",
        "loss_scale": "The GradScaler loss scale",
        "params": "The trained parameters (count, shapes or dtypes)",
        "batches_per_epoch": "Batches per epoch",
        "lr": "The learning rate",
        OPTIMIZER: "Optimizer hyper-parameters (momentum/betas, weight decay, eps, or another param group's "
                   "learning rate)",
    }.get(key, f"The training fact {key!r}")


HINTS = {
    "mode": "a model.eval() (for validation, on some ranks) without a model.train() after it?",
    "clip": "clipping called inside a block that runs on some ranks only?",
    "autocast": "autocast switched on by a per-node or per-rank setting?",
    "micro_batches": "gradient accumulation counted differently on some ranks?",
    "loss_scale": "a GradScaler whose overflow checks are not shared between ranks?",
    "params": "a model built differently on some ranks (a per-rank option, a different checkpoint)?",
    "lr": "a learning-rate scheduler stepped on some ranks only (inside a rank-0 block)?",
    OPTIMIZER: "a scheduler or a param-group change applied on some ranks only?",
}


def _hint(key: str) -> str:
    if key.startswith("mode"):
        return HINTS["mode"]
    if key.startswith("user."):
        return "the ranks do not see the same value: check where it comes from on each node."
    return HINTS.get(key, "")


class Tracker:
    def __init__(self) -> None:
        self.events = StepEvents(("train_config",))
        self.facts: dict[int, dict[str, str]] = {}
        self.sites: dict[int, dict[str, str]] = {}
        self.changed = False
        self._facts_version = 0  # counts changes of the facts: the ranks' groups are kept until the next
        self._record_groups: Optional[tuple[int, set[int], list[list[int]]]] = None
        self._deferred_values: Optional[dict] = None
        self.replicas: Optional[bool] = None
        self.finding: Optional[dict] = None
        self._slow: Optional[tuple[int, dict]] = None  # a difference in slow facts only, at one step
        # Parameters differing without DDP before the start fingerprints said whether the ranks are replicas.
        self._deferred: Optional[tuple[int, dict, dict]] = None
        # (group, fact) -> the value every rank of the group last agreed on: the
        # run's own history, which breaks a tie between two ranks.
        self.agreed: dict[tuple[str, str], str] = {}
        # How many ranks hold each value of each fact, per group; and each
        # group's ranks with facts: a step whose facts changed is compared
        # rank by rank only when some fact has two values or is missing.
        self._values: dict[tuple[str, str], dict[str, int]] = {}
        self._group_sizes: dict[str, int] = {}

    def on_event(self, run: RunState, rank: int, event: wire.Event) -> None:
        self.events.add(rank, event)

    def on_prints(self, run: RunState, step: int, prints: dict[int, dict]) -> None:
        if self.replicas is None and any(fp.get("at") == "start" for fp in prints.values()):
            self.replicas = start_replicas(prints)
            deferred, self._deferred = self._deferred, None
            if self.replicas and deferred is not None and self.finding is None:
                self._finding(run, *deferred)  # the parameters differed from that step: replicas after all

    def on_step(self, run: RunState, step: int, records: dict[int, wire.StepRecord]) -> None:
        first: dict[int, list] = {}  # id(told) -> [its facts, ranks that start with them, told]
        for rank, event in self.events.due(step):
            told = event_pairs(event.details, "facts")
            facts = self.facts.get(rank)
            if facts is None:
                # A rank's first facts (every rank's at start-up, most of them one
                # shared object): filtered once per object, tallied once per object.
                entry = first.get(id(told))
                if entry is None:
                    entry = first[id(told)] = [{key: value for key, value in told.items() if value}, 0, told]
                self.facts[rank] = dict(entry[0])
                entry[1] += 1
            else:
                self._tally(facts, -1)
                for key, value in told.items():
                    if value:
                        facts[key] = value
                    else:
                        facts.pop(key, None)
                self._tally(facts, 1)
            self.sites.setdefault(rank, {}).update(event_pairs(event.details, "sites"))
            self.changed = True
            self._facts_version += 1
        for facts, ranks, _ in first.values():
            self._tally(facts, ranks)
        if self.finding is not None:
            return
        groups = self._groups_of_records(records)
        found: dict[str, dict[int, str]] = {}
        optimizers = set(map(_OPTIM_FP, records.values()))  # attribute reads in C: 100,000 a step at scale
        if len(optimizers) == 1 and None not in optimizers:
            # Every rank reports the same optimizer (a healthy step): only the
            # groups' agreed values are kept, without a pass per group.
            optim = f"#{optimizers.pop():013x}"
            every_lr = None not in map(_LR, records.values())
            for ranks in groups:
                group = self._group_key(ranks[0])
                self.agreed[(group, OPTIMIZER)] = optim
                if every_lr:
                    self.agreed[(group, "lr")] = f"{records[ranks[0]].lr:.6g}"
            groups = []
        elif optimizers == {None}:
            groups = []  # no rank fingerprints its optimizer: nothing to compare (not a walk of every rank)
        for ranks in groups:
            optim = {r: records[r].optim_fp for r in ranks if records[r].optim_fp is not None}
            lrs = {r: records[r].lr for r in optim if records[r].lr is not None}
            if len(set(optim.values())) > 1:
                if len(lrs) == len(optim) and len(set(lrs.values())) > 1:
                    found["lr"] = {r: f"{v:.6g}" for r, v in lrs.items()}
                else:
                    found[OPTIMIZER] = {r: f"#{v:013x}" for r, v in optim.items()}
            elif len(optim) >= 2:
                group = self._group_key(ranks[0])
                self.agreed[(group, OPTIMIZER)] = f"#{next(iter(optim.values())):013x}"
                if len(lrs) == len(optim):
                    self.agreed[(group, "lr")] = f"{next(iter(lrs.values())):.6g}"
        frontier = record_frontier(run)  # each rank's newest step record
        if self._slow is None and self.changed and self._every_group_agrees(frontier, step):
            self.changed = False  # nothing differs anywhere: no walk of every rank
        elif self.changed or self._slow is not None:
            # Facts as of this step: every rank that has reached it (at scale a
            # sealed step holds only the ranks whose sampled records include it).
            self.changed = False
            reached = {r: None for r in self.facts if frontier.get(r, -1) >= step}
            self._deferred_values = None
            for ranks in self._groups(reached):
                found.update(self._compare(ranks))
            if self._deferred_values is not None and self._deferred is None:
                self._deferred = (step, records, {"params": self._deferred_values})
        slow_only = bool(found) and all(k in SLOW_KEYS for k in found)
        if slow_only:
            previous, self._slow = self._slow, (step, found)
            if previous is None or previous[0] >= step:
                return
            step, found = previous  # the first step of the two
        else:
            self._slow = None
        if found:
            self._finding(run, step, records, found)

    def _tally(self, facts: dict[str, str], ranks: int) -> None:
        """Count ``ranks`` ranks holding ``facts`` in (negative: no longer)."""
        group = facts.get("replicas", "none")
        size = self._group_sizes.get(group, 0) + ranks
        if size:
            self._group_sizes[group] = size
        else:
            del self._group_sizes[group]  # a group no rank is in any more (its name is the agent's text)
        for key, value in facts.items():
            counts = self._values.get((group, key))
            if counts is None:
                counts = self._values[(group, key)] = {}
            held = counts.get(value, 0) + ranks
            if held:
                counts[value] = held
            else:
                del counts[value]
                if not counts:
                    del self._values[(group, key)]

    def _every_group_agrees(self, frontier: dict[int, int], step: int) -> bool:
        """Every rank of each group holds every compared fact, with one value,
        and every rank with facts has reached ``step``: what `_compare` of the
        ranks that reached it would find nothing in, known from the counts
        (O(facts) and one pass in C, not a walk per rank). Then the groups'
        agreed values are noted as `_compare` notes them; otherwise the
        caller compares rank by rank. (The counts are of every rank with
        facts; the comparison is of the ranks that reached the step: with a
        rank behind, exited or not yet heard, they could differ.)"""
        if min(map(frontier.get, self.facts, itertools.repeat(-1)), default=step) < step:
            return False
        agreed = {}
        for (group, key), counts in self._values.items():
            if key in NOT_COMPARED or (key == "batches_per_epoch" and "yes" in self._values.get((group, "join"), ())):
                continue
            size = self._group_sizes.get(group, 0)
            if len(counts) != 1:
                return False
            (value, held), = counts.items()
            if held != size:
                return False
            if size >= 2:
                agreed[(group, key)] = value
        self.agreed.update(agreed)
        return True

    def _group_key(self, rank: int) -> str:
        facts = self.facts.get(rank)
        return facts.get("replicas", "none") if facts else "none"

    def _groups_of_records(self, records: dict[int, wire.StepRecord]) -> list[list[int]]:
        """`_groups` of a sealed step's ranks, kept while the facts and the
        ranks stay the same (a sort of every rank each step, ~8 ms at 10,000)."""
        kept = self._record_groups
        if kept is not None and kept[0] == self._facts_version and records.keys() == kept[1]:
            return kept[2]
        groups = self._groups(records)
        self._record_groups = (self._facts_version, set(records), groups)
        return groups

    def _groups(self, ranks) -> list[list[int]]:
        """Ranks of one data-parallel group (the DDP's process group) together."""
        groups: dict[str, list[int]] = {}
        for rank in sorted(ranks):
            groups.setdefault(self._group_key(rank), []).append(rank)
        return [ranks for ranks in groups.values() if len(ranks) >= 2]

    def _departed(self, key: str, values: dict[int, str]) -> list[int]:
        """No majority: the ranks whose value is not the one their group last
        agreed on, when the others still hold it; none without that history."""
        agreed = self.agreed.get((self._group_key(min(values)), key))
        if agreed is None:
            return []
        departed = sorted(r for r, v in values.items() if v != agreed)
        return departed if 0 < len(departed) < len(values) else []

    def _compare(self, ranks: list[int]) -> dict[str, dict[int, str]]:
        with_facts = [r for r in ranks if r in self.facts]
        if len(with_facts) < 2:
            return {}
        no_ddp = all(self.facts[r].get("replicas", "none") == "none" for r in with_facts)
        joined = any(self.facts[r].get("join") == "yes" for r in with_facts)
        keys: set[str] = set()
        for r in with_facts:
            keys.update(self.facts[r])
        out = {}
        for key in sorted(keys):
            if key in NOT_COMPARED or (key == "batches_per_epoch" and joined):
                continue
            values = {r: self.facts[r][key] for r in with_facts if key in self.facts[r]}
            if len(values) >= 2 and len(set(values.values())) == 1 and len(values) == len(with_facts):
                self.agreed[(self._group_key(with_facts[0]), key)] = next(iter(values.values()))
            if len(values) < 2 or len(set(values.values())) <= 1:
                continue
            if key == "params" and no_ddp and not self.replicas:
                # Without DDP, only replicas must hold the same parameters: known from the start fingerprints.
                if self.replicas is None and self._deferred is None:
                    self._deferred_values = values
                continue
            out[key] = values
        return out

    def _finding(self, run: RunState, step: int, records: dict[int, wire.StepRecord],
                 found: dict[str, dict[int, str]]) -> None:
        culprits: set[int] = set()
        per_key = {}
        for key, values in found.items():
            if key == "batches_per_epoch":
                numbers = {r: int(v) for r, v in values.items() if v.isdigit()}
                common, odd = majority(numbers)
                if common is None and numbers:
                    fewest = min(numbers.values())
                    odd = sorted(r for r, v in numbers.items() if v == fewest)
            else:
                common, odd = majority(values)
                if common is None:
                    odd = self._departed(key, values) or sorted(values)
            culprits.update(odd)
            per_key[key] = odd
        ranks = sorted(culprits)
        ended = [records[r].ended_at for r in ranks if r in records] or [rec.ended_at for rec in records.values()]
        self.finding = {"step": step, "ranks": ranks, "found": found, "per_key": per_key,
                        "first_at": min(ended) if ended else None,
                        "sites": {key: {r: self.sites.get(r, {}).get(key, "") for r in values}
                                  for key, values in found.items()}}


register_tracker("config_divergence", Tracker)


def _listed(values: dict[int, Any], culprits: list[int]) -> dict[str, Any]:
    ranks = sorted(values)
    if len(ranks) > LISTED_RANKS:
        keep = set(culprits[: LISTED_RANKS // 2]) | set(r for r in ranks if r not in culprits)
        ranks = sorted(keep)[:LISTED_RANKS]
    return {str(r): values[r] for r in ranks}


def _sentence(key: str, values: dict[int, str], odd: list[int], sites: dict[int, str]) -> str:
    if key == "batches_per_epoch":
        numbers = {r: int(v) for r, v in values.items() if v.isdigit()}
        few = sorted(odd)
        many = sorted(r for r in numbers if r not in odd)
        few_n = sorted({numbers[r] for r in few})
        many_n = sorted({numbers[r] for r in many})
        if len(few_n) == 1 and len(many_n) == 1:
            head = f"{ranks_text(few).capitalize()} had {few_n[0]} batches per epoch, {ranks_text(many)} had {many_n[0]}"
        else:
            head = "Batches per epoch differ: " + ", ".join(f"rank {r}: {n}" for r, n in sorted(numbers.items())[:16])
        return (f"{head}: the data is split unevenly between ranks and no Join is in use, so at the end of the "
                f"first epoch the ranks with fewer batches leave the loop while the others wait for them in the "
                f"next collective (a hang or a collective mismatch). Split the data with DistributedSampler "
                f"(equal shares, padded) or wrap the loop in torch.distributed.algorithms.Join.")
    by_value: dict[str, list[int]] = {}
    for rank, value in values.items():
        by_value.setdefault(value, []).append(rank)
    ordered = sorted(by_value.items(), key=lambda kv: (not set(kv[1]) & set(odd), -len(kv[1]), kv[1][0]))
    parts = []
    for value, ranks in ordered[:4]:
        shown = value if len(value) <= 120 else value[:117] + "..."
        site = next((sites.get(r) for r in ranks if sites.get(r) and set(ranks) & set(odd)), "")
        parts.append(f"{ranks_text(ranks)} {verb(ranks, 'has', 'have')} {shown!r}" + (f" (set at {site})" if site else ""))
    hint = _hint(key)
    return f"{describe(key)} differs between ranks: {'; '.join(parts)}." + (f" Cause: {hint}" if hint else "")


def detect(run: RunState, now: float, final: bool) -> list[wire.Verdict]:
    settle(run, final)
    finding = tracker(run, "config_divergence").finding
    if finding is None:
        return []
    step, ranks, found = finding["step"], finding["ranks"], finding["found"]
    ordered_keys = sorted(found, key=lambda k: (k != "batches_per_epoch", k))
    sentences = [_sentence(k, found[k], finding["per_key"][k], finding["sites"].get(k, {})) for k in ordered_keys]
    causes = ", ".join(describe(k).lower() for k in ordered_keys[:4] if k != "batches_per_epoch")
    if ordered_keys[0] == "batches_per_epoch":
        summary = " ".join(sentences)
    else:
        others = sorted(set(found[ordered_keys[0]]) - set(ranks))
        summary = (f"{ranks_text(ranks).capitalize()} {verb(ranks, 'trains', 'train')} differently from "
                   f"{(ranks_text(others) if len(others) <= 8 else 'the other ranks') if others else 'each other'} from step "
                   f"{step} ({causes}). " + " ".join(sentences))
    evidence: dict[str, Any] = {
        "differing": ordered_keys,
        "facts": {k: _listed(found[k], finding["per_key"][k]) for k in ordered_keys},
        "sites": {k: {str(r): s for r, s in v.items() if s} for k, v in finding["sites"].items()},
        "culprits_by_fact": {k: finding["per_key"][k] for k in ordered_keys},
    }
    if "batches_per_epoch" in found:
        evidence["ranks"] = {str(r): {"batches_per_epoch": int(v)} for r, v in found["batches_per_epoch"].items()
                             if v.isdigit()}
    first = finding["first_at"] if finding["first_at"] is not None else now
    return [verdict("config_divergence", ranks, step, first, now, summary[:4000], evidence)]
