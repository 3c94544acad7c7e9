"""What lets one collector watch 100,000 ranks, tested without the load:
the relays forward every k-th step record (and every unusual one) when the
collector asks; the cross-rank analyses judge sampled steps; a big job's
hang asks only its suspects for evidence and is named from the heartbeats'
numbers without waiting for bundles; the analyses that look for rare facts
(a crash, an exit, an OOM, a mismatch) no longer read every rank.

The bench (`bench/collector_load.py`, smoke-tested in test_scale_load.py)
measures the same code under load."""

from __future__ import annotations

import json
import time

import pytest

from rankwatch import wire
from rankwatch.collector import analyses, analysis_budget
from rankwatch.collector import service as service_mod
from rankwatch.collector import store as store_mod
from rankwatch.collector.analyses import collective_mismatch, grad_spike, hang
from rankwatch.collector.analysis_budget import AnalysisBudget
from rankwatch.collector.service import Collector, record_stride
from rankwatch.collector.state import RunState
from rankwatch.collector.store import Store
from rankwatch.config import Config
from rankwatch.node.relay import Relay, StepSampler

COLUMNS = list(wire.STEP_COLUMNS)


def _row(step: int, loss=2.0, grad_norm=1.5, nonfinite=0) -> list:
    return [step, 1000.0 + step, 1001.0 + step, 1, 0.8, 0.01, loss, grad_norm, nonfinite, 1, 1 << 30, None, None, None, None, None, None]


def _beat(rank: int, rows: list) -> dict:
    return {"version": 1, "identity": {"run_id": "big", "rank": rank, "local_rank": rank % 8, "world_size": 4096},
            "step": rows[-1][0] if rows else 0, "step_columns": COLUMNS, "step_rows": rows}


# -- the relay's sampling ------------------------------------------------------------------


def test_the_relay_forwards_every_kth_step_and_every_unusual_record():
    sampler = StepSampler()
    rows = [_row(s) for s in range(100, 116)]
    assert sampler.sample(0, _beat(0, rows))["step_rows"] == rows  # stride 1: everything
    sampler.stride = 8
    kept = sampler.sample(0, _beat(0, [_row(s) for s in range(116, 140)]))["step_rows"]
    assert [r[0] for r in kept] == [120, 128, 136]
    unusual = [_row(141, loss="NaN"), _row(142, nonfinite=3), _row(143, grad_norm=40.0), _row(145, grad_norm=1.6),
               _row(146, loss="Infinity"), _row(147, grad_norm=1.4)]
    kept = sampler.sample(0, _beat(0, unusual))["step_rows"]
    assert [r[0] for r in kept] == [141, 142, 143, 146]  # NaN, non-finite grads, a 27x norm, Inf; not 145, 147



def test_the_relay_forwards_every_kth_mark_and_fingerprint_the_same_on_every_rank():
    """Marks every 5 steps, fingerprints every 10 (steps 9, 19, ...) after a
    start-up one: at stride 8 every relay forwards the same 1 in 8 of each,
    every fingerprint with a non-finite norm, the start-up one, and the
    parameter names of a left-out fingerprint on the rank's next one."""
    names, later_names = ["w", "b"], ["w", "b", "extra"]

    def beats(rank: int, first: int, last: int) -> list[dict]:
        out = []
        for begin in range(first, last, 40):  # one beat: 40 steps' worth
            marks = [{"step": s, "seqs": {"0": 3 * s}} for s in range(begin, min(begin + 40, last)) if s % 5 == 0]
            prints = [{"step": s, "norms": [1.0, 2.0]} for s in range(begin, min(begin + 40, last)) if s % 10 == 9]
            out.append({**_beat(rank, []), "marks": marks, "fingerprints": prints})
        return out

    relays = {}
    for rank in (0, 1):  # two ranks on two nodes: two samplers
        sampler = relays[rank] = StepSampler()
        start = {"step": 0, "norms": [1.0, 0.5], "names": names + ["grad:w"], "at": "start"}
        sampler.stride = 8
        assert sampler.sample(rank, {**_beat(rank, []), "fingerprints": [start]})["fingerprints"] == [start]
        marks, prints = [], []
        for i, beat in enumerate(beats(rank, 1, 400)):
            if i == 1:
                beat["fingerprints"][0]["names"] = later_names  # step 49: names change, left out
            if i == 5:
                beat["fingerprints"][1]["norms"] = [1.0, "NaN"]  # step 219: forwarded whatever its step
            out = sampler.sample(rank, beat)
            marks += [m["step"] for m in out["marks"]]
            prints += [(fp["step"], fp.get("names")) for fp in out["fingerprints"]]
        relays[rank] = (marks, prints)
    assert relays[0] == relays[1]
    marks, prints = relays[0]
    assert marks == [5, 40, 80, 120, 160, 200, 240, 280, 320, 360]  # the first, then every 8th (5-step period)
    assert prints == [(9, None), (89, later_names), (169, None), (219, None), (249, None), (329, None)]
    sampler = StepSampler()
    sampler.stride = 8
    odd = {"step": 429, "norms": [1.0, 10**400]}  # past a float's range: forwarded, for the collector to judge
    first, usual = {"step": 409, "norms": [1.0, 2.0]}, {"step": 419, "norms": [1.0, 2.0]}
    assert sampler.sample(0, {**_beat(0, []), "fingerprints": [first, usual, odd]})["fingerprints"] == [first, odd]
    # Nothing left out: the beat itself goes on, not a copy of it (the sampler said nothing changed).
    whole = {**_beat(0, []), "fingerprints": [{"step": 509, "norms": [1.0]}], "marks": [{"step": 500, "seqs": {}}]}
    sampler.stride = 1
    assert sampler.sample(0, whole) is whole


