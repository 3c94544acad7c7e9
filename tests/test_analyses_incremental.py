"""The analyses as running summaries: same verdicts in any arrival order
(live batches, or a whole run at once as `rankwatch analyze` feeds it),
bounded state however long the run, verdicts never retracted, one run's
failure isolated from the others, a hang clock that late heartbeats do not
reset, and /metrics rendered without the ingest lock. Pure functions and an
in-process Collector: no training processes."""

from __future__ import annotations

import logging
import random
import statistics
import threading
import time
import tracemalloc

import numpy as np
import pytest

from rankwatch import wire
from rankwatch.collector import analyses
from rankwatch.collector.analyses import common
from rankwatch.collector.metrics import CollectorMetrics
from rankwatch.collector.service import Collector
from rankwatch.collector.state import RunState, step_window
from rankwatch.config import Config

T0 = float(int(time.time()) + 100_000)  # later than any RunState is made here (their clocks start at real time)


def record(step: int, rank: int, *, compute: float = 0.05, grad: float | None = 1.0, rss: int = 1 << 30,
           loss: float = 1.0) -> wire.StepRecord:
    return wire.StepRecord(step=step, started_at=T0 + step, ended_at=T0 + step + 0.1, compute_s=compute,
                           data_s=0.001, loss=loss, grad_norm=grad, rss_bytes=rss)


