"""The straggler check on a job whose step times jitter (issue 23).

Recorded from the zoo: two gloo ranks of Hugging Face T5 on a 2-core
machine, each step's own time as the collector received it. The host's
scheduler moves work between cores, so the healthy ranks drift ~25 % apart
for tens of steps and jitter 13-20 % step to step. With a fixed 1.33x bound
the healthy rank 0 was over it on 7 of 12 steps (margin 0.78, a verdict at
9). The bound now rises with the run's own step-to-step jitter, which a
steady gap does not raise: a rank made 2x slower on top of the same
recorded jitter is still named, from about the step it slowed.

Also recorded from the zoo: the diffusers UNet (80 ms steps), where for about
1.3 s the scheduler gave rank 1 a core's worth more than rank 0 (40 ms
against 67 ms on 8 of 12 steps) while the job's step time did not move:
margin 0.89 when persistence was counted in steps alone. A window now spans
at least 5 s as well as 12 steps. Pure: records into a RunState (no
processes; <1 s each)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rankwatch import wire
from rankwatch.collector import analyses
from rankwatch.collector import report as report_mod
from rankwatch.collector.state import RunState

DATA = json.loads((Path(__file__).parent / "data" / "zoo_t5_trainer_step_times.json").read_text())
UNET = json.loads((Path(__file__).parent / "data" / "zoo_diffusers_unet_step_times.json").read_text())
T0 = float(int(time.time()) + 100_000)


def _run(slow_rank: int = -1, slow_from: int = 10**9, factor: float = 1.0, recorded: dict = DATA) -> RunState:
    """A recorded run replayed into a RunState, one rank made ``factor`` times
    slower from ``slow_from``; on the recording's own clock where it has one
    (100 ms steps otherwise)."""
    compute, data = recorded["compute_s"], recorded["data_s"]
    started = recorded.get("started_s") or {r: [0.1 * s for s in range(len(v))] for r, v in compute.items()}
    run = RunState(run_id="jitter", world_size=2)
    for step in range(len(compute["0"])):
        for rank in (0, 1):
            own = compute[str(rank)][step] * (factor if rank == slow_rank and step >= slow_from else 1.0)
            at = T0 + started[str(rank)][step]
            run.rank(rank).add_step(wire.StepRecord(step=step, started_at=at, ended_at=at + own + 0.015,
                                                    compute_s=own, data_s=data[str(rank)][step], loss=1.0,
                                                    grad_norm=1.0))
    return run


def test_a_healthy_job_whose_step_times_jitter_stays_well_below_a_straggler():
    run = _run()
    verdicts = analyses.run_all(run, T0 + 1e4, True)
    assert [v.kind for v in verdicts if v.kind == "straggler"] == []
    margin = report_mod.build(run, verdicts).margins["straggler"]
    assert margin["margin"] <= 0.5, margin  # 0.78 with the fixed bound


def test_a_rank_twice_as_slow_on_top_of_the_same_jitter_is_named_from_about_the_step_it_slowed():
    run = _run(slow_rank=1, slow_from=150, factor=2.0)
    found = [v for v in analyses.run_all(run, T0 + 1e4, True) if v.kind == "straggler"]
    # labelled with the start of its streak: a jitter step over the bound less than a window before counts
    assert [v.ranks for v in found] == [[1]] and 150 - 12 <= found[0].step <= 150, [(v.ranks, v.step) for v in found]
    bound = found[0].evidence["bound"]
    assert 1.33 < bound["ratio"] < 2.0 and bound["jitter_sigma"] > 0.05, bound


def _unet(slow_rank: int = -1, slow_from: int = 10**9, factor: float = 1.0) -> RunState:
    """The recorded UNet run, with its own clock (80 ms steps)."""
    return _run(slow_rank, slow_from, factor, recorded=UNET)


def test_a_second_of_host_contention_on_short_steps_is_not_a_persistent_straggler():
    run = _unet()
    verdicts = analyses.run_all(run, T0 + 1e4, True)
    assert [v.kind for v in verdicts if v.kind == "straggler"] == []
    margin = report_mod.build(run, verdicts).margins["straggler"]
    assert margin["margin"] <= 0.5, margin  # 0.89 (8 of the 9 steps needed) when 12 steps made a window


def test_a_rank_twice_as_slow_on_short_steps_is_named_once_it_has_lasted_seconds():
    started = UNET["started_s"]["0"]
    run = _unet(slow_rank=0, slow_from=100, factor=2.0)
    found = [v for v in analyses.run_all(run, T0 + 1e4, True) if v.kind == "straggler"]
    assert [v.ranks for v in found] == [[0]] and 100 - 12 <= found[0].step <= 100, [(v.ranks, v.step) for v in found]
    first, last = found[0].evidence["steps"]
    # decided on a window of at least 5 s of the steps' work (~40 of them), not 12 steps (~1 s)
    slowest = [max(UNET["compute_s"]["0"][s] * 2.0, UNET["compute_s"]["1"][s]) for s in range(first, last + 1)]
    assert sum(slowest) >= 5.0 and last - first + 1 >= 36, (first, last)
    assert started[last] - started[100] < 8.0, last  # named within 8 s of the slowdown


def test_long_steps_still_decide_on_twelve_steps():
    """A GPU job's 1 s steps span 5 s within twelve: no later than before."""
    run = RunState(run_id="long", world_size=4)
    for step in range(40):
        for rank in range(4):
            own = 0.9 * (2.0 if rank == 3 and step >= 10 else 1.0)
            run.rank(rank).add_step(wire.StepRecord(step=step, started_at=T0 + step, ended_at=T0 + step + 1.0,
                                                    compute_s=own, data_s=0.01, loss=1.0, grad_norm=1.0))
    found = [v for v in analyses.run_all(run, T0 + 1e4, True) if v.kind == "straggler"]
    assert [v.ranks for v in found] == [[3]], found
    first, last = found[0].evidence["steps"]
    assert last - first + 1 == 12 and last <= 10 + 12, (first, last)



