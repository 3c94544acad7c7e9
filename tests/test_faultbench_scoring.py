"""faultbench's scoring (bench/faultkit/scoring.py): pure, no processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from faultkit import plan, reanalyze, scoring  # noqa: E402


def run(kind: str, rank=None, *, verdicts=(), injected_at=100.0, tool="rankwatch", run_id=None, applies=True):
    expected = plan.FAULTS[kind].expected if kind in plan.FAULTS else None
    injected = None if kind == "healthy" or injected_at is None else {"rank": rank, "step": 5, "time": injected_at}
    return {"run_id": run_id or f"ddp-{kind}-{rank}", "shape": "ddp", "kind": kind, "rank": rank, "step": 5,
            "expected": expected,
            "tools": {tool: {"applies": applies, "injected": injected, "verdicts": list(verdicts)}}}


def v(kind, ranks, time=None):
    return {"kind": kind, "ranks": ranks, "time": time}


def test_wilson_matches_the_textbook_values():
    p = scoring.wilson(8, 10)
    assert p.value == 0.8
    assert p.low == pytest.approx(0.4902, abs=1e-4) and p.high == pytest.approx(0.9433, abs=1e-4)
    zero = scoring.wilson(0, 20)
    assert zero.low == 0.0 and zero.high == pytest.approx(0.1611, abs=1e-4)
    everything = scoring.wilson(20, 20)
    assert everything.high == 1.0 and everything.low == pytest.approx(0.8389, abs=1e-4)
    assert scoring.wilson(0, 0).value is None and scoring.wilson(0, 0).low is None
    with pytest.raises(ValueError):
        scoring.wilson(3, 2)


def test_median_interval_from_order_statistics():
    m = scoring.quantile(range(1, 11), 0.5)
    assert m.value == 5.5 and (m.low, m.high) == (2.0, 9.0)  # the classic n=10 interval (97.9 %)
    few = scoring.quantile([3.0, 1.0, 2.0], 0.5)
    assert few.value == 2.0 and few.low is None and few.high is None  # 3 runs cannot pin a median at 95 %
    p95 = scoring.quantile(range(1, 101), 0.95)
    assert p95.value == pytest.approx(95.05) and p95.low == 90.0 and p95.high == 100.0
    assert scoring.quantile([], 0.5).value is None
    with pytest.raises(ValueError):
        scoring.quantile([1.0], 1.0)


def test_quantile_interval_covers_at_least_95_percent():
    # Check the coverage claim itself: P(l <= B <= u-1) >= 0.95 for B ~ Bin(n, q).
    for n in (6, 10, 25, 60, 120):
        for q in (0.5, 0.95):
            values = list(range(1, n + 1))
            r = scoring.quantile(values, q)
            lo = int(r.low) if r.low is not None else 0
            hi = int(r.high) if r.high is not None else n + 1
            coverage = scoring._binom_cdf(hi - 1, n, q) - scoring._binom_cdf(lo - 1, n, q)
            assert coverage >= 0.95, (n, q, lo, hi, coverage)


def test_recall_needs_the_right_kind_and_exactly_the_culprit():
    runs = [
        run("hang", 2, verdicts=[v("hang", [2], 125.0)], run_id="a"),  # hit, 25 s
        run("hang", 1, verdicts=[v("hang", [0], 130.0)], run_id="b"),  # a victim: miss
        run("hang", 0, verdicts=[v("crash", [0], 110.0)], run_id="c"),  # right rank, wrong kind
        run("hang", 0, verdicts=[v("hang", [0, 1], 110.0)], run_id="d"),  # not exactly the culprit
        run("hang", 1, verdicts=[], run_id="e"),
    ]
    s = scoring.score_kinds(runs, "rankwatch")["hang"]
    assert (s.runs, s.hits, s.culprit_hits) == (5, 1, 2)
    assert s.misses == ["b", "c", "d", "e"]
    assert s.latencies == [25.0]
    assert s.recall.value == pytest.approx(0.2)


def test_two_replicas_named_together_count_only_where_no_tool_can_say_more():
    """A difference between two replicas is the same whichever rank changed:
    naming both is right for weight and config divergence on two ranks, but
    never for a per-rank kind or on more ranks, and never for culprit accuracy."""
    def two(kind, world, ranks):
        r = run(kind, 1, verdicts=[v(plan.FAULTS[kind].expected, ranks, 110.0)])
        r["world_size"] = world
        return r, r["tools"]["rankwatch"]["verdicts"][0]

    for kind in ("weight_divergence", "config_divergence"):
        assert scoring.is_correct(*reversed(two(kind, 2, [0, 1])))
        assert not scoring.is_correct(*reversed(two(kind, 3, [0, 1])))
        assert not scoring.is_correct(*reversed(two(kind, 2, [0])))
        assert not scoring.names_culprit(*reversed(two(kind, 2, [0, 1])))
    assert not scoring.is_correct(*reversed(two("hang", 2, [0, 1])))
    r, _ = two("weight_divergence", 2, [0, 1])
    s = scoring.score_kinds([r], "rankwatch")["weight_divergence"]
    assert (s.hits, s.culprit_hits) == (1, 0)


def test_early_exit_is_scored_against_its_expected_kind():
    r = run("early_exit", 1, verdicts=[v("hang", [1], 120.0)])
    assert scoring.is_correct(r["tools"]["rankwatch"]["verdicts"][0], r)
    r = run("leak", 2, verdicts=[v("memory_growth", [2], 120.0)])
    assert scoring.is_correct(r["tools"]["rankwatch"]["verdicts"][0], r)


def test_precision_counts_every_verdict_on_a_healthy_run_against_it():
    runs = [
        run("healthy", verdicts=[v("straggler", [1], 50.0)], run_id="h1"),
        run("healthy", verdicts=[], run_id="h2"),
        run("straggler", 1, verdicts=[v("straggler", [1], 140.0)], run_id="s1"),
        run("straggler", 2, verdicts=[v("straggler", [2], 140.0), v("grad_spike", [0], 141.0)], run_id="s2"),
    ]
    p = scoring.score_precision(runs, "rankwatch")
    assert (p["straggler"].verdicts, p["straggler"].correct, p["straggler"].on_healthy) == (3, 2, 1)
    assert p["straggler"].wrong == [("h1", "straggler", [1])]
    assert (p["grad_spike"].verdicts, p["grad_spike"].correct) == (1, 0)
    assert (p["all"].verdicts, p["all"].correct, p["all"].on_healthy) == (4, 2, 1)
    healthy = scoring.score_kinds(runs, "rankwatch")["healthy"]
    assert (healthy.runs, healthy.verdicts, healthy.hits) == (2, 1, 0)


def test_a_fault_that_never_fired_is_left_out_and_counted():
    runs = [run("leak", 1, verdicts=[], injected_at=None, run_id="x"),
            run("leak", 1, verdicts=[v("memory_growth", [1], 160.0)], run_id="y")]
    s = scoring.score_kinds(runs, "rankwatch")["leak"]
    assert (s.runs, s.not_injected, s.hits) == (1, 1, 1)
    assert s.latencies == [60.0]
    # Its verdicts do not count in precision either.
    assert scoring.score_precision(runs, "rankwatch")["all"].verdicts == 1


def test_a_straggler_that_added_no_time_is_a_fault_that_never_fired():
    idle = run("straggler", 1, verdicts=[], run_id="idle")
    idle["tools"]["rankwatch"]["injected"]["detail"] = {"extra_s_per_step": 0.0}
    slow = run("straggler", 1, verdicts=[v("straggler", [1], 140.0)], run_id="slow")
    slow["tools"]["rankwatch"]["injected"]["detail"] = {"extra_s_per_step": 0.05}
    s = scoring.score_kinds([idle, slow], "rankwatch")["straggler"]
    assert (s.runs, s.not_injected, s.hits) == (1, 1, 1)


def test_a_tool_that_does_not_apply_to_a_shape_is_not_scored_there():
    runs = [run("crash", 1, verdicts=[], applies=False, tool="torchrun")]
    s = scoring.score_kinds(runs, "torchrun")["crash"]
    assert (s.runs, s.not_injected) == (0, 0)
    assert scoring.score_kinds(runs, "rankwatch") == {"crash": scoring.KindScore("rankwatch", "crash", "crash")}


def test_time_to_verdict_is_from_the_injection_to_the_first_correct_verdict():
    r = run("crash", 2, verdicts=[v("crash", [0], 101.0), v("crash", [2], 103.5), v("crash", [2], 102.0)])
    assert scoring.time_to_verdict(r, r["tools"]["rankwatch"]) == 2.0


def test_overall_adds_up_the_fault_kinds_and_leaves_healthy_runs_out():
    runs = [run("crash", 1, verdicts=[v("crash", [1], 101.0)], run_id="c"),
            run("hang", 0, verdicts=[v("crash", [0], 130.0)], run_id="h"),
            run("healthy", verdicts=[v("hang", [0], 10.0)], run_id="ok")]
    total = scoring.score_overall(runs, "rankwatch")
    assert (total.runs, total.hits, total.culprit_hits, total.misses) == (2, 1, 2, ["h"])


def test_every_planned_run_is_reproducible_from_its_seed():
    a = plan.plan_all(list(plan.SHAPES), plan.KIND_ORDER, [0, 1])
    b = plan.plan_all(list(plan.SHAPES), plan.KIND_ORDER, [0, 1])
    assert a == b
    assert len({p.run_id for p in a}) == len(a)
    assert not any(p.shape == "fsdp2" and p.kind == "weight_divergence" for p in a)
    faults = [p for p in a if p.kind != "healthy"]
    assert all(0 <= p.rank < p.world_size and plan.FIRST_FAULT_STEP <= p.step <= plan.LAST_FAULT_STEP
               for p in faults)
    assert len({p.rank for p in faults}) == plan.WORLD_SIZE  # culprits vary


def test_torchrun_and_flight_recorder_are_scored_as_one_tool(tmp_path):
    """What users have: torchrun's root cause read with the OOM text it
    prints, plus fr_trace's finding. Its ceiling is the kinds it can say."""
    from faultkit import report, tools

    log = tmp_path / "output.log"
    log.write_text("[rank0]: ok\n[rank2]: RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried "
                   "to allocate 99 bytes\nRoot Cause (first observed failure):\n  rank      : 2\n  exitcode  : 1\n")
    outcome = tools.Outcome(1, False, 0.0, 10.0, log, {"rank": 2, "step": 5, "time": 4.0})
    torchrun = tools.torchrun_answer(outcome)
    assert [x["kind"] for x in torchrun["verdicts"]] == ["crash"]  # alone: crash is all it says
    combined = tools.combined_answer(torchrun, {"verdicts": [v("hang", [1], 12.0)]}, outcome)
    assert [(x["kind"], x["ranks"]) for x in combined["verdicts"]] == [("oom", [2]), ("hang", [1])]
    log.write_text("[rank2]: ValueError: bad\nRoot Cause (first observed failure):\n  rank      : 2\n  exitcode  : 1\n"
                   "[rank0]: torch.OutOfMemoryError: a peer's later, unrelated line\n")
    combined = tools.combined_answer(tools.torchrun_answer(outcome), {"verdicts": []}, outcome)
    assert [x["kind"] for x in combined["verdicts"]] == ["crash"]  # the root-cause rank's own text decides

    runs = [run("oom", 2, verdicts=[v("oom", [2], 5.0)], tool="torchrun+fr_trace"),
            run("nan_loss", 1, verdicts=[], tool="torchrun+fr_trace"),
            run("hang", 0, verdicts=[], tool="torchrun+fr_trace"),
            run("healthy", tool="torchrun+fr_trace")]
    assert report.ceiling(runs, "torchrun+fr_trace").hits == 2  # oom and hang: nan_loss is beyond its words
    assert report.ceiling(runs, "torchrun+fr_trace").n == 3