def test_a_left_out_fingerprints_names_ride_on_the_next_print_of_the_same_model():
    sampler = StepSampler()
    sampler.stride = 8
    gen, disc = ["g.w"], ["d.w", "d.b"]
    first = [{"step": 9, "norms": [1.0], "names": gen}, {"step": 9, "norms": [1.0, 2.0], "names": disc, "model": 1}]
    assert len(sampler.sample(0, {**_beat(0, []), "fingerprints": first})["fingerprints"]) == 2
    renamed = ["d.w2", "d.b"]
    left_out = [{"step": 19, "norms": [1.0]}, {"step": 19, "norms": [1.0, 2.0], "names": renamed, "model": 1}]
    assert sampler.sample(0, {**_beat(0, []), "fingerprints": left_out})["fingerprints"] == []
    later = [{"step": s, "norms": [1.0]} for s in range(29, 100, 10)]
    later += [{"step": s, "norms": [1.0, 2.0], "model": 1} for s in range(29, 100, 10)]
    out = sampler.sample(0, {**_beat(0, []), "fingerprints": later})["fingerprints"]
    assert [(fp["step"], fp.get("model", 0), fp.get("names")) for fp in out] == [(89, 0, None), (89, 1, renamed)]  # 1 in 8 periods


def test_a_relay_takes_the_stride_the_collector_asks_for():
    relay = Relay(lambda *a, **k: {}, "big")
    relay._take_reply({"commands": [], "ranks": {}, "version": wire.WIRE_VERSION, "interval": 10.0, "step_stride": 8})
    assert relay.sampler.stride == 8 and relay.interval == 10.0
    relay._take_reply({"commands": [], "version": wire.WIRE_VERSION})
    assert relay.sampler.stride == 1
    relay._take_reply({"commands": [], "version": wire.WIRE_VERSION, "step_stride": 100_000})  # out of range
    assert relay.sampler.stride == 1


def test_the_stride_keeps_the_collector_near_its_record_budget():
    assert record_stride(64, 0.01) is None  # small jobs: every step, however fast
    assert record_stride(100_000, None) is None  # step time not known yet
    assert record_stride(10_000, 1.0) is None  # 10,000 records a second
    assert record_stride(100_000, 1.0) == 8  # 12,500 a second
    assert record_stride(50_000, 1.0) == 4
    assert record_stride(100_000, 10.0) is None
    assert record_stride(100_000, 0.001) == 64  # bounded


def test_the_collector_asks_a_big_fast_job_for_a_stride():
    c = Collector(Config(hang_timeout=20))
    run = c._run("big", 100_000)
    run.typical_step_s = 1.0
    node = wire.NodeHeartbeat(run_id="big", host="n0", node_rank=0, world_size=100_000, sent_at=time.time())
    reply = c.ingest_node_report(wire.NodeReport(node=node, heartbeats=[]))
    assert reply.step_stride == 8 and reply.interval == 10.0
    assert json.loads(json.dumps(wire.to_dict(reply)))["step_stride"] == 8
    c.stop()


def test_the_analysis_budget_coarsens_the_stride_while_over_its_share_and_relaxes_it_after():
    budget = AnalysisBudget(share=0.1, window_s=30.0)
    assert budget.review(0.0) == 1
    budget.spent(2.0)
    assert budget.review(20.0) == 1  # judged only once a window has passed
    budget.spent(2.0)
    assert budget.review(30.0) == 2  # 4 s of CPU in 30 s: 0.13 of a core, over 0.1
    budget.spent(1.5)
    assert budget.review(60.0) == 2  # 0.05: under the share, not under a quarter of it
    assert budget.review(90.0) == 1  # nothing: finer again
    for window in range(10):
        budget.spent(30.0)
        budget.review(120.0 + 30.0 * window)
    assert budget.scale == analysis_budget.MAX_SCALE
    assert record_stride(100_000, 1.0, 4) == 32 and record_stride(100_000, 1.0, 64) == 64  # bounded
    assert record_stride(2_000, 1.0, 4) == 4  # a costly small job is sampled too
    assert record_stride(64, 0.01, 1) is None