def _sensitivity():
    """bench/sensitivity.py: the zoo's recorded healthy jobs and its fault writers."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import sensitivity

    return sensitivity


def test_a_rank_three_times_slower_on_millisecond_steps_is_named_and_their_jitter_is_not():
    """Found by bench/sensitivity.py: PPO on CartPole (a few ms a step, two gloo
    ranks on two cores, its recorded steps repeated to a minute of work). A
    20-ms floor on the excess hid a 3x straggler on every job with steps
    under 10 ms."""
    sensitivity = _sensitivity()
    job = sensitivity.load_baselines()["ppo_gym-s0"]
    assert sensitivity.analyse(job) == []
    slowed = {r: [dict(x) for x in recs] for r, recs in job.items()}
    at = len(slowed[1]) // 3
    fault_step = sensitivity._slow(slowed[1], at, 3.0)
    found = [(v.kind, v.ranks, v.step) for v in sensitivity.analyse(slowed)]
    assert [f[:2] for f in found] == [("straggler", [1])], found
    assert abs(found[0][2] - fault_step) <= 12, (found, fault_step)


def test_the_window_scores_in_arrays_are_each_ranks_own_scores():
    """Every rank's window score (the metric), taken for all ranks at once in
    arrays, equals the score taken rank by rank, at a size where the sealed
    step is kept in columns (300 ranks, one of them 1.5x slower, ranks
    arriving in any order)."""
    import random

    from rankwatch.collector.analyses import straggler

    rnd = random.Random(7)
    run = RunState("columns", 300)
    found = straggler.Tracker()
    for step in range(40):
        ranks = list(range(300))
        rnd.shuffle(ranks)
        records = {r: wire.StepRecord(step=step, started_at=T0 + step, ended_at=T0 + step + 0.3, forwards=1,
                                      compute_s=0.2 * (0.9 + 0.2 * rnd.random()) * (1.5 if r == 123 else 1.0),
                                      data_s=0.01)
                   for r in ranks}
        for r in ranks:
            run.rank(r)
        found.on_step(run, step, records)
    scores = found.latest_scores()
    assert sorted(scores) == list(range(300))
    for rank in (0, 123, 299):
        assert scores[rank] == found._score(rank)
    assert scores[123]["score"] > 1.3 > scores[0]["score"]
    assert found.finding is not None and found.finding["worst_rank"] == 123
