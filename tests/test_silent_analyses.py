"""The silent-error analyses (config_divergence, duplicate_data,
broken_update, and weight_divergence's causes) as pure functions of a
RunState built from synthetic records, events and fingerprints: culprit
rules, what is not a fault, the same verdict live (in batches) and offline
(all at once), and the actions (on_<kind>: ignore / abort) of an in-process
collector. No training processes."""

from __future__ import annotations

import random
import time

import pytest

from rankwatch import wire
from rankwatch.collector import analyses
from rankwatch.collector.analyses import explain_away
from rankwatch.collector.analyses.common import iso
from rankwatch.collector.metrics import CollectorMetrics
from rankwatch.collector.service import Collector
from rankwatch.collector.state import RunState
from rankwatch.config import Config

T0 = float(int(time.time()) + 100_000)
DDP4 = "ddp:4:000000000abcd"
BASE = {"mode": "train", "clip": "none", "autocast": "off", "micro_batches": "1", "replicas": DDP4,
        "params": "6 tensors, 100 elements, float32 x6 (shapes #1)", "batches_per_epoch": "20"}


def rec(step: int, *, batch: int | None = None, optim: int | None = 7, lr: float | None = 0.1) -> wire.StepRecord:
    return wire.StepRecord(step=step, started_at=T0 + step, ended_at=T0 + step + 0.5, loss=1.0, grad_norm=1.0,
                           batch_fp=batch, optim_fp=optim, lr=lr)


def facts(step: int, values: dict, sites: dict | None = None) -> wire.Event:
    details = {"facts": [[k, v] for k, v in values.items()]}
    if sites:
        details["sites"] = [[k, v] for k, v in sites.items()]
    return wire.Event(kind="train_config", at=T0 + step + 0.4, step=step, details=details)


def event(kind: str, step: int, **details) -> wire.Event:
    return wire.Event(kind=kind, at=T0 + step + 0.4, step=step, details=details)


def build(world: int, steps: int, record=None, events=None, prints=None) -> list[tuple[int, str, object]]:
    """A run as the collector receives it: (rank, what, item) in arrival order."""
    items = []
    for s in range(steps):
        for r in range(world):
            for e in (events or {}).get((r, s), []):
                items.append((r, "event", e))
            items.append((r, "step", (record or (lambda r, s: rec(s)))(r, s)))
            for fp in (prints or {}).get((r, s), []):
                items.append((r, "print", fp))
    return items


def feed(run: RunState, items) -> None:
    for rank, what, item in items:
        state = run.rank(rank)
        if what == "step":
            state.add_step(item)
        elif what == "event":
            state.add_event(item)
        else:
            state.add_fingerprint(item)


def detect(module, items, world: int, batches: int = 1, seed: int = 0) -> list[wire.Verdict]:
    """Offline (all at once) and live (in shuffled per-rank batches, analysed
    between batches): the same verdicts, or the test fails."""
    offline = RunState(run_id="off", world_size=world)
    feed(offline, items)
    found = module.detect(offline, T0 + 1e4, True)
    live = RunState(run_id="live", world_size=world)
    per_rank: dict[int, list] = {}
    for item in items:
        per_rank.setdefault(item[0], []).append(item)
    rnd = random.Random(seed)
    while any(per_rank.values()):
        rank = rnd.choice([r for r, q in per_rank.items() if q])
        take = rnd.randint(1, max(1, batches))
        feed(live, per_rank[rank][:take])
        del per_rank[rank][:take]
        module.detect(live, T0 + 1e4, False)
    again = module.detect(live, T0 + 1e4, True)
    assert [(v.kind, v.ranks, v.step) for v in again] == [(v.kind, v.ranks, v.step) for v in found]
    return found


# -- config_divergence -------------------------------------------------------------------------------


def test_one_rank_clipping_is_named_with_its_line():
    events = {(r, 0): [facts(0, BASE)] for r in range(4)}
    events[(2, 5)] = [facts(5, {"clip": "norm 1"}, {"clip": "train.py:88"})]
    (v,) = detect(analyses.config_divergence, build(4, 12, events=events), 4, batches=3)
    assert (v.kind, v.ranks, v.step) == ("config_divergence", [2], 5)
    assert "Gradient clipping" in v.summary and "train.py:88" in v.summary
    assert v.evidence["facts"]["clip"] == {"0": "none", "1": "none", "2": "norm 1", "3": "none"}