def test_a_collector_whose_ticks_cost_more_than_their_share_asks_for_a_coarser_stride(monkeypatch):
    """The tick thread's CPU on a run is what the budget reads: ticks that
    cost half a core make the relays' stride double, cheap ones undo it."""
    c = Collector(Config(hang_timeout=20))
    run = c._run("big", 100_000)
    run.typical_step_s = 1.0
    cost = {"per_tick": 0.5, "clock": 0.0}

    def thread_time() -> float:  # each tick's two reads are `per_tick` apart
        cost["clock"] += cost["per_tick"] / 2
        return cost["clock"]

    monkeypatch.setattr(service_mod.time, "thread_time", thread_time)
    node = wire.NodeHeartbeat(run_id="big", host="n0", node_rank=0, world_size=100_000, sent_at=time.time())

    def stride() -> int:
        return c.ingest_node_report(wire.NodeReport(node=node, heartbeats=[])).step_stride

    assert stride() == 8
    now = time.time()
    for second in range(62):
        c.tick(now + second)
    assert stride() == 32  # two windows over the share: 8 x 2 x 2
    cost["per_tick"] = 0.0
    for second in range(62, 62 + 62):
        c.tick(now + second)
    assert stride() == 8
    c.stop()


# -- analyses on sampled steps ----------------------------------------------------------------


def _records(step: int, ranks, norm=lambda r: 1.0 + 0.01 * (r % 5)) -> dict:
    return {r: wire.StepRecord(step, 1000.0 + step, 1001.0 + step, 1, 0.8, 0.01, 2.0, norm(r), 0, 1, 1 << 30)
            for r in ranks}


def test_a_spike_on_a_step_only_its_rank_reported_is_judged_against_the_peers_median():
    run = RunState("big", world_size=2048)
    tracker = grad_spike.Tracker()
    everyone = range(2048)
    for step in range(0, 64, 8):  # sampled steps: every rank
        tracker.on_step(run, step, _records(step, everyone))
    tracker.on_step(run, 65, _records(65, [7], norm=lambda r: 1.2))  # forwarded but ordinary: nothing
    assert tracker.finding is None
    tracker.on_step(run, 66, _records(66, [7], norm=lambda r: 80.0))  # only rank 7's record of step 66
    assert tracker.finding is not None and set(tracker.finding["spiked"]) == {7} and tracker.finding["step"] == 66


def _sampled_run(norm, steps: int = 24, stride: int = 2) -> grad_spike.Tracker:
    """Two ranks whose agents check their gradients every ``stride``-th step
    (a loaded rank's cost budget), norms from ``norm(rank, step)``."""
    run = RunState("early", world_size=2)
    tracker = grad_spike.Tracker()
    for step in range(0, steps, stride):
        tracker.on_step(run, step, _records(step, range(2), norm=lambda r, step=step: norm(r, step)))
    return tracker


def test_a_spike_before_the_rank_has_a_history_of_its_own_is_named_at_its_step():
    """faultbench hf-grad_spike-s0: rank 0's gradient 2,000x its peer's at step
    2, when (checked every 2nd step) it had one norm of its own. It was never
    judged, and its ratio became the run's largest healthy one. Held until the
    rank's own history can judge it, it is the verdict, at step 2."""
    tracker = _sampled_run(lambda r, step: 3768.0 if (r, step) == (0, 2) else 2.0 - 0.02 * step + 0.01 * r)
    assert tracker.finding is not None, tracker.candidates
    assert tracker.finding["step"] == 2 and set(tracker.finding["spiked"]) == {0}
    assert tracker.peak_ratio < 2.0  # the spike never counted as a healthy step


def test_a_rank_different_from_its_first_step_is_not_a_spike():
    """A rank whose gradients are 200x its peer's from step 0 on (its data,
    not a spike): held at first, then dropped once its own history shows
    that is what it does."""
    tracker = _sampled_run(lambda r, step: (400.0 if r == 0 else 2.0) * (1 + 0.01 * (step % 3)))
    assert tracker.finding is None and not tracker.candidates


def test_marks_already_settled_are_not_read_again_and_a_later_mismatch_is_still_found():
    run = RunState("m", world_size=3)
    for r in range(3):
        run.rank(r)
    for step in (5, 10):
        for r in range(3):
            run.ranks[r].marks[step] = {"0": 3 * step}
    assert collective_mismatch.detect(run, time.time(), False) == []
    seen = run.trackers["collective_marks"]
    assert seen.settled_upto == 10 and not seen.marks
    for r in range(3):
        run.ranks[r].marks[15] = {"0": 45 + (1 if r == 2 else 0)}
    found = collective_mismatch.detect(run, time.time(), False)
    assert [v.ranks for v in found] == [[2]] and found[0].step == 15


