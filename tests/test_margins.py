"""report.json's `margins` (docs/contract.md, 2026-11-25): how close each
check's statistic came to firing at its worst moment (1.0 = fired). Pure:
step records into a RunState, the report built from it (no processes; <1 s)."""

from __future__ import annotations

import time

from rankwatch import wire
from rankwatch.collector import analyses
from rankwatch.collector import report as report_mod
from rankwatch.collector.state import RunState

T0 = float(int(time.time()) + 100_000)


def _run(rss_growth_per_step: int, slow_every: int = 0, ranks: int = 3, steps: int = 60,
         growth_from: int = 8) -> RunState:
    """Rank 0's RSS grows from `growth_from`, after a flat stretch (growth
    from start-up must also outlast warm-up: test_analyses_incremental)."""
    run = RunState(run_id="m", world_size=ranks)
    for step in range(steps):
        for rank in range(ranks):
            compute = 0.05 + (0.2 if rank == 1 and slow_every and step % slow_every == 0 else 0.0)
            rss = (1 << 30) + (max(0, step - growth_from) * rss_growth_per_step if rank == 0 else 0)
            run.rank(rank).add_step(wire.StepRecord(step=step, started_at=T0 + step, ended_at=T0 + step + 0.1,
                                                    compute_s=compute, data_s=0.001, loss=1.0, grad_norm=1.0,
                                                    rss_bytes=rss))
    return run


def _margins(run: RunState) -> dict:
    verdicts = analyses.run_all(run, T0 + 1e4, True)
    return report_mod.build(run, verdicts).margins


def test_a_healthy_run_has_small_margins_and_every_check_listed():
    margins = _margins(_run(0))
    assert {"straggler", "grad_spike", "memory_growth", "broken_update", "hang"} <= set(margins)
    assert all(m["margin"] < 0.5 for m in margins.values()), margins
    assert margins["grad_spike"]["graded"] and not margins["broken_update"]["graded"]


def test_margins_grow_with_the_statistic_and_reach_one_when_it_fires():
    half = _margins(_run(1 << 19))["memory_growth"]  # 0.5 MiB per step: half of what a leak needs
    assert 0.4 <= half["margin"] < 0.6 and half["rank"] == 0, half
    leak = _margins(_run(4 << 20))["memory_growth"]
    assert leak["margin"] == 1.0 and leak["rank"] == 0
    some = _margins(_run(0, slow_every=3))["straggler"]  # slow on a third of the steps: not persistent
    assert 0.3 <= some["margin"] < 1.0 and some["rank"] == 1, some


def test_a_report_with_margins_reads_back_through_the_wire_decoder():
    # `rankwatch analyze <collector URL>` reads the collector's report through
    # wire.decode: a `margins` field typed with no decoder failed there (HTTP
    # analyze and the page of a collector's run broke once margins existed).
    report = wire.Report(run_id="m", world_size=2, status="healthy", verdicts=[],
                         margins={"straggler": {"margin": 0.25, "step": 3, "rank": 1, "graded": True}})
    for _ in range(2):  # the decoder is built on first use: the second call must not differ
        back = wire.decode(wire.Report, wire.json_safe(wire.to_dict(report)))
        assert back.margins == report.margins


def test_grad_spike_margin_is_the_closest_the_step_came_to_all_three_bounds():
    """A spike must beat its peers, the run's median norm and its own
    history. Near convergence two ranks' gradients shrink to 0.1 while one
    stays at the run's ordinary 1.0: 10x its peers, but an ordinary norm for
    the run and for itself. It was reported as 0.9 of a spike (the zoo's
    mobilenet jobs: 0.53); it is 0.1 of one."""
    run = RunState(run_id="g", world_size=3)
    for step in range(130):
        for rank in range(3):
            norm = 1.0 + 0.01 * ((step + rank) % 5)
            if step >= 120 and rank != 1:
                norm = 0.1
            run.rank(rank).add_step(wire.StepRecord(step=step, started_at=T0 + step, ended_at=T0 + step + 0.1,
                                                    compute_s=0.05, data_s=0.001, loss=1.0, grad_norm=norm,
                                                    rss_bytes=1 << 30))
    margin = _margins(run)["grad_spike"]
    assert margin["margin"] <= 0.15, margin


def test_memory_growth_margin_counts_the_peers_test():
    """Every rank's allocator grows alike at first (the zoo's torchvision
    jobs: +0.6 MiB a step on both ranks for a few dozen steps): a leak must
    also outgrow its peers, so that is not 0.6 of one."""
    run = RunState(run_id="w", world_size=2)
    for step in range(40):
        for rank in range(2):
            rss = (1 << 30) + step * (600 << 10) + rank * (4 << 10) * (step % 3)
            run.rank(rank).add_step(wire.StepRecord(step=step, started_at=T0 + step, ended_at=T0 + step + 0.1,
                                                    compute_s=0.05, data_s=0.001, loss=1.0, grad_norm=1.0,
                                                    rss_bytes=rss))
    margin = _margins(run)["memory_growth"]
    assert margin["margin"] <= 0.25, margin


def test_memory_growth_margin_is_not_moved_by_one_transient_step():
    """glibc takes an arena for a few steps and hands it back (the zoo's
    tv_resnet18: +36 MiB at step 64, gone by 72): the window's first-to-last
    growth read that as 0.6 MiB a step. The leak test's own slope
    (Theil-Sen) is not moved by one step, and neither is the margin."""
    run = RunState(run_id="t", world_size=2)
    for step in range(60):
        for rank in range(2):
            rss = (1 << 30) + (64 << 10) * (step % 2)
            if rank == 0 and step == 45:
                rss += 40 << 20
            run.rank(rank).add_step(wire.StepRecord(step=step, started_at=T0 + step, ended_at=T0 + step + 0.1,
                                                    compute_s=0.05, data_s=0.001, loss=1.0, grad_norm=1.0,
                                                    rss_bytes=rss))
    margin = _margins(run)["memory_growth"]
    assert margin["margin"] <= 0.1, margin