def test_no_majority_names_every_rank_and_uneven_loaders_name_the_short_ones():
    two = {(r, 0): [facts(0, {**BASE, "autocast": "off" if r == 0 else "cpu bfloat16"})] for r in range(2)}
    (v,) = detect(analyses.config_divergence, build(2, 6, events=two), 2)
    assert v.ranks == [0, 1] and v.step == 0
    uneven = {(r, 0): [facts(0, {**BASE, "batches_per_epoch": "11" if r < 2 else "10"})] for r in range(4)}
    (v,) = detect(analyses.config_divergence, build(4, 6, events=uneven), 4)
    assert v.ranks == [2, 3] and v.step == 0
    assert "Ranks 2, 3 had 10 batches per epoch, ranks 0, 1 had 11" in v.summary
    assert "DistributedSampler" in v.summary and "Join" in v.summary
    assert v.evidence["ranks"]["3"] == {"batches_per_epoch": 10}
    joined = {(r, 0): [facts(0, {**BASE, "batches_per_epoch": "11" if r < 2 else "10", "join": "yes"})]
              for r in range(4)}
    assert detect(analyses.config_divergence, build(4, 6, events=joined), 4) == []


def test_facts_compared_from_their_counts_find_what_a_rank_by_rank_comparison_finds(monkeypatch):
    """A step whose facts changed is compared rank by rank only when the
    counts of each group's values show a difference (or a fact some ranks
    lack, or a rank with facts behind the step): on random histories
    (groups, start-up facts shared by ranks as decoding shares them, facts
    set and cleared, changes rolled across ranks at different steps or at
    the start-up step itself, ranks whose records stop early) the verdicts
    and the groups' agreed values are those of the rank-by-rank comparison
    on every step, and the counts are a recount of the facts after each."""
    from collections import Counter

    from rankwatch.collector.analyses import config_divergence

    def history(rng):
        world = rng.randint(2, 6)
        groups = [rng.choice((DDP4, "ddp:2:00000000000ff", "none")) for _ in range(world)]
        shared: dict[tuple, wire.Event] = {}
        events = {}
        for r in range(world):
            start = {"mode": "train", "clip": "none", "replicas": groups[r], "batches_per_epoch": "20"}
            if rng.random() < 0.2:
                start["join"] = "yes"
            key = tuple(sorted(start.items()))
            if key not in shared:  # ranks with the same start-up facts get the same object
                shared[key] = facts(0, start)
            events[(r, 0)] = [shared[key]]
        for _ in range(rng.randint(0, 4)):  # a change, on some ranks, each at its own step
            key, value = rng.choice((("mode", "eval"), ("clip", "norm 1"), ("batches_per_epoch", "19"),
                                     ("autocast", "cpu bfloat16"), ("autocast", ""), ("clip", ""),
                                     ("replicas", "ddp:2:00000000000ff")))
            at = rng.randint(0, 8)
            for r in rng.sample(range(world), rng.randint(1, world)):
                events.setdefault((r, at + rng.randint(0, 1)), []).append(facts(at, {key: value}))
        stops = {r: rng.randint(1, 11) for r in range(world) if rng.random() < 0.25}  # records end early
        items = [item for item in build(world, 12, events=events)
                 if not (item[1] == "step" and item[0] in stops and item[2].step > stops[item[0]])]
        return world, items

    def recount(tracker):
        counts: dict[tuple, Counter] = {}
        for held in tracker.facts.values():
            group = held.get("replicas", "none")
            for key, value in held.items():
                counts.setdefault((group, key), Counter())[value] += 1
        return {k: dict(c) for k, c in counts.items()}, dict(Counter(f.get("replicas", "none")
                                                                     for f in tracker.facts.values()))

    real_on_step = config_divergence.Tracker.on_step

    def checked_on_step(self, run, step, records):
        real_on_step(self, run, step, records)
        assert (self._values, self._group_sizes) == recount(self)
    monkeypatch.setattr(config_divergence.Tracker, "on_step", checked_on_step)

    def outcome(world, items):
        run = RunState(run_id="r", world_size=world)
        feed(run, items)
        found = config_divergence.detect(run, T0 + 1e4, True)
        agreed = config_divergence.tracker(run, "config_divergence").agreed
        return [(v.ranks, v.step, v.summary) for v in found], dict(agreed)

    real = config_divergence.Tracker._every_group_agrees
    fast_taken = 0
    for seed in range(400):
        world, items = history(random.Random(seed))
        calls = []

        def counted(self, frontier, step):
            calls.append(real(self, frontier, step))
            return calls[-1]
        monkeypatch.setattr(config_divergence.Tracker, "_every_group_agrees", counted)
        from_counts = outcome(world, items)
        fast_taken += sum(calls)
        monkeypatch.setattr(config_divergence.Tracker, "_every_group_agrees", lambda self, frontier, step: False)
        rank_by_rank = outcome(world, items)
        assert from_counts == rank_by_rank, seed
    assert fast_taken > 100  # the counts' road was taken, not only the walk