def test_latencies_are_compared_on_the_runs_both_tools_got_right():
    from faultkit import report

    both = run("crash", 1, verdicts=[v("crash", [1], 101.0)])
    both["tools"]["torchrun"] = {"injected": both["tools"]["rankwatch"]["injected"], "verdicts": [v("crash", [1], 103.0)]}
    only_ours = run("hang", 2, verdicts=[v("hang", [2], 150.0)], run_id="h")
    only_ours["tools"]["torchrun"] = {"injected": only_ours["tools"]["rankwatch"]["injected"], "verdicts": []}
    (line,) = [x for x in report.paired_table([both, only_ours]) if x.startswith("| torchrun alone")]
    assert line.startswith("| torchrun alone | 1 | 1.0") and "| 3.0" in line and line.endswith("| 1/1 |")


def test_the_verdicts_step_is_scored_against_the_injections():
    exact = run("nan_loss", 1, verdicts=[dict(v("nonfinite", [1], 101.0), step=5)])
    late = run("grad_spike", 2, verdicts=[dict(v("grad_spike", [2], 102.0), step=8)], run_id="late")
    unknown = run("crash", 0, verdicts=[v("crash", [0], 103.0)], run_id="nostep")
    assert [scoring.step_lag(r, r["tools"]["rankwatch"]) for r in (exact, late, unknown)] == [0, 3, None]
    assert sorted(scoring.score_overall([exact, late, unknown], "rankwatch").step_lags) == [0, 3]