def test_mark_steps_a_late_rank_never_had_settle_once_every_rank_has_passed_them():
    """A cold start at scale: ranks join the watch at different steps, so the
    first ones' early marks never come from all. Such a step settles once
    every live rank has reported steps past it (before: only 64 steps later,
    or never while the job hangs, each pass reading every rank for it), and
    a mismatch at a later step is still found."""
    run = RunState("late", world_size=3)
    for r in range(3):
        run.rank(r)
    for step in (5, 10):
        for r in (0, 1):  # rank 2 was first seen after step 10
            run.ranks[r].marks[step] = {"0": 3 * step}
    for r in range(3):
        run.ranks[r].step = 11  # steps done: every rank is at step index 10
    assert collective_mismatch.detect(run, time.time(), False) == []
    seen = run.trackers["collective_marks"]
    assert seen.settled_upto == 5 and list(seen.marks) == [10]  # rank 2 may still send step 10's marks
    for r in range(3):
        run.ranks[r].step = 13
    assert collective_mismatch.detect(run, time.time(), False) == []
    assert seen.settled_upto == 10 and not seen.marks
    for r in range(3):
        run.ranks[r].marks[15] = {"0": 45 + (1 if r == 2 else 0)}
    found = collective_mismatch.detect(run, time.time(), False)
    assert [v.ranks for v in found] == [[2]] and found[0].step == 15


def test_rare_facts_are_found_without_reading_every_rank():
    run = RunState("n", world_size=50_000)
    for r in range(50_000):
        run.rank(r)
    assert run.notable == set()
    run.ranks[123].exit_code = -9
    run.ranks[4567].events.append(wire.Event(kind="exception", at=time.time(), step=3,
                                             details={"type": "RuntimeError", "message": "boom"}))
    assert run.notable == {123, 4567}
    started = time.perf_counter()
    for _ in range(20):
        failures = analyses.crash.failures(run)
    assert {f.rank for f in failures} == {123, 4567}
    assert (time.perf_counter() - started) / 20 < 0.01  # reading 50,000 ranks would take ~20 ms


def test_a_small_flush_s_records_are_one_row_and_load_back(tmp_path):
    store = Store(tmp_path / "i.sqlite")
    run = RunState("s", world_size=3)
    store.save_run(run)
    for r in range(3):
        beat = wire.Heartbeat(identity=wire.RankIdentity(run_id="s", rank=r, local_rank=r, world_size=3), sent_at=time.time(),
                              steps=list(_records(4, [r]).values()) + list(_records(5, [r], norm=lambda r: float("nan")).values()))
        store.save_heartbeat_data("s", r, beat)
    store.flush()
    rows = store._rows("SELECT kind, rank FROM batches WHERE run_id='s'")
    assert rows == [("steps_by_rank", -1)]
    loaded = store.load_run("s")
    assert sorted(loaded.ranks) == [0, 1, 2]
    record = loaded.ranks[2].steps[5]
    assert record.grad_norm != record.grad_norm  # NaN kept (strict JSON), not null
    store.close()


def test_a_big_flush_writes_its_records_in_rows_of_some_ranks_each(tmp_path, monkeypatch):
    """One encoding of 60,000 ranks' records held the interpreter ~45 ms
    (every report waited): rows of STEPS_ROW_RANKS ranks, each encoded on its
    own; a NaN in one row takes the strict encoder for that row alone."""
    monkeypatch.setattr(store_mod, "STEPS_ROW_RANKS", 2)
    store = Store(tmp_path / "i.sqlite")
    store.save_run(RunState("s", world_size=5))
    for r in range(5):
        nan = (lambda r: float("nan")) if r == 4 else (lambda r: 1.0)
        beat = wire.Heartbeat(identity=wire.RankIdentity(run_id="s", rank=r, local_rank=r, world_size=5),
                              sent_at=time.time(), steps=[_records(7, [r])[r], _records(8 + r, [r], norm=nan)[r]])
        store.save_heartbeat_data("s", r, beat)
    store.flush()
    rows = store._rows("SELECT first_step, last_step, data FROM batches WHERE kind='steps_by_rank' ORDER BY rowid")
    assert [(first, last, sorted(json.loads(data)["ranks"])) for first, last, data in rows] == [
        (7, 9, ["0", "1"]), (7, 11, ["2", "3"]), (7, 12, ["4"])]
    assert "NaN" not in rows[0][2] + rows[1][2] and "NaN" in rows[2][2]
    loaded = store.load_run("s")
    assert {r: sorted(loaded.ranks[r].steps) for r in range(5)} == {r: [7, 8 + r] for r in range(5)}
    assert loaded.ranks[4].steps[12].grad_norm != loaded.ranks[4].steps[12].grad_norm
    store.close()


# -- a big job's hang ----------------------------------------------------------------------------