@pytest.mark.parametrize("culprit", [0, 1])
def test_two_ranks_name_the_one_that_departed_from_what_both_had(culprit):
    """No majority with two ranks: the rank whose mode (or learning rate)
    changed from the value both last agreed on is named, not both."""
    events = {(r, 0): [facts(0, BASE)] for r in range(2)}
    events[(culprit, 4)] = [facts(4, {"mode": "eval"}, {"mode": "train.py:61"})]
    (v,) = detect(analyses.config_divergence, build(2, 10, events=events), 2, batches=3)
    assert (v.ranks, v.step) == ([culprit], 4), v.summary
    assert f"from rank {1 - culprit} from step 4" in v.summary and "train.py:61" in v.summary

    def record(r, s):
        lr = 0.1 * (0.5 if (r == culprit and s >= 3) else 1.0)
        return rec(s, optim=7 if lr == 0.1 else 8, lr=lr)
    (v,) = detect(analyses.config_divergence, build(2, 8, record=record, events=events), 2, batches=3)
    assert (v.ranks, v.step) == ([culprit], 3) and "learning rate" in v.summary


def test_only_ranks_of_one_data_parallel_group_are_compared():
    """Two DDP groups may train differently by design (two models, pipeline stages)."""
    events = {(r, 0): [facts(0, {**BASE, "replicas": "ddp:2:a" if r < 2 else "ddp:2:b",
                                 "clip": "none" if r < 2 else "norm 1"})] for r in range(4)}
    assert detect(analyses.config_divergence, build(4, 6, events=events), 4) == []


def test_parameters_without_ddp_are_compared_only_between_replicas():
    def run(grads_equal: bool):
        events = {(r, 0): [facts(0, {**BASE, "replicas": "none", "params": f"{3 + r} tensors"})] for r in range(3)}
        prints = {(r, 0): [{"step": 0, "at": "start", "source": "optimizer", "names": ["param:w", "grad:w"],
                            "norms": [1.0, 2.0 if grads_equal else 2.0 + r]}] for r in range(3)}
        return detect(analyses.config_divergence, build(3, 6, events=events, prints=prints), 3)
    assert run(grads_equal=False) == []  # pipeline stages: different parameters by design
    (v,) = run(grads_equal=True)
    assert v.ranks == [0, 1, 2] and "trained parameters" in v.summary


def test_learning_rate_from_the_step_digest():
    def record(r, s):
        lr = 0.1 * (0.5 if (r == 0 and s >= 4) else 1.0)
        return rec(s, optim=7 if lr == 0.1 else 8, lr=lr)
    events = {(r, 0): [facts(0, BASE)] for r in range(4)}
    (v,) = detect(analyses.config_divergence, build(4, 10, record=record, events=events), 4, batches=4)
    assert (v.ranks, v.step) == ([0], 4) and "learning rate" in v.summary and "0.05" in v.summary
    other = lambda r, s: rec(s, optim=9 if (r == 1 and s >= 2) else 7, lr=0.1)  # noqa: E731
    (v,) = detect(analyses.config_divergence, build(4, 6, record=other, events=events), 4)
    assert (v.ranks, v.step) == ([1], 2) and "hyper-parameters" in v.summary


def test_a_loss_scale_read_late_must_differ_on_two_steps():
    events = {(r, 0): [facts(0, {**BASE, "loss_scale": "1024"})] for r in range(3)}
    events[(1, 4)] = [facts(4, {"loss_scale": "512"})]
    events[(1, 5)] = [facts(5, {"loss_scale": "1024"})]  # the others' read came a step later: the same again
    assert detect(analyses.config_divergence, build(3, 8, events=events), 3) == []
    events[(1, 5)] = []
    (v,) = detect(analyses.config_divergence, build(3, 8, events=events), 3)
    assert (v.ranks, v.step) == ([1], 4) and "loss scale" in v.summary


