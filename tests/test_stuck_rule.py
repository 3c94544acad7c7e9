"""The naming bound and the "stuck" rule (collector/stuck.py) on made-up
figures: pure functions, no processes (a few milliseconds)."""

from __future__ import annotations

from rankwatch.config import Config
from rankwatch.collector import stuck
from rankwatch.collector.state import Incident, RunState


def _run(durations: list[float]) -> RunState:
    run = RunState(run_id="r", world_size=2)
    for r in (0, 1):
        state = run.rank(r)
        state.step = 50
        state.phase = "forward"
        state.last_heartbeat_at = state.beat_at = 1000.0
    run.ranks_reported = 2
    run.max_step = 50
    run.durations.extend(durations)
    return run


def test_naming_bound_is_three_p99_steps_plus_two_seconds_with_a_5_s_floor():
    assert stuck.naming_timeout(_run([0.01] * 500), Config()) == 5.0
    slow = [1.0] * 490 + [3.0] * 10  # p99 = 3 s
    assert stuck.naming_timeout(_run(slow), Config()) == 3 * 3.0 + 2.0
    fixed = _run(slow)
    fixed.hang_timeout = 8.0
    assert stuck.naming_timeout(fixed, Config()) == 8.0


def _stalled(run: RunState, at: float, cpu_per_s: float, io_per_s: int, wakeups_per_s: float, seconds: int):
    for i in range(seconds + 1):
        run.ranks[0].note_activity(at + i, cpu_per_s * i, io_per_s * i, int(wakeups_per_s * i))
        run.ranks[0].beat_at = at + i
        run.ranks[0].vouched_at = at + i


def _judge(run: RunState, now: float):
    incident = Incident(id="hang-1", kind="hang", opened_at=now - 10, last_progress_at=now - 20, timeout=5.0)
    return stuck.stuck(run, incident, [0], now, Config(), stale_after=3.0)


def test_a_rank_asleep_is_stuck_once_the_window_is_covered():
    run = _run([0.1] * 100)
    _stalled(run, 1000.0, cpu_per_s=0.0, io_per_s=0, wakeups_per_s=0.2, seconds=10)
    assert _judge(run, 1010.0) is None, "10 s of samples do not cover the 15 s window"
    _stalled(run, 1000.0, cpu_per_s=0.0, io_per_s=0, wakeups_per_s=0.2, seconds=16)
    found = _judge(run, 1016.0)
    assert found is not None and found["ranks"]["0"]["rule"] == "idle", found


def test_a_rank_that_uploads_evaluates_or_writes_is_not_stuck():
    for cpu, io, wakeups in ((0.0004, 0, 3.0),   # an HTTP upload at 2 MB/s: 0.04 % of a core, wakes 3 times a second
                             (1.0, 0, 0.0),      # an evaluation: a core busy
                             (0.0, 4096, 0.0)):  # a file being written
        run = _run([0.1] * 100)
        _stalled(run, 1000.0, cpu, io, wakeups, seconds=30)
        assert _judge(run, 1030.0) is None, (cpu, io, wakeups)


def test_a_busy_rank_is_ended_at_the_abort_bound_and_later_in_a_checkpoint():
    run = _run([0.1] * 100)
    _stalled(run, 1000.0, cpu_per_s=1.0, io_per_s=0, wakeups_per_s=0.0, seconds=400)
    incident = Incident(id="hang-1", kind="hang", opened_at=1005.0, last_progress_at=1000.0, timeout=5.0)
    found = stuck.stuck(run, incident, [0], 1301.0, Config(), stale_after=3.0)
    assert found is not None and "abort bound of 300 s" in found["rule"], found
    run.ranks[0].phase = "checkpoint"
    assert stuck.stuck(run, incident, [0], 1301.0, Config(), stale_after=3.0) is None