def test_a_table_is_one_commit_and_a_resume_keeps_to_it(tmp_path):
    """Every run records its commit; a resume at another commit is refused,
    and a table of runs from several commits is never published."""
    import json

    import faultbench

    done = {"run_id": "ddp-healthy-s0", "kind": "healthy", "commit": "0000000"}
    (tmp_path / "runs.jsonl").write_text(json.dumps(done) + "\n")
    with pytest.raises(SystemExit, match="holds runs made at 0000000"):
        faultbench.main(["--shapes", "ddp", "--kinds", "healthy", "--seeds", "1", "--out", str(tmp_path),
                         "--resume", "--no-docs"])
    runs = [run("healthy", run_id="a"), run("healthy", run_id="b")]
    runs[0]["commit"], runs[1]["commit"] = "1111111", "2222222"
    with pytest.raises(SystemExit, match="several commits"):
        faultbench.write_outputs(runs, tmp_path, {}, "cmd", docs=True)


def test_the_sensitivity_tables_come_with_their_commit(tmp_path):
    """benchmark.md carries the sensitivity results, saying whether each was
    made at the table's own commit."""
    from faultkit import report

    (tmp_path / "sensitivity_jobs.md").write_text(
        "# x\n\nCommand: `c` (3 runs, 1.0 min), rankwatch at `abc1234`.\n\nSmallest size:\n\n- weight: 1e-4\n\n"
        "| fault | named |\n|---|---|\n| weight | 3/3 |\n\nRuns with the fault that were not named:\n\n- none\n")
    (tmp_path / "sensitivity.md").write_text(
        "# y\n\nrankwatch at `fff0000`.\n\n![plot](benchmark/sensitivity.png)\n\n### grad_spike\n\n| k | named |\n")
    text = "\n".join(report.sensitivity_section(tmp_path, "abc1234", prefix="docs/"))
    assert "made at `abc1234` (this table's commit)" in text
    assert "made at `fff0000`: **not this table's commit**" in text
    assert "| weight | 3/3 |" in text and "- weight: 1e-4" in text and "Runs with the fault" not in text
    assert "#### grad_spike" in text and "(docs/benchmark/sensitivity.png)" in text
    assert report.sensitivity_section(tmp_path / "none", "abc1234") == []