def test_a_rank_absent_from_a_sampled_step_is_still_compared():
    """At scale each rank sends every 2^k-th record: the step where the fact
    changed may hold only the others' records."""
    events = {(r, 0): [facts(0, BASE)] for r in range(3)}
    events[(2, 3)] = [facts(3, {"mode": "eval"}, {"mode": "train.py:40"})]
    items = [i for i in build(3, 12, events=events) if not (i[0] == 2 and i[1] == "step" and i[2].step % 4)]
    (v,) = detect(analyses.config_divergence, items, 3)
    assert v.ranks == [2] and v.step == 3 and "'eval'" in v.summary


# -- duplicate_data ----------------------------------------------------------------------------------------


def _groups(world, group=DDP4):
    return {(r, 0): [facts(0, {**BASE, "replicas": group})] for r in range(world)}


def test_ranks_sharing_batches_for_three_steps_are_named():
    record = lambda r, s: rec(s, batch=1000 + s if r in (1, 3) else 10 * r + s * 100)  # noqa: E731
    (v,) = detect(analyses.duplicate_data, build(4, 8, record=record, events=_groups(4)), 4, batches=3)
    assert (v.kind, v.ranks, v.step) == ("duplicate_data", [1, 3], 0)
    assert "identical input batches" in v.summary and "DistributedSampler" in v.summary


def test_a_coincidence_or_a_fixed_warm_up_batch_is_not_duplicated_data():
    record = lambda r, s: rec(s, batch=5 if s in (0, 1, 4) else 10 * r + 100 * s)  # noqa: E731
    assert detect(analyses.duplicate_data, build(4, 10, record=record, events=_groups(4)), 4) == []


def test_without_ddp_only_replicas_are_compared():
    record = lambda r, s: rec(s, batch=77 + s)  # noqa: E731
    no_ddp = _groups(3, "none")
    assert detect(analyses.duplicate_data, build(3, 6, record=record, events=no_ddp), 3) == []
    prints = {(r, 0): [{"step": 0, "at": "start", "source": "optimizer", "names": ["param:w", "grad:w"],
                        "norms": [1.0, 2.0]}] for r in range(3)}
    (v,) = detect(analyses.duplicate_data, build(3, 6, record=record, events=no_ddp, prints=prints), 3)
    assert v.ranks == [0, 1, 2]


def test_the_same_batch_step_after_step_on_one_rank():
    events = _groups(3)
    events[(1, 7)] = [event("batch_repeat", 4, repeats=4, first_step=3, batches_per_epoch=16,
                            new_iterator_every_step=True, sampler="DistributedSampler", dataset="TensorDataset")]
    (v,) = detect(analyses.duplicate_data, build(3, 10, record=lambda r, s: rec(s, batch=r * 1000 + s),
                                                  events=events), 3)
    assert (v.ranks, v.step) == ([1], 4) and "next(iter(loader))" in v.summary


# -- broken_update -----------------------------------------------------------------------------------------


def test_broken_update_names_every_rank_and_each_check():
    events = {(r, 1): [event("broken_update", 0, check="not_in_optimizer", parameters=["head.weight", "head.bias"],
                             count=2, optimizer_tensors_not_in_model=2)] for r in range(3)}
    events[(0, 2)] = [event("broken_update", 1, check="grads_not_cleared", parameters=["body.0.weight"])]
    (v,) = detect(analyses.broken_update, build(3, 6, events=events), 3, batches=2)
    assert (v.kind, v.ranks, v.step) == ("broken_update", [0, 1, 2], 0)
    assert "in no optimizer" in v.summary and "never cleared" in v.summary
    assert v.evidence["checks"]["grads_not_cleared"]["ranks"] == [0]


# -- weight_divergence causes ---------------------------------------------------------------------------------


def _start(r, params, grads):
    return {"step": 0, "at": "start", "source": "optimizer", "names": ["param:w", "param:b", "grad:w", "grad:b"],
            "norms": [*params, *grads]}