def heartbeat(run_id: str, rank: int, world: int, step: int, records, sent_at: float, *,
              last_progress_at: float | None = None, fingerprints=None, events=None) -> wire.Heartbeat:
    return wire.Heartbeat(
        identity=wire.RankIdentity(run_id=run_id, rank=rank, local_rank=rank % 8, world_size=world,
                                   node_rank=rank // 8, host=f"node{rank // 8}", pid=1000 + rank, attempt=0),
        sent_at=sent_at, seq=step, step=step, forwards=step, phase="data", phase_since=sent_at,
        last_progress_at=sent_at if last_progress_at is None else last_progress_at,
        collectives_enqueued={"0": step}, steps=list(records), fingerprints=list(fingerprints or []),
        events=list(events or []))


def scenario(seed: int) -> tuple[int, list[tuple[int, wire.StepRecord]]]:
    rnd = random.Random(seed)
    n, steps = rnd.randint(2, 9), rnd.randint(15, 90)
    slow = rnd.randrange(n) if rnd.random() < 0.4 else None
    slow_from = rnd.randint(0, steps)
    spike = (rnd.randrange(n), rnd.randint(3, steps)) if rnd.random() < 0.4 else None
    leak = rnd.randrange(n) if rnd.random() < 0.3 else None
    leak_from = rnd.randint(0, steps)
    nan = (rnd.randrange(n), rnd.randint(0, steps)) if rnd.random() < 0.3 else None
    out = []
    for s in range(steps):
        for r in range(n):
            compute = 0.05 * (1 + 0.3 * rnd.random()) + (rnd.choice([0.01, 0.05, 0.2]) if slow == r and s >= slow_from
                                                         else 0.0)
            grad = (1.0 + 0.5 * rnd.random()) * (rnd.choice([5, 50, 500]) if spike == (r, s) else 1)
            rss = (1 << 30) + rnd.randint(0, 1 << 20) + (
                (s - leak_from) * rnd.choice([1 << 21, 1 << 22]) if leak == r and s >= leak_from else 0)
            loss = float("nan") if nan and nan[0] == r and s >= nan[1] else 1.0
            out.append((r, record(s, r, compute=compute, grad=None if rnd.random() < 0.1 else grad, rss=rss,
                                  loss=loss)))
    return n, out


def verdict_keys(run: RunState) -> list[tuple]:
    return sorted((v.kind, tuple(v.ranks), v.step) for m in (analyses.straggler, analyses.grad_spike,
                                                              analyses.memory_growth, analyses.nonfinite)
                  for v in m.detect(run, T0 + 1e4, True))


@pytest.mark.parametrize("seed", range(0, 60, 3))
def test_same_verdicts_live_in_batches_and_offline_at_once(seed):
    n, records = scenario(seed)
    offline = RunState(run_id="x", world_size=n)
    for rank, rec in sorted(records, key=lambda x: (x[0], x[1].step)):  # the index's order: rank by rank
        offline.rank(rank).add_step(rec)
    live = RunState(run_id="x", world_size=n)
    rnd = random.Random(seed)
    for i, (rank, rec) in enumerate(records):  # arrival order, analysed between random batches
        live.rank(rank).add_step(rec)
        if rnd.random() < 0.05:
            for m in (analyses.straggler, analyses.grad_spike, analyses.memory_growth, analyses.nonfinite):
                m.detect(live, T0 + i, False)
    assert verdict_keys(live) == verdict_keys(offline)


def test_peer_medians_are_the_medians_of_the_others():
    """Exactly statistics.median of the others, for odd and even peers, ties
    and values in no order, from 2 values to a big job's."""
    rnd = random.Random(1)
    for n in [*range(2, 40), 255, 256, 257, 775]:
        values = [rnd.choice([rnd.random(), 0.5, 1.0, float(rnd.randint(0, 2))]) for _ in range(n)]
        got = common.peer_medians_of(np.array(values)).tolist()
        assert len(got) == n
        for i in range(n):
            assert got[i] == statistics.median(values[:i] + values[i + 1:])


def test_known_faults_found_on_the_right_rank_and_step():
    n = 6
    run = RunState(run_id="x", world_size=n)
    for s in range(60):
        for r in range(n):
            run.rank(r).add_step(record(s, r, compute=0.3 if r == 4 and s >= 10 else 0.05,
                                        grad=200.0 if (r, s) == (2, 30) else 1.0 + 0.01 * ((r + s) % 7),
                                        rss=(1 << 30) + (s * (20 << 20) if r == 1 else 0)))
    found = {v.kind: v for v in analyses.run_all(run, T0 + 100, True)}
    assert found["straggler"].ranks == [4] and 10 <= found["straggler"].step <= 22
    assert found["grad_spike"].ranks == [2] and found["grad_spike"].step == 30
    assert found["memory_growth"].ranks == [1]
    assert 15 << 20 < found["memory_growth"].evidence["ranks"]["1"]["bytes_per_step"] < 25 << 20


def test_weight_divergence_compares_parameters_not_buffers():
    names = ["param:0.weight", "param:0.bias", "buffer:1.running_mean"]
    run = RunState(run_id="x", world_size=3)
    for r in range(3):
        # BatchNorm statistics differ per replica between broadcasts: never a verdict.
        run.rank(r).add_fingerprint({"step": 9, "names": list(names), "norms": [1.0, 2.0, 0.5 + r]})
    assert analyses.weight_divergence.detect(run, T0, True) == []
    for r in range(3):
        run.rank(r).add_fingerprint({"step": 19, "names": list(names), "norms": [1.0 + (r == 2), 2.0, 0.5]})
    v = analyses.weight_divergence.detect(run, T0, True)[0]
    assert v.ranks == [2] and v.step == 19 and v.evidence["differing_tensors"] == ["param:0.weight"]
    # One shared name list for every rank and step.
    prints = [fp for s in run.ranks.values() for fp in s.fingerprints]
    assert len({id(fp["names"]) for fp in prints}) == 1


def test_each_ranks_names_list_gets_its_own_reading_and_a_replaced_one_is_not_kept():
    """The tensors compared are read once per rank's (and model's) names
    list. A rank that sends a new list (its job restarted, its model
    changed) gets the new list's reading, not its old one's (BatchNorm
    statistics compared as parameters: a false alarm), and the old list is
    freed: kept by id, every list of every attempt of a 100,000-rank job
    stayed alive. A rank's second model keeps its own."""
    import weakref

    from rankwatch.collector.analyses.weight_divergence import Tracker

    class Names(list):  # a list that can be weakly referenced
        pass

    tracker = Tracker()
    params_only = Names(["param:0.weight", "param:0.bias"])
    with_buffer = Names(["param:0.weight", "buffer:1.running_mean"])
    assert tracker._values(0, {"names": params_only, "norms": [1.0, 0.5]}) == ((1.0, 0.5), None)
    assert tracker._values(0, {"names": params_only, "norms": [1.0, 0.7]}) == ((1.0, 0.7), None)
    assert tracker._values(0, {"names": with_buffer, "norms": [1.0, 0.5], "model": 1}) == ((1.0,), None)
    old = weakref.ref(params_only)
    del params_only
    assert tracker._values(0, {"names": with_buffer, "norms": [1.0, 0.5]}) == ((1.0,), None)
    assert old() is None  # replaced: no longer kept
    assert tracker._values(0, {"names": with_buffer, "norms": [2.0, 0.5], "model": 1}) == ((2.0,), None)
    assert tracker._values(1, {"names": Names(["param:0.weight"]), "norms": [3.0]}) == ((3.0,), None)
    assert len(tracker._selection) == 3  # (rank 0, model 0), (rank 0, model 1), rank 1


def test_weight_divergence_waits_for_a_majority_when_the_reference_rank_skipped_a_step():
    """3 ranks, rank 1 perturbed. Rank 0 (busy) sampled out one fingerprint
    step: ranks 1 and 2 alone tie, and neither is the reference. That step
    decides nothing (it blamed rank 2); the next step with a majority names rank 1."""
    names = ["param:0.weight", "param:0.bias"]
    run = RunState(run_id="x", world_size=3)
    run.rank(1).add_fingerprint({"step": 7, "names": list(names), "norms": [2.0, 2.0]})
    run.rank(2).add_fingerprint({"step": 7, "names": list(names), "norms": [1.0, 2.0]})
    for r in range(3):
        run.rank(r).add_fingerprint({"step": 15, "names": list(names), "norms": [1.0 + (r == 1), 2.0]})
    v = analyses.weight_divergence.detect(run, T0, True)[0]
    assert v.ranks == [1] and v.step == 15


def test_state_is_bounded_however_long_the_run():
    """8 ranks: the state after 10,000 steps weighs what it weighs after 2,000
    (every window, 256 steps at most, is full by then: what grows with the
    run would show five times over)."""
    n = 8
    run = RunState(run_id="x", world_size=n)
    names = [f"param:layer{i}.weight" for i in range(150)]

    def feed(start: int, stop: int) -> None:
        for s in range(start, stop):
            for r in range(n):
                state = run.rank(r)
                state.add_step(record(s, r, grad=1.0 + 0.001 * (s % 13)))
                if s % 7 == 0:
                    state.add_event(wire.Event(kind="overflow_skipped", at=T0 + s, step=s))
                if s % 100 == 99:
                    state.add_fingerprint({"step": s, "names": list(names), "norms": [1.0] * 150})
                state.marks[s] = {"0": s}
            if s % 50 == 0:
                common.settle(run)

    tracemalloc.start()
    feed(0, 2_000)
    common.settle(run)
    at_2k = tracemalloc.get_traced_memory()[0]
    feed(2_000, 10_000)
    common.settle(run)
    at_10k = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert at_10k - at_2k < 0.1 * at_2k + 200_000, (at_2k, at_10k)
    for state in run.ranks.values():
        assert len(state.steps) <= step_window(n) and len(state.marks) <= 64
        assert len(state.events) <= 2 * 256 and len(state.fingerprints) <= 2
    assert len(run.trackers["_sealer"].pending) <= common.SEAL_LAG and len(run.durations) <= 512


def _collector(**cfg) -> Collector:
    return Collector(config=Config(**cfg))


def test_announced_verdict_is_never_retracted():
    c = _collector()
    n = 2
    for s in range(0, 40, 4):
        for r in range(n):
            recs = [record(k, r, rss=(1 << 30) + (k * (20 << 20) if r == 1 and k < 25 else 0)) for k in range(s, s + 4)]
            c.ingest_heartbeat(heartbeat("leak", r, n, s + 4, recs, T0 + s), T0 + s)
        c.tick(T0 + s + 0.5)
    assert [v.kind for v in c.report("leak").verdicts] == ["memory_growth"]
    # Whatever a later pass says (here: the analysis' summary lost), the report keeps it.
    c.runs["leak"].trackers["memory_growth"].findings.clear()
    report = c.finish("leak")
    assert [(v.kind, v.ranks) for v in report.verdicts] == [("memory_growth", [1])]


def test_one_runs_failure_does_not_stop_another_runs_hang_watch(caplog, monkeypatch):
    c = _collector(hang_timeout=5.0)
    for run_id in ("bad", "good"):
        for r in range(2):
            c.ingest_heartbeat(heartbeat(run_id, r, 2, 3, [record(k, r) for k in range(3)], T0), T0)
    original = common.settle

    def broken(run, final=False):
        if run.run_id == "bad":
            raise RuntimeError("corrupt summary")
        return original(run, final)

    monkeypatch.setattr("rankwatch.collector.service.settle", broken)
    monkeypatch.setattr(analyses, "run_all", lambda run, now, final: (_ for _ in ()).throw(RuntimeError("x"))
                        if run.run_id == "bad" else [])
    with caplog.at_level(logging.ERROR, logger="rankwatch.collector"):
        for i in range(12):
            c.ingest_heartbeat(heartbeat("bad", 0, 2, 3 + i, [record(3 + i, 0)], T0 + i), T0 + i)
            c.tick(T0 + i + 0.6)
    assert [i.kind for i in c.runs["good"].incidents] == ["hang"]
    failures = [r for r in caplog.records if "bad" in r.getMessage()]
    assert 1 <= len(failures) <= 2, "logged once per kind of failure"


def test_the_analyses_pass_under_the_ingest_lock_leaves_what_arrived_meanwhile_for_the_next_pass(monkeypatch):
    """The collector settles the summaries outside its ingest lock, then the
    analyses read them under it. What arrives in between (a 100,000-rank
    job's reports during a seconds-long settle) is taken in by the next pass:
    settled by the first analysis under the lock, it sealed steps while every
    report waited (up to 6.6 s at 100,000 ranks). A final pass settles all."""
    c = _collector(hang_timeout=60.0)
    for r in range(2):
        c.ingest_heartbeat(heartbeat("mid", r, 2, 3, [record(k, r) for k in range(3)], T0), T0)
    run = c.runs["mid"]
    first = analyses.ANALYSES[0]
    real = first.detect
    arrived = []

    def meanwhile(run_, now, final):
        if not arrived:  # a report taken in while the pass waited for the lock
            arrived.append(c.ingest_heartbeat(heartbeat("mid", 0, 2, 4, [record(3, 0)], T0 + 1), T0 + 1))
        return real(run_, now, final)

    monkeypatch.setattr(first, "detect", meanwhile)
    c.tick(T0 + 1.5)
    assert arrived and len(run.feed) == 1  # left for the next pass, not settled under the lock
    assert not run.settle_deferred
    monkeypatch.setattr(first, "detect", real)
    c._runtime("mid").analysed_at = 0.0
    c.tick(T0 + 3.0)
    assert len(run.feed) == 0
    c.stop()


def test_late_heartbeats_do_not_reset_the_stall_clock():
    """A heartbeat that arrives late (queued behind a slow collector) carries
    old progress: the incident still opens hang-timeout after the last
    progress the agents report."""
    c = _collector(hang_timeout=10.0)
    n = 4
    for r in range(n):  # every rank steps until T0+20, heartbeats on time
        c.ingest_heartbeat(heartbeat("late", r, n, 20, [], T0 + 20, last_progress_at=T0 + 20), T0 + 20.01)
    for r in range(n):  # a heartbeat built at T0+21 with a new step (progress at T0+20.5), delivered 15 s late
        c.ingest_heartbeat(heartbeat("late", r, n, 21, [], T0 + 21, last_progress_at=T0 + 20.5), T0 + 36)
    c.tick(T0 + 31.0)
    assert [i.kind for i in c.runs["late"].incidents] == ["hang"]
    incident = c.runs["late"].incidents[0]
    assert incident.last_progress_at == pytest.approx(T0 + 20.51, abs=0.05)


def test_metrics_render_per_run_without_the_ingest_lock():
    c = _collector()
    metrics = CollectorMetrics(c)
    for run_id in ("a", "b"):
        for r in range(3):
            c.ingest_heartbeat(heartbeat(run_id, r, 3, 5, [record(k, r) for k in range(5)], T0), T0)
    c.runs["b"].ranks[1].enqueued = None  # a run whose state cannot be rendered
    done = threading.Event()
    text: list[str] = []

    def scrape():
        text.append(metrics.render()[0].decode())
        done.set()

    with c._lock:  # ingest (or a slow tick) holds the lock: the scrape does not wait for it
        threading.Thread(target=scrape, daemon=True).start()
        assert done.wait(10)
    body = text[0]
    assert 'rankwatch_step{run="a",node="node0",rank="2",local_rank="2"} 5.0' in body
    assert 'run="b"' not in body
    assert "rankwatch_ingest_latency_seconds_count" in body


def test_one_tick_costs_the_same_after_a_long_run():
    """The tick's analysis work per new step does not grow with the steps seen.
    Python's cyclic garbage collector is kept out of the timed ticks: a full
    collection scans every object of the test process (torch's included,
    ~0.2 s), and where it lands depends on every allocation before it, not on
    the analyses' work."""
    import gc

    n = 16
    c = _collector()

    def run_steps(start: int, count: int) -> float:
        spent = 0.0
        gc.collect()
        gc.disable()
        try:
            for s in range(start, start + count, 10):
                for r in range(n):
                    c.ingest_heartbeat(heartbeat("long", r, n, s + 10, [record(k, r) for k in range(s, s + 10)],
                                                 T0 + s), T0 + s)
                began = time.thread_time()  # the tick runs here; the store's writer thread is not its cost
                c.tick(T0 + s + 5)  # analyses due every tick
                spent += time.thread_time() - began
        finally:
            gc.enable()
        return spent

    run_steps(0, 200)
    early = run_steps(200, 300)
    run_steps(500, 3000)
    late = run_steps(3500, 300)
    assert late < 3 * early + 0.1, (early, late)


def test_hang_named_within_timeout_plus_5s_with_late_heartbeats_at_1000_ranks():
    """1,000 ranks, many heartbeats delivered 8 s late (a collector falling
    behind): the hang verdict still comes hang-timeout + evidence window after
    the last progress, never later than hang-timeout + 5 s. (Agents' clocks
    are put on the collector's by each rank's smallest observed delay: a rank
    whose every heartbeat is late looks like a rank whose clock is behind.)"""
    n, timeout = 1000, 10.0
    c = _collector(hang_timeout=timeout, evidence_window=3.0)
    last_progress = T0 + 20.0
    late: list[tuple[float, wire.Heartbeat]] = []
    verdict_at = None
    t = T0
    while t < T0 + 60 and verdict_at is None:
        for r in range(n):
            if int(t * 2) % 2:  # one heartbeat a second per rank
                continue
            step = int(min(t, last_progress) - T0)
            hb = heartbeat("big", r, n, step, [], t, last_progress_at=min(t, last_progress))
            if r % 5 == 0 and int(t) % 3:  # two heartbeats in three of these ranks, 8 s late
                late.append((t + 8.0, hb))
            else:
                c.ingest_heartbeat(hb, t)
        for due, hb in [x for x in late if x[0] <= t]:
            late.remove((due, hb))
            c.ingest_heartbeat(hb, t)
        c.tick(t)
        verdicts = [v for v in c.status()["runs"]["big"]["verdicts"] if v["kind"] == "hang"]
        if verdicts:
            verdict_at = t
        t += 0.5
    assert verdict_at is not None, "no hang verdict"
    assert verdict_at - last_progress <= timeout + 5.0, verdict_at - last_progress


def test_first_event_of_each_kind_outlives_the_event_window():
    """crash, oom and the report's notes read a rank's first exception / oom /
    unused-parameter event, however many events came after it."""
    run = RunState(run_id="x", world_size=1)
    state = run.rank(0)
    state.add_event(wire.Event(kind="unused_parameters", at=T0, step=0, details={"parameters": ["head.bias"]}))
    state.add_event(wire.Event(kind="exception", at=T0 + 1, step=1, details={"type": "RuntimeError"}))
    for i in range(20_000):
        state.add_event(wire.Event(kind="overflow_skipped", at=T0 + 2 + i, step=2))
    assert len(state.events) <= 512
    assert state.exception_event().details["type"] == "RuntimeError"
    assert [e.kind for e in state.events][:2] == ["unused_parameters", "exception"]
    found = analyses.nonfinite.detect(run, T0, True)
    assert found and found[0].evidence["repeated_skips"]["0"]["consecutive_skipped_steps"] == 20_000


@pytest.mark.parametrize("slow_from,pattern,expected", [
    (0, "always", 0),          # slow from the first step: labelled 0, not the step its window filled
    (30, "always", 30),
    (0, "two_of_three", 0),    # under the persistence until step 40, then always: still slow since 0
])
def test_a_straggler_is_labelled_with_the_step_its_slowness_began(slow_from, pattern, expected):
    """issue 24 part 5: a straggler slow from step 0 was labelled step 41."""
    n = 4
    run = RunState(run_id="x", world_size=n)
    for s in range(80):
        for r in range(n):
            slow = r == 2 and s >= slow_from and (pattern == "always" or s >= 40 or s % 3 != 2)
            run.rank(r).add_step(record(s, r, compute=0.15 if slow else 0.05 + 0.001 * ((r + s) % 5)))
    found = [v for v in analyses.run_all(run, T0 + 100, True) if v.kind == "straggler"]
    assert [(v.ranks, v.step) for v in found] == [([2], expected)]
    from datetime import datetime
    first = datetime.fromisoformat(found[0].first_seen_at.replace("Z", "+00:00")).timestamp()
    assert first == pytest.approx(T0 + expected)


def test_profile_difference_matches_operations_across_ranks():
    """torch's Python tracer names built-ins with their object's address,
    which differs between processes: the healthy rank's own wait was left
    unmatched and came out as the slow rank's largest extra time."""
    from rankwatch.collector.analyses.straggler import profile_difference
    from rankwatch.collector.evidence import RankEvidence

    run = RunState(run_id="x", world_size=2)
    # As seen on a 3-rank FSDP2 job: the slow rank waits too, the healthy one waits more.
    ops = {0: [("<built-in method wait of pybind11_builtins.pybind11_detail_function_record_v1_x object at 0x7f00aa>", 800.0),
               ("<built-in function sleep>", 0.0)],
           1: [("<built-in method wait of pybind11_builtins.pybind11_detail_function_record_v1_x object at 0x7f11bb>", 430.0),
               ("<built-in function sleep>", 310.0)]}
    for rank, rows in ops.items():
        ev = RankEvidence(rank=rank, reason="profile", created_at=T0 + rank, source="bundle", bundle_path=f"b{rank}",
                          profile={"operations": [{"name": n, "self_ms": ms} for n, ms in rows]})
        run.rank(rank).evidence[f"e{rank}"] = ev
    diff = profile_difference(run, 1)
    assert diff["operations"][0]["name"] == "<built-in function sleep>", diff["operations"]
    assert diff["operations"][0]["extra_ms"] == 310.0


def _rss_run(rss_of, steps: int = 300, n: int = 2) -> RunState:
    run = RunState(run_id="rss", world_size=n)
    for s in range(steps):
        for r in range(n):
            run.rank(r).add_step(record(s, r, rss=int(rss_of(r, s))))
    return run


def _leaks(run: RunState) -> list:
    return [v for v in analyses.run_all(run, T0 + 1000, True) if v.kind == "memory_growth"]


def test_growth_that_stops_after_warm_up_is_not_a_leak():
    """zoo hf_t5_trainer seed 2 (Seq2SeqTrainer, dynamic padding): rank 1
    grew 1.2 MiB a step from the first watched step to step 40 (9 % of its
    460 MiB), rank 0 0.15 MiB, then both stayed flat for 260 steps. It was
    named a leak at step 40, and the verdict stayed."""
    def rss(r, s):
        per_step = (1.2 if r == 1 else 0.15) * (1 << 20)
        return (460 << 20) + per_step * min(max(s - 4, 0), 36)

    assert _leaks(_rss_run(rss)) == []


@pytest.mark.parametrize("per_step_mib,start,named_by", [
    (16, 0, 25),    # faultbench's leak, from start-up: adds a quarter of a 400 MiB process in 7 steps
    (2, 0, 70),     # a slow leak from start-up: named once it outlasts the window (60 steps)
    (2, 100, 140),  # a slow leak after a flat stretch: as before (most of the window's steps grow)
])
def test_a_leak_is_still_named_from_start_up_or_mid_run(per_step_mib, start, named_by):
    def rss(r, s):
        return (400 << 20) + (per_step_mib << 20) * max(0, s - start) * (r == 1)

    (v,) = _leaks(_rss_run(rss, steps=named_by))
    assert v.ranks == [1] and abs(v.step - max(start, 5)) <= 1, (v.step, v.summary)


def test_a_slow_leak_from_start_up_waits_for_the_window():
    """2 MiB a step from start-up on 400 MiB: at step 50 it has added 90 MiB,
    less than a quarter, and has not outlasted the window: not yet named."""
    assert _leaks(_rss_run(lambda r, s: (400 << 20) + (2 << 20) * s * (r == 1), steps=50)) == []


def test_memory_windows_of_many_ranks_hold_each_ranks_last_points():
    """The leak check's per-rank windows are numpy rows that grow with the
    ranks seen (a collector of 10,000 ranks): each rank's points, its count
    of growing steps, the value before its window and whether it slid are
    what its own history says, for ranks well past the first allocation
    and ranks that joined late."""
    import numpy as np

    from rankwatch.collector.analyses.memory_growth import WINDOW, Window

    rng = np.random.default_rng(7)
    window, history = Window(), {}
    for step in range(WINDOW + 30):
        ranks = [r for r in range(300) if step >= r % 50]  # some ranks join late
        values = rng.integers(0, 4, len(ranks)).astype(float) * (1 << 20)
        rows = window.rows_of(ranks, {r: -1.0 for r in ranks if r % 2})
        window.add(np.array(rows), step, values, np.full(len(ranks), 1000.0 + step))
        for r, v in zip(ranks, values):
            history.setdefault(r, []).append((step, float(v), 1000.0 + step))
    for rank, points in history.items():
        kept = points[-WINDOW:]
        series = window.get(rank)
        assert series.points == kept, rank
        assert series.ups == sum(b[1] > a[1] for a, b in zip(kept, kept[1:])), rank
        assert series.slid == (len(points) > WINDOW), rank
        expected_before = points[-WINDOW - 1][1] if len(points) > WINDOW else (-1.0 if rank % 2 else None)
        assert series.before == expected_before, rank
    growth = window.growth_per_step()
    assert [round(float(g), 3) for g in growth] == [round(window.get(r).growth_per_step(), 3) for r in window.ranks]


def test_memory_windows_recover_from_a_grow_that_failed(monkeypatch):
    """Rows given to new ranks whose arrays then failed to grow (out of
    memory) are grown into at the next step: the window keeps working, it
    does not index past its arrays for ever."""
    import numpy as np

    from rankwatch.collector.analyses.memory_growth import Window

    window = Window()
    first = list(range(64))
    window.add(window.rows_of(first, {}), 0, np.ones(64), np.full(64, 1000.0))
    grow = Window._grow

    def out_of_memory(self, size):
        raise MemoryError

    monkeypatch.setattr(Window, "_grow", out_of_memory)
    more = list(range(200))
    start_up = {rank: 7.0 for rank in more[64:]}  # the new ranks' values before their windows
    with pytest.raises(MemoryError):
        window.rows_of(more, start_up)
    assert start_up == {}  # taken (then lost with the grow), not left behind for ever
    monkeypatch.setattr(Window, "_grow", grow)
    for step in (1, 2):
        rows = window.rows_of(more, {})
        window.add(rows, step, np.full(200, float(step)), np.full(200, 1000.0 + step))
    assert window.get(150).points == [(1, 1.0, 1001.0), (2, 2.0, 1002.0)]
    assert window.get(5).points == [(0, 1.0, 1000.0), (1, 1.0, 1001.0), (2, 2.0, 1002.0)]


def test_a_hang_during_a_collector_outage_is_named_after_it():
    """The collector stops answering for 60 s (paused, or its node lost)
    while the job runs on and hangs 20 s into the outage. On resuming, it
    sees 60 s without progress before it reads the beats the relays held,
    whose progress (dated by the agents, during the outage) moves the stall
    clock. One incident, of the hang as it is, named on the right rank
    within hang-timeout + 5 s of the resumption. (It was never named: an
    incident opened on the stale numbers, ended by the backlog, and a stall
    whose last progress came before an incident opened was taken for that
    ended incident's.)"""
    n, timeout, frozen = 16, 10.0, 3
    c = _collector(hang_timeout=timeout, evidence_window=3.0)
    outage, resume, hung_at = T0 + 20.0, T0 + 80.0, T0 + 40.0

    def beat(r: int, t: float) -> wire.Heartbeat:
        progress = min(t, hung_at)  # every rank stops there: rank 3 frozen, the others wait for it
        hb = heartbeat("outage", r, n, int(progress - T0), [], t, last_progress_at=progress)
        if t >= hung_at and r != frozen:
            hb.collectives_enqueued = {"0": int(hung_at - T0) + 1}  # inside the next collective
        return hb

    t, verdict_at = T0, None
    while t < resume + 40 and verdict_at is None:
        if outage <= t < resume:
            t += 0.5
            continue  # nothing taken in, no tick
        if t == resume:
            c.tick(t)  # the collector's loop runs before the first request is read
        for r in range(n):
            c.ingest_heartbeat(beat(r, t), t)
        c.tick(t)
        hangs = [v for v in c.status()["runs"]["outage"]["verdicts"] if v["kind"] == "hang"]
        if hangs:
            assert t >= resume and hangs[0]["ranks"] == [frozen], hangs[0]
            verdict_at = t
        t += 0.5
    assert verdict_at is not None, "the hang was never named"
    assert verdict_at - resume <= timeout + 5.0, verdict_at - resume
    assert [i.kind for i in c.runs["outage"].incidents] == ["hang"], c.runs["outage"].incidents


def test_a_backlog_delivered_node_by_node_names_the_hang_once_all_of_it_is_in():
    """The relays cannot reach the collector for 40 s (it runs on) while the
    job hangs 20 s into the cut. The collector opens an incident on what it
    has (no progress since the cut). The relays then come back one node at
    a time, 3 s apart, each with beats whose progress was made before that
    incident opened: the stall it was ended, and the next one is judged only
    once every rank's held beats are in. Judged sooner, the ranks of the node
    not yet back would look behind in the collective and be blamed. Nor is
    the job ended during the cut: every rank silent at once, with nothing of
    the job heard, is lost contact, not ranks frozen (collector/stuck.py)."""
    n, timeout, frozen = 16, 10.0, 3
    c = _collector(hang_timeout=timeout, evidence_window=3.0)
    cut, back, hung_at = T0 + 20.0, T0 + 60.0, T0 + 40.0

    def beat(r: int, t: float) -> wire.Heartbeat:
        progress = min(t, hung_at)
        hb = heartbeat("backlog", r, n, int(progress - T0), [], t, last_progress_at=progress)
        if t >= hung_at and r != frozen:
            hb.collectives_enqueued = {"0": int(hung_at - T0) + 1}
        return hb

    t, verdict_at = T0, None
    while t < back + 40 and verdict_at is None:
        for r in range(n):
            node_back = back + 3.0 * (r // 8)  # node 0 at once, node 1 3 s later
            if t < cut or t >= node_back:
                c.ingest_heartbeat(beat(r, t), t)
        c.tick(t)
        hangs = [v for v in c.status()["runs"]["backlog"]["verdicts"] if v["kind"] == "hang"]
        if hangs and t >= back:
            assert hangs[0]["ranks"] == [frozen], hangs[0]
            verdict_at = t
        t += 0.5
    assert verdict_at is not None, "the hang was never named"
    assert verdict_at - back <= timeout + 5.0, verdict_at - back
    assert c.runs["backlog"].aborted is None, c.runs["backlog"].aborted
    incidents = c.runs["backlog"].incidents
    assert len(incidents) == 2 and "ended_at" in incidents[0].details, [(i.id, i.details) for i in incidents]


def test_a_big_jobs_hang_judged_by_time_alone_is_announced_without_new_data():
    """300 ranks (past hang.EVIDENCE_FROM_EVERY_RANK): a third of them send
    nothing after the stall began, so their numbers are not fresh and the
    diagnosis waits hang.STALE_WAIT_S, then judges on what is known. Nothing
    new arrives meanwhile to start an analysis pass: the verdict must still
    be announced once the diagnosis has it."""
    from rankwatch.collector.analyses import hang

    n, timeout, frozen = 300, 10.0, 7
    c = _collector(hang_timeout=timeout, evidence_window=3.0)
    hung_at = T0 + 20.0
    t, verdict_at = T0, None
    while t < hung_at + timeout + hang.STALE_WAIT_S + 15 and verdict_at is None:
        if t < hung_at + 2:
            for r in range(n):
                if t >= hung_at and r % 3 == 0:
                    continue  # a third of the ranks: nothing after the stall began
                progress = min(t, hung_at)
                hb = heartbeat("quiet", r, n, int(progress - T0), [], t, last_progress_at=progress)
                if t >= hung_at and r != frozen:
                    hb.collectives_enqueued = {"0": int(hung_at - T0) + 1}
                c.ingest_heartbeat(hb, t)
        c.tick(t)
        if any(v["kind"] == "hang" for v in c.status()["runs"]["quiet"]["verdicts"]):
            verdict_at = t
        t += 0.5
    assert verdict_at is not None, "the hang was never announced"
    assert verdict_at - hung_at <= timeout + hang.STALE_WAIT_S + 5.0, verdict_at - hung_at


def test_the_records_ingest_picks_as_non_finite_are_those_whatever_else_is_missing():
    """nonfinite reads only the records ingest picked (RankState.add_step):
    a missing loss is not a non-finite one, a huge finite or integer loss is
    not either, and nan, inf and non-finite gradients are; each picked
    record reaches the check once, when settle takes it, and not when late."""

    def rec(step, **fields):
        return wire.StepRecord(step=step, started_at=T0 + step, ended_at=T0 + step + 1, forwards=1, **fields)

    usual = [rec(1, loss=1.0), rec(1), rec(1, loss=1e308), rec(1, loss=0)]
    assert not any(r.nonfinite() for r in usual)
    bad = [rec(1, loss=float("nan")), rec(1, loss=float("-inf")), rec(1, loss=2.0, nonfinite_grads=3),
           rec(1, nonfinite_grads=1)]
    assert all(r.nonfinite() for r in bad)

    run = RunState(run_id="nf", world_size=8)
    seen = []
    nonfinite = common.tracker(run, "nonfinite")
    real = nonfinite.on_nonfinite
    nonfinite.on_nonfinite = lambda run, records: (seen.extend(records), real(run, records))
    for rank, record in enumerate(usual + bad):
        run.rank(rank).add_step(record)
    for rank in range(8):
        for step in (2, 3, 4, 5):
            run.rank(rank).add_step(rec(step, loss=1.0))
    common.settle(run)
    assert seen == [(4 + i, r) for i, r in enumerate(bad)]
    assert set(analyses.nonfinite._bad_steps(run)[1]) == {4, 5, 6, 7}
    assert run.trackers["_sealer"].sealed_upto >= 1
    run.rank(0).steps.clear()  # a late non-finite record of a sealed step (from a bundle): not taken
    run.rank(0).add_step(rec(1, loss=float("nan")))
    common.settle(run)
    assert len(seen) == 4 and run.trackers["_sealer"].late == 1


class _Rec:
    def __init__(self, step: int) -> None:
        self.step = step


def test_the_records_taken_in_arrays_are_those_taken_one_by_one():
    """Settle takes a chunk of records with array operations when none is late
    or older than its rank's newest: pending steps (their ranks in arrival
    order), frontiers, late counts and what is handed on are the same as one
    by one, for clean feeds (of one step or many) and messy ones (late, out
    of order, re-sent)."""
    rnd = random.Random(3)
    fast_paths = 0
    for trial in range(300):
        fast, slow = common._Sealer(), common._Sealer()
        messy = trial % 3 == 0
        sealed = rnd.choice([-1, 5])
        ranks = rnd.sample(range(1000), rnd.choice([1, 8, 64, 300]))
        frontier = {r: rnd.randint(sealed, sealed + 3) for r in ranks if rnd.random() < 0.5}
        held = _Rec(sealed + 4)
        for sealer in (fast, slow):
            sealer.sealed_upto = sealed
            sealer.frontier.update(frontier)
            sealer.pending[sealed + 4] = {ranks[0]: held}
        feed = []
        for _ in range(rnd.choice([10, 63, 64, 65, 700, common.YIELD_EVERY + 300])):
            rank = rnd.choice(ranks)
            low = sealed - 2 if messy else max(sealed + 1, frontier.get(rank, -1))
            one_step = trial % 3 == 1  # a big job's usual chunk: every record of one step
            feed.append((rank, _Rec(sealed + 4 if one_step else rnd.randint(low, low + 6))))
        got = common._take_records(fast, feed)
        want: list = []
        common._take_one_by_one(slow, feed, want)
        assert got == want
        assert [(s, list(d.items())) for s, d in sorted(fast.pending.items())] == \
            [(s, list(d.items())) for s, d in sorted(slow.pending.items())]
        assert fast.frontier == slow.frontier and fast.late == slow.late
        fast_paths += not messy and len(feed) >= common.TAKE_IN_ARRAYS
    assert fast_paths > 100


def test_a_frozen_rank_whose_own_bundle_comes_before_its_supervisors_is_still_named_frozen(tmp_path):
    """Rank 1 freezes in C code holding the GIL (its heartbeat thread stops
    too). The supervisor's stack signal ends the C call: the rank goes on,
    beats, and its agent answers the dump request before the supervisor's
    own bundle (the outside view, taken while it was frozen) arrives, as a
    loaded machine orders them now and then. The incident waits for that
    view: the hang is named on rank 1, frozen. Closed on the agent's bundle
    alone, the rank looked merely slow and the stall "ended by itself"; the
    job went on with no verdict (CI, 2026-11-28)."""
    from rankwatch.bundles import pack

    n, timeout, frozen = 3, 8.0, 1
    c = Collector(config=Config(hang_timeout=timeout, evidence_window=5.0), data_dir=tmp_path)
    run_id = "frozen"
    workers = [wire.WorkerStatus(local_rank=r, rank=r, pid=1000 + r) for r in range(n)]

    def node(t: float) -> wire.NodeHeartbeat:
        return wire.NodeHeartbeat(run_id=run_id, host="node0", node_rank=0, world_size=n, sent_at=t, workers=workers)

    def bundle(r: int, t: float, source: str, members: dict) -> bytes:
        manifest = wire.BundleManifest(run_id=run_id, rank=r, local_rank=r, world_size=n, host="node0",
                                       pid=1000 + r, step=6, created_at=t, reason="hang", incident="hang-1",
                                       source=source)
        return pack(manifest, members)

    hung_at, t, opened_at = T0 + 6.0, T0, None
    while opened_at is None and t < hung_at + 3 * timeout:
        c.ingest_node(node(t), t)
        for r in range(n):
            if r == frozen and t >= hung_at:
                continue  # frozen: its heartbeat thread too
            hb = heartbeat(run_id, r, n, int(min(t, hung_at) - T0), [], t, last_progress_at=min(t, hung_at))
            if t >= hung_at:
                hb.collectives_enqueued = {"0": int(hung_at - T0) + 1}  # the peers wait in the next collective
            c.ingest_heartbeat(hb, t)
        c.tick(t)
        if c.runs[run_id].incidents:
            opened_at = t
        t += 0.5
    assert opened_at is not None, "no incident opened"
    capture = [cmd for cmds in c._runtime(run_id).node_commands.values() for cmd in cmds if cmd.kind == "capture"]
    assert capture and capture[0].details["stale"] == [frozen], capture

    # The stack signal ended the C call: rank 1 beats again, with progress,
    # and every agent's bundle is in before the supervisor's.
    resumed = opened_at + 0.5
    for r in range(n):
        c.ingest_heartbeat(heartbeat(run_id, r, n, int(hung_at - T0) + 1, [], resumed, last_progress_at=resumed),
                           resumed)
        main = {"main": True, "owns_gil": r == frozen,
                "frames": [{"file": "train.py", "line": 40 if r == frozen else 31, "name": "<module>", "code": ""}]}
        c.ingest_bundle(bundle(r, resumed, "agent", {"stacks.json": [main]}), now=resumed)
    c.tick(resumed)
    outside = ('Current thread 0x00007f0000000001 (most recent call first):\n'
               '  File "train.py", line 22 in native_update\n'
               '  File "train.py", line 33 in <module>\n')
    c.ingest_bundle(bundle(frozen, resumed + 1.0, "supervisor", {"faulthandler.txt": outside}), now=resumed + 1.0)
    t = resumed + 1.0
    while t < resumed + 10.0:
        c.ingest_node(node(t), t)
        c.tick(t)
        t += 0.5
    run = c.runs[run_id]
    hangs = [v for v in c.status()["runs"][run_id]["verdicts"] if v["kind"] == "hang"]
    assert [i.details.get("ended_at") for i in run.incidents] == [None], [i.details for i in run.incidents]
    assert len(hangs) == 1 and hangs[0]["ranks"] == [frozen], hangs
    assert "frozen in its own code" in hangs[0]["summary"], hangs[0]["summary"]
    c.stop()


def test_rank_rows_give_each_rank_one_row_in_first_seen_order():
    """`RankRows` against a dict: steps of distinct ranks in a new order each
    time, ranks joining late and far past the table's size, an empty step."""
    from rankwatch.collector.analyses.common import RankRows

    rng = random.Random(3)
    table, expected = RankRows(), {}
    for _ in range(60):
        ranks = rng.sample(range(5_000) if rng.random() < 0.9 else range(900_000, 999_999), rng.randint(0, 300))
        first_seen = [r for r in ranks if r not in expected]
        for r in first_seen:
            expected[r] = len(expected)
        rows, new = table.rows(ranks)
        assert rows.tolist() == [expected[r] for r in ranks]
        assert new == first_seen
        assert table.ranks == sorted(expected, key=expected.get) and len(table) == len(expected)
    assert table.get(999_999_999) is None and table.get(-1) is None
    with pytest.raises(ValueError):
        table.rows([3, -1])
    assert all(table.get(r) == row for r, row in expected.items())


def test_step_events_due_is_every_event_up_to_the_step_in_step_then_arrival_order():
    """`StepEvents.due` against the rule it keeps, on random adds and seals,
    with and without its per-rank bound pushing out a rank's oldest event
    (then no longer held: the bound bounds memory)."""
    from types import SimpleNamespace

    from rankwatch.collector.analyses.common import StepEvents

    for seed in range(200):
        rng = random.Random(seed)
        events, held, arrival = StepEvents(("k",)), [], 0
        events.PER_RANK = 512 if seed % 2 else 3  # half the seeds hit the bound: a rank's oldest arrival goes
        for op in range(150):
            if rng.random() < 0.7:
                rank, step = rng.randrange(6), rng.randrange(20)
                event = SimpleNamespace(kind="k", step=step, id=op)
                events.add(rank, event)
                arrival += 1
                mine = [e for e in held if e[2] == rank]
                if len(mine) >= events.PER_RANK:
                    held.remove(min(mine, key=lambda e: e[1]))
                held.append((step, arrival, rank, event))
                assert events.held() == len(held), (seed, op)  # what the bound drops is gone, not marked
            else:
                step = rng.randrange(25)
                expected = sorted((e for e in held if e[0] <= step), key=lambda e: (e[0], e[1]))
                held = [e for e in held if e[0] > step]
                got = events.due(step)
                assert [(r, e.id) for r, e in got] == [(r, e.id) for _, _, r, e in expected], (seed, op)