def test_reanalyze_finds_each_shapes_run_dir_and_marks_what_a_change_did(tmp_path):
    torchrun = tmp_path / "work" / "ddp-crash-s0" / "rankwatch" / "rankwatch-run"
    ray = tmp_path / "work" / "ray-crash-s0" / "rankwatch" / "ray_results" / "job" / "rankwatch"
    for d in (torchrun, ray):
        d.mkdir(parents=True)
        (d / "collector.sqlite").write_bytes(b"")
    assert reanalyze.run_dir(tmp_path, "ddp-crash-s0") == torchrun
    assert reanalyze.run_dir(tmp_path, "ray-crash-s0") == ray
    assert reanalyze.run_dir(tmp_path, "hf-crash-s0") is None
    fixed = run("crash", 1, run_id="a")
    assert reanalyze._right([v("crash", [1])], fixed) and not reanalyze._right([v("crash", [0])], fixed)
    assert reanalyze._right([], run("healthy")) and not reanalyze._right([v("hang", [0])], run("healthy"))
    rows = [{"run_id": "a", "expected": "crash", "rank": 1, "step": 5, "before": [], "right_before": False,
             "after": [{"kind": "crash", "ranks": [1], "step": 5}], "right_after": True},
            {"run_id": "b", "expected": None, "rank": None, "step": None, "right_before": True, "right_after": False,
             "before": [], "after": [{"kind": "hang", "ranks": [0], "step": 3}]}]
    out = reanalyze.text(rows, 10)
    assert "2 of 10 runs" in out and "fixed   a (truth crash[1]@5): - -> crash[1]@5" in out
    assert "BROKEN  b (truth healthy): - -> hang[0]@3" in out