def test_replicas_that_started_apart_are_named_all_without_a_majority():
    prints = {(r, 0): [_start(r, [1.0 + r, 0.5], [3.0, 0.2])] for r in range(3)}
    (v,) = detect(analyses.weight_divergence, build(3, 4, prints=prints), 3)
    assert (v.ranks, v.step, v.evidence["cause"]) == ([0, 1, 2], 0, "unsynced_start")
    one = {(r, 0): [_start(r, [1.0 if r != 2 else 1.5, 0.5], [3.0, 0.2])] for r in range(3)}
    (v,) = detect(analyses.weight_divergence, build(3, 4, prints=one), 3)
    assert v.ranks == [2] and v.evidence["cause"] == "unsynced_start"


def _later(step, norms_of):
    return {"step": step, "names": ["param:w", "param:b"], "norms": norms_of}


@pytest.mark.parametrize("changed", [0, 1])
def test_two_replicas_that_differ_are_both_named(changed):
    """Two ranks: the difference is the same whichever rank changed, so both
    are named (the old rule took rank 0 as the reference and blamed rank 1
    when rank 0 had changed)."""
    prints = {(r, 5): [_later(5, [2.0 + (r == changed), 1.0])] for r in range(2)}
    (v,) = detect(analyses.weight_divergence, build(2, 8, prints=prints), 2)
    assert (v.ranks, v.step, v.evidence["reference_ranks"]) == ([0, 1], 5, [])
    assert "No majority" in v.summary and "each other" in v.summary


def test_a_tie_waits_for_a_step_with_every_replica():
    """Three ranks, one sampled a fingerprint step out: a 1-1 tie decides
    nothing; the next step with all three has a majority."""
    prints = {(0, 5): [_later(5, [2.0, 1.0])], (1, 5): [_later(5, [3.0, 1.0])]}
    prints.update({(r, 9): [_later(9, [2.0 + (r == 1), 1.0])] for r in range(3)})
    (v,) = detect(analyses.weight_divergence, build(3, 12, prints=prints), 3)
    assert (v.ranks, v.step, v.evidence["reference_ranks"]) == ([1], 9, [0, 2])
    tie = {(r, 5): [_later(5, [2.0 + (r >= 2), 1.0])] for r in range(4)}  # 2 against 2, every rank
    (v,) = detect(analyses.weight_divergence, build(4, 8, prints=tie), 4)
    assert v.ranks == [0, 1, 2, 3] and "No majority" in v.summary


def test_ranks_whose_gradients_differ_are_not_replicas():
    """Model or pipeline parallelism: different weights and gradients by design, never compared."""
    prints = {(r, 0): [_start(r, [1.0 + r, 0.5], [3.0 + r, 0.2])] for r in range(3)}
    later = {(r, 9): [{"step": 9, "source": "optimizer", "names": ["param:w", "param:b"], "norms": [2.0 + r, 1.0]}]
             for r in range(3)}
    assert detect(analyses.weight_divergence, build(3, 12, prints={**prints, **later}), 3) == []


def test_a_backward_ddp_never_reduced_is_named_at_its_step():
    events = {(r, 3): [event("unreduced_backward", 3, via="module", module="Net", site="train.py:51")]
              for r in range(3)}
    (v,) = detect(analyses.weight_divergence, build(3, 8, events=events), 3)
    assert (v.ranks, v.step, v.evidence["cause"]) == ([0, 1, 2], 3, "unreduced_gradients")
    assert "train.py:51" in v.summary and ".module" in v.summary


# -- one fault, one verdict ---------------------------------------------------------------------------------------


def _v(kind, ranks, t, step=None, **evidence):
    return wire.Verdict(kind=kind, ranks=ranks, step=step, first_seen_at=iso(T0 + t), detected_at=iso(T0 + t + 1),
                        summary=f"{kind} summary", evidence=evidence)


def test_what_a_config_divergence_brings_about_is_its_consequence():
    root = _v("config_divergence", [2, 3], 0, 0)
    effects = [_v("hang", [2, 3], 30, 11), _v("weight_divergence", [2], 10, 9), _v("grad_spike", [1], 12, 10),
               _v("collective_mismatch", [2], 29, 11)]
    (only,) = explain_away([root, *effects])
    assert only.kind == "config_divergence"
    records = {c["kind"]: c for c in only.evidence["consequences"]}
    assert set(records) == {"hang", "weight_divergence", "grad_spike", "collective_mismatch"}
    assert records["weight_divergence"]["cause"] == "config_divergence@0:r2-3"  # the id of the verdict it follows from
    # Unrelated to it: a crash on another rank, a leak, an OOM, and anything before it.
    others = [_v("crash", [0], 20, 5), _v("memory_growth", [1], 20, 5), _v("nonfinite", [0], 15, 4),
              _v("weight_divergence", [1], -30, 0)]
    kept = explain_away([root, *others])
    assert {v.kind for v in kept} == {"config_divergence", "crash", "memory_growth", "nonfinite", "weight_divergence"}