def _big_job(c: Collector, world: int, culprit: int, now: float) -> None:
    """`world` ranks in nodes of 8 through relays: all at step 50 a minute
    ago; 45 s ago every rank but `culprit` entered the next collective; the
    heartbeats (1 s old) still say so."""
    for phase in ("running", "stalled"):
        sent = now - 60 if phase == "running" else now - 1
        for node in range(world // 8):
            ranks = range(node * 8, node * 8 + 8)
            workers = [wire.WorkerStatus(local_rank=r % 8, rank=r, pid=1000 + r) for r in ranks]
            view = wire.NodeHeartbeat(run_id="big", host=f"n{node}", node_rank=node, world_size=world,
                                      sent_at=sent, workers=workers)
            beats = []
            for r in ranks:
                ahead = phase == "stalled" and r != culprit
                beats.append(wire.Heartbeat(
                    identity=wire.RankIdentity(run_id="big", rank=r, local_rank=r % 8, world_size=world,
                                               node_rank=node, host=f"n{node}", pid=1000 + r),
                    sent_at=sent, seq=1 if phase == "running" else 60, step=50, forwards=50,  # a beat a second
                    phase="backward" if ahead else "forward", last_progress_at=now - 45 if ahead else now - 60,
                    collectives_enqueued={"0": 150 + (1 if ahead else 0)}, collectives_completed={"0": 150}))
            c.ingest_node_report(wire.NodeReport(node=view, heartbeats=beats), now=sent)
        if phase == "running":
            c.runs["big"].last_progress_seen_at = now - 60  # the run began before this test's first report


def test_a_big_jobs_hang_asks_only_its_suspects_and_is_named_before_the_evidence_window_ends():
    c = Collector(Config(hang_timeout=20, on_hang="wait"))
    world, culprit = 2048, 1234
    now = time.time()
    _big_job(c, world, culprit, now)
    run = c.runs["big"]
    c.tick(now)  # the stall is older than the hang timeout: an incident
    incident = next(i for i in run.incidents if i.kind == "hang")
    assert culprit in incident.requested_ranks
    assert len(incident.requested_ranks) <= hang.MAX_SUSPECTS + hang.REFERENCE_RANKS < world
    capture = [cmd for cmds in c._rt["big"].node_commands.values() for cmd in cmds if cmd.kind == "capture"]
    assert sum(len(cmd.ranks) for cmd in capture) == len(incident.requested_ranks)
    assert incident.deadline - now > c.config.evidence_window  # commands leave with the next relay report
    c.tick(now + 0.5)  # no bundle came: the numbers are conclusive, the verdict does not wait
    c.tick(now + 1.0)
    verdicts = [v for v in c._rt["big"].verdicts if v.kind == "hang"]
    assert [v.ranks for v in verdicts] == [[culprit]]
    assert "never reached collective #151" in verdicts[0].summary
    listed = verdicts[0].evidence["ranks"]
    assert str(culprit) in listed and len(listed) < 400 and verdicts[0].evidence["ranks_total"] == world
    assert not run.aborted  # on_hang wait
    c.stop()


WORLD, CULPRIT = 2048, 1234


def _stalled_node_report(node: int, now: float, sent: float, seq: int, ahead_of_culprit: bool) -> wire.NodeReport:
    """Node `node`'s relay report (see _stalled_big_job): its ranks at step 50
    since a minute ago, in collective #151 since 45 s ago if `ahead_of_culprit`."""
    entered = now - 45
    ranks = range(node * 8, node * 8 + 8)
    workers = [wire.WorkerStatus(local_rank=r % 8, rank=r, pid=1000 + r) for r in ranks]
    beats = []
    for r in ranks:
        ahead = ahead_of_culprit and r != CULPRIT  # the culprit never enters
        beats.append(wire.Heartbeat(
            identity=wire.RankIdentity(run_id="big", rank=r, local_rank=r % 8, world_size=WORLD, node_rank=node,
                                       host=f"n{node}", pid=1000 + r),
            sent_at=sent, seq=seq, step=50, forwards=50, phase="backward" if ahead else "forward",
            last_progress_at=entered if ahead else now - 60,
            collectives_enqueued={"0": 150 + ahead}, collectives_completed={"0": 150}))
    view = wire.NodeHeartbeat(run_id="big", host=f"n{node}", node_rank=node, world_size=WORLD, sent_at=sent,
                              workers=workers)
    return wire.NodeReport(node=view, heartbeats=beats)


def _stalled_big_job(c: Collector, now: float, late: int, delay: tuple[float, float]):
    """WORLD ranks in nodes of 8 through relays, a beat a second: all at step
    50 a minute ago; 45 s ago every rank but CULPRIT entered collective #151,
    and their beats of a second ago say so; node `late` was last heard half
    a second before that, its reports `delay` (arrival, ingest) after sent."""
    entered = now - 45

    def report(node: int, sent: float, seq: int, ahead_of_culprit: bool) -> wire.NodeReport:
        return _stalled_node_report(node, now, sent, seq, ahead_of_culprit)

    for node in range(WORLD // 8):
        took = delay if node == late else (0.005, 0.01)
        for sent, ahead in ((now - 60, False), (now - 1, True)):
            if node == late and ahead:
                sent, ahead = entered - 0.5, False  # its last report before it went unheard (shed)
            seq = int(sent - (now - 70))  # a beat a second
            c.ingest_node_report(report(node, sent, seq, ahead), now=sent + took[1], arrived_at=sent + took[0])
        if node == 0:
            c.runs["big"].last_progress_seen_at = now - 60
    return c.runs["big"]


@pytest.mark.parametrize("arrived, taken_in", [(0.01, 1.0), (0.6, 0.6)], ids=["waited-in-the-collector", "slow-path"])
def test_a_node_heard_late_is_not_named_from_a_beat_sent_before_its_ranks_entered_the_collective(arrived, taken_in):
    """A rank's clock offset (collector clock - its own) is the lowest
    transit its reports had. A node whose every report was slow (queued in
    the collector for 1 s, or 0.6 s on the way) got an offset that much too
    big, and its last beat, sent half a second before its ranks entered the
    collective, read as sent after the job's last progress: its 8 ranks were
    named "behind" with the culprit (seen at 100,000 ranks under load).
    Transit is taken to when the request arrived, not when ingest reached
    it, and a beat within one beat interval of the last progress is not
    taken as the rank's state during the stall."""
    c = Collector(Config(hang_timeout=20, on_hang="wait"))
    now = time.time()
    run = _stalled_big_job(c, now, late=7, delay=(arrived, taken_in))
    c.tick(now)
    incident = next(i for i in run.incidents if i.kind == "hang")
    assert abs(incident.last_progress_at - (now - 45)) < 0.1
    found = hang.diagnose(run, incident, now + 1.0, final=False)
    assert found is not None and found.ranks == [CULPRIT], found and found.summary
    c.stop()


def test_a_big_job_whose_culprits_node_is_not_heard_since_the_stall_waits_then_names_that_node_not_everyone():
    """Every rank heard since the stall began has entered the collective; the
    culprit's node was last heard before (its relay shed, backing off). The
    numbers then name nobody, and "no rank stands out" named all 2,048 ranks
    (seen at 100,000 ranks). Now the diagnosis waits for fresher numbers, and
    once waiting is over names the ranks not heard since whose last numbers
    were behind, saying that they were not heard since."""
    c = Collector(Config(hang_timeout=20, on_hang="wait"))
    now = time.time()
    run = _stalled_big_job(c, now, late=CULPRIT // 8, delay=(0.005, 0.01))
    c.tick(now)
    incident = next(i for i in run.incidents if i.kind == "hang")
    assert hang.diagnose(run, incident, now + 1.0, final=False) is None  # not yet: fresher numbers may come
    found = hang.diagnose(run, incident, incident.opened_at + hang.STALE_WAIT_S + 0.1, final=False)
    node = list(range(CULPRIT // 8 * 8, CULPRIT // 8 * 8 + 8))
    assert found is not None and found.ranks == node, found and found.summary
    assert found.evidence["not_heard_since_stall"] and "not heard from since the stall began" in found.summary
    c.stop()


def _unheard_since_the_stall(run, now: float, nodes) -> set[int]:
    """The ranks of `nodes` as if their reports since the stall were shed:
    last heard (and last vouched for) half a second before their ranks
    entered the collective, every one behind as all were then."""
    ranks = {r for n in nodes for r in range(n * 8, n * 8 + 8)}
    for r in ranks:
        state = run.ranks[r]
        state.beat_at = state.last_heartbeat_at = state.vouched_at = now - 45.5
        state.enqueued = {"0": 150}
    return ranks


def test_ranks_unheard_while_the_collector_turns_reports_away_are_waited_for_not_named():
    """At 100,000 ranks on a slow machine the collector took in a ninth of
    the reports offered and shed the rest unread (503). Once the wait for
    fresher numbers was over, the ranks not heard since the stall, whose last
    numbers were behind as every rank's were before it, were named: ten
    bystanders, the culprit's report not yet in. Not being heard while the
    collector turns reports away says nothing of a rank: the diagnosis waits,
    names the culprit once its node's report gets in, and falls back to the
    unheard ranks only once nothing is refused and their relays' longest
    pause has passed."""
    c = Collector(Config(hang_timeout=20, on_hang="wait"))
    now = time.time()
    run = _stalled_big_job(c, now, late=CULPRIT // 8, delay=(0.005, 0.01))
    unheard = _unheard_since_the_stall(run, now, [CULPRIT // 8, *range(0, 40)])  # ~16 % of the ranks
    c.tick(now)
    incident = next(i for i in run.incidents if i.kind == "hang")
    late = incident.opened_at + hang.STALE_WAIT_S + 0.1
    run.reports_refused_at = late - 0.5  # still shedding
    assert hang.diagnose(run, incident, late, final=False) is None

    # Long after the last refusal, the relays' longest pause over: those still
    # unheard are named, hedged ("not heard from since"), the culprit among them.
    quiet = late + 120.0
    run.reports_refused_at = late
    found = hang.diagnose(run, incident, quiet, final=False)
    assert found is not None and set(found.ranks) == unheard, found and found.summary
    assert "not heard from since the stall began" in found.summary
    assert found.evidence["unheard_ranks"]["unknown"] == 0

    # The culprit's node gets in while others are still turned away: named alone.
    run.trackers.pop("_hang_diagnoses")
    run.reports_refused_at = late + 1.0
    sent = late + 0.5
    c.ingest_node_report(_stalled_node_report(CULPRIT // 8, now, sent, int(sent - (now - 70)), True),
                         now=sent + 0.01, arrived_at=sent + 0.005)
    found = hang.diagnose(run, incident, late + 1.5, final=False)
    assert found is not None and found.ranks == [CULPRIT], found and found.summary
    assert "never reached collective #151" in found.summary
    c.stop()


def test_a_rank_whose_node_reports_without_its_beats_is_named_while_others_are_turned_away():
    """A rank whose heartbeat thread stopped with it, its node's reports
    coming in without a beat of it: that silence is the rank's own, named
    however many other ranks the collector is still turning away."""
    c = Collector(Config(hang_timeout=20, on_hang="wait"))
    now = time.time()
    run = _stalled_big_job(c, now, late=-1, delay=(0.005, 0.01))
    _unheard_since_the_stall(run, now, range(0, 40))
    culprit = run.ranks[CULPRIT]
    culprit.beat_at = culprit.last_heartbeat_at = now - 46  # its last beat; its node vouched for it a second ago
    c.tick(now)
    incident = next(i for i in run.incidents if i.kind == "hang")
    late = incident.opened_at + hang.STALE_WAIT_S + 0.1
    run.reports_refused_at = late - 0.5
    found = hang.diagnose(run, incident, late, final=False)
    assert found is not None and found.ranks == [CULPRIT], found and found.summary
    assert "sent no heartbeat since the stall began though its node reported" in found.summary
    c.stop()


def test_a_big_job_heard_from_too_little_since_the_stall_is_not_said_to_have_no_rank_standing_out():
    """A collector far behind (seen at 100,000 ranks on a slow machine: p50
    22 s) heard a quarter of the ranks since the stall began, all at the
    front; the rest were last heard before it, behind as every rank was then.
    No number names anyone, and "no rank stands out" named every rank once
    the wait was over. Now it waits for more (the end of the run still
    judges what is known)."""
    c = Collector(Config(hang_timeout=20, on_hang="wait"))
    now = time.time()
    run = _stalled_big_job(c, now, late=CULPRIT // 8, delay=(0.005, 0.01))
    heard = set(range(WORLD // 4))
    for r, state in run.ranks.items():  # the last three quarters: last heard a minute ago
        if r not in heard:
            state.beat_at = state.last_heartbeat_at = now - 60
            state.enqueued = {"0": 150}
    c.tick(now)
    incident = next(i for i in run.incidents if i.kind == "hang")
    late = incident.opened_at + hang.STALE_WAIT_S + 0.1
    assert hang.diagnose(run, incident, late, final=False) is None
    found = hang.diagnose(run, incident, late, final=True)
    assert found is not None  # the run's end names what it can
    c.stop()


def test_a_big_jobs_diagnosis_waiting_for_fresher_numbers_is_asked_again_once_a_second(monkeypatch):
    """Every tick asks for the hang diagnosis several times (the incident's
    follow-up, the analyses' pass), each a read of every rank under the
    ingest lock. A big job's "not yet" is kept for NOT_YET_RECHECK_S; a
    small job's is asked every time, and a verdict found is kept as before."""
    from rankwatch.collector.state import Incident

    calls = []
    answer = {"verdict": None}

    def counted(run, incident, evidence, now, final):
        calls.append(now)
        return answer["verdict"]

    monkeypatch.setattr(hang, "_diagnose", counted)
    now = 1000.0
    for world, expected in ((hang.EVIDENCE_FROM_EVERY_RANK + 1, 1), (8, 5)):
        run = RunState(f"w{world}", world_size=world)
        for r in range(world):
            run.rank(r)
        incident = Incident(id="hang-1", kind="hang", opened_at=now, last_progress_at=now - 20, timeout=20.0)
        calls.clear()
        for _ in range(5):
            assert hang.diagnose(run, incident, now + 0.5, final=False) is None
        assert len(calls) == expected
    # The big job, past the recheck interval: asked again, and what it finds is kept.
    big = RunState("again", world_size=hang.EVIDENCE_FROM_EVERY_RANK + 1)
    for r in range(big.world_size):
        big.rank(r)
    incident = Incident(id="hang-1", kind="hang", opened_at=now, last_progress_at=now - 20, timeout=20.0)
    calls.clear()
    hang.diagnose(big, incident, now, final=False)
    answer["verdict"] = "named"
    assert hang.diagnose(big, incident, now + 0.2, final=False) is None  # within the interval: the kept answer
    assert hang.diagnose(big, incident, now + hang.NOT_YET_RECHECK_S + 0.1, final=False) == "named"
    assert hang.diagnose(big, incident, now + 100, final=False) == "named" and len(calls) == 2


def test_marks_and_fingerprints_reload_from_the_index_as_sent(tmp_path):
    """Every rank's marks and fingerprints go to the index each flush through
    the fast encoder where nothing is non-finite; a NaN norm takes the strict
    one. Both read back as they were sent."""
    store = Store(tmp_path / "i.sqlite")
    run = RunState("fp", world_size=2)
    store.save_run(run)
    prints = {0: [{"step": 3, "names": ["w", "b\u00e9"], "norms": [1.5, 2.25]}, {"step": 4, "norms": [1.0, 3.0]}],
              1: [{"step": 3, "names": ["w", "b\u00e9"], "norms": [float("nan"), 2.0]}]}
    for r in range(2):
        beat = wire.Heartbeat(identity=wire.RankIdentity(run_id="fp", rank=r, local_rank=r, world_size=2),
                              sent_at=time.time(), marks=[wire.CollectiveMark(3, {"0": 9, "1": -1})])
        store.save_heartbeat_data("fp", r, beat, fingerprints=[dict(fp) for fp in prints[r]])
    store.flush()
    loaded = store.load_run("fp")
    assert [dict(loaded.ranks[r].marks) for r in range(2)] == [{3: {"0": 9, "1": -1}}] * 2
    got0 = list(loaded.ranks[0].fingerprints)
    assert [(fp["step"], fp.get("names"), fp["norms"]) for fp in got0] == [
        (3, ["w", "b\u00e9"], [1.5, 2.25]), (4, None, [1.0, 3.0])]
    (nan_print,) = list(loaded.ranks[1].fingerprints)
    assert nan_print["norms"][0] != nan_print["norms"][0] and nan_print["norms"][1] == 2.0


def test_past_ten_thousand_ranks_the_index_keeps_the_same_sampled_steps_of_records_and_marks(tmp_path):
    """A 100,000-rank job's index keeps every 16th step of each rank, its
    step record and its collective mark alike (a mark counts collectives
    since the start, so an extra one still shows at the next kept mark);
    the live state keeps them all. A 10,000-rank job's index keeps every step."""
    for world, kept in ((100_000, [0, 16]), (10_000, [0, 4, 8, 12, 16, 20])):
        store = Store(tmp_path / f"i{world}.sqlite")
        run = RunState("big", world_size=world)
        store.save_run(run)
        steps = range(0, 24, 4)  # records and marks every 4th step, as a relay forwards them
        beat = wire.Heartbeat(identity=wire.RankIdentity(run_id="big", rank=7, local_rank=7, world_size=world),
                              sent_at=time.time(), step=24,
                              steps=[wire.StepRecord(step=s, started_at=100.0 + s, ended_at=101.0 + s) for s in steps],
                              marks=[wire.CollectiveMark(s, {"0": 3 * s}) for s in steps])
        store.save_heartbeat_data("big", 7, beat)
        store.flush()
        loaded = store.load_run("big")
        assert sorted(loaded.ranks[7].steps) == kept
        assert dict(loaded.ranks[7].marks) == {s: {"0": 3 * s} for s in kept}
        store.close()


def test_open_mark_steps_are_compared_rank_by_rank_only_when_their_ranks_disagree(monkeypatch):
    """A step that waits for a rank (shed, slow to report) is not read over
    every rank on every pass: the marks are counted as they arrive, and a
    step is compared rank by rank only once two numbers meet in a group.
    A mark that arrives later for an open step brings its mismatch."""
    run = RunState("open", world_size=4)
    for r in range(4):
        run.rank(r)
        run.ranks[r].step = 20
    run.ranks[3].step = 6  # rank 3 lags: steps 5 and 10 stay open
    for r in range(3):
        run.ranks[r].marks[5] = {"0": 15}
        run.ranks[r].marks[10] = {"0": 30}
    compared = []
    real = collective_mismatch._compare_marks
    monkeypatch.setattr(collective_mismatch, "_compare_marks",
                        lambda run_, step, *a: compared.append(step) or real(run_, step, *a))
    for _ in range(3):
        assert collective_mismatch.detect(run, time.time(), False) == []
    assert compared == [] and sorted(run.trackers["collective_marks"].marks) == [5, 10]
    run.ranks[3].marks[10] = {"0": 31}  # rank 3's report of step 10 arrives, one collective ahead
    found = collective_mismatch.detect(run, time.time(), False)
    assert compared == [10]
    assert [v.ranks for v in found] == [[3]] and found[0].step == 10
    assert [v.ranks for v in collective_mismatch.detect(run, time.time(), False)] == [[3]]  # still reported
    run.ranks[3].marks[10] = {"0": 30}  # re-sent, corrected: the counts follow
    assert collective_mismatch.detect(run, time.time(), False) == []