# -- the collector's actions ------------------------------------------------------------------------------------


def _collector_run(config: Config) -> tuple[Collector, list[wire.Verdict]]:
    collector = Collector(config)
    world = 3
    for s in range(8):
        for r in range(world):
            events = [facts(0, {**BASE, "replicas": "ddp:3:x"})] if s == 0 else []
            if s == 3 and r == 1:
                events.append(facts(3, {"mode": "eval"}))
            if s == 1:
                events.append(event("broken_update", 0, check="grads_not_cleared", parameters=["w"]))
            hb = wire.Heartbeat(
                identity=wire.RankIdentity(run_id="job", rank=r, local_rank=r, world_size=world, host="h", pid=10 + r),
                sent_at=T0 + s, seq=s + 1, step=s + 1, forwards=s + 1, phase="data", phase_since=T0 + s,
                last_progress_at=T0 + s, steps=[rec(s, batch=5 + s)], events=events)
            collector.ingest_heartbeat(hb, now=T0 + s)
    verdicts = collector._analyse(collector.runs["job"], T0 + 9, final=False)
    return collector, verdicts


def test_on_kind_ignore_silences_and_abort_ends_the_job():
    _, verdicts = _collector_run(Config())
    assert {v.kind for v in verdicts} == {"config_divergence", "duplicate_data", "broken_update"}
    _, verdicts = _collector_run(Config(on_config_divergence="ignore", on_duplicate_data="ignore",
                                        on_broken_update="ignore"))
    assert verdicts == []
    collector, _ = _collector_run(Config())
    assert not collector.runs["job"].incidents  # report: no bundles asked, the job goes on
    collector, _ = _collector_run(Config(on_broken_update="abort"))
    (incident,) = collector.runs["job"].incidents
    assert incident.kind == "broken_update" and incident.details["abort"] is True


def test_metrics_count_the_new_kinds():
    collector, _ = _collector_run(Config())
    text = CollectorMetrics(collector).text(T0 + 10)
    for kind in ("config_divergence", "duplicate_data", "broken_update"):
        assert f'rankwatch_verdicts{{run="job",kind="{kind}"}} 1.0' in text
    assert 'rankwatch_suspect_rank{run="job",kind="config_divergence",rank="1"} 1.0' in text


@pytest.mark.parametrize("kind", ["config_divergence", "duplicate_data", "broken_update"])
def test_new_kinds_are_in_the_wire_format(kind):
    assert kind in wire.VERDICT_KINDS


# -- memory_growth's step ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("drift", [0.0, 0.25])
@pytest.mark.parametrize("leak_from", [3, 6, 14, 30])
def test_a_leak_is_labelled_with_the_step_it_began(leak_from, drift):
    """Flat host memory (with allocator jitter) until the leak starts, then
    +16 MiB a step on rank 1: the verdict's step is the leak's first step
    (it was the window's first step, 5, whatever the leak's start); from
    before the skipped start-up steps, the first step watched. With the
    allocator drifting 0.25 MiB a step on every rank before it (faultbench
    hf-leak-s1), still the leak's first step (it was one step early). A leak
    from the step after the first watched one is labelled that step: the
    last start-up value shows the first watched step was still flat
    (faultbench lightning-leak-s0, one step early)."""
    def record(r, s):
        base = 900e6 + (s % 3) * 1e5 + s * drift * (1 << 20)
        leaked = (s - leak_from + 1) * (16 << 20) if (r == 1 and s >= leak_from) else 0
        return wire.StepRecord(step=s, started_at=T0 + s, ended_at=T0 + s + 0.5, loss=1.0, grad_norm=1.0,
                               rss_bytes=int(base + leaked))
    (v,) = detect(analyses.memory_growth, build(3, 60, record=record), 3, batches=4)
    assert v.ranks == [1] and v.step == max(leak_from, 5), (v.step, v.summary)
