"""bench/sensitivity_jobs.py: faultbench's injector puts a fault of a given
size into faultbench's plain DDP job, and the run is scored by the exact
culprit. Two real runs: a 1e-4 relative nudge of one weight matrix (its
norm moves by under 1e-6, below the norms' 1e-5 tolerance: only the bit checksum
sees it) and a learning rate 1 % off on one of 3 ranks."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import sensitivity_jobs  # noqa: E402


def _condition(family: str, magnitude: str):
    return next(c for c in sensitivity_jobs.CONDITIONS if c.family == family and c.magnitude == magnitude)


def test_a_small_nudge_and_a_small_learning_rate_change_are_named(tmp_path):
    nudge = sensitivity_jobs.run_one(_condition("weight_divergence", "1e-4"), 0, tmp_path)
    assert nudge["injected"] and nudge["detail"]["changed"] > 0, nudge
    assert nudge["named"], nudge
    assert nudge["world_size"] == 2  # seed 0: two replicas, no majority, both named
    assert nudge["verdicts"] == [{"kind": "weight_divergence", "ranks": [0, 1],
                                  "step": nudge["verdict_step"]}], nudge
    lr = sensitivity_jobs.run_one(_condition("learning_rate", "1.01"), 1, tmp_path)  # seed 1: 3 ranks
    assert lr["world_size"] == 3 and lr["injected"] and lr["detail"]["lr_factor"] == 1.01, lr
    assert lr["named"] and lr["exact"], lr


def test_the_table_scores_by_exact_culprit():
    rows = [{"family": "weight_divergence", "magnitude": "1e-3", "injected": True, "named": True, "rank": 1,
             "expected": "weight_divergence", "verdict_step": 7, "injected_step": 5,
             "verdicts": [{"kind": "weight_divergence", "ranks": [1], "step": 7}]},
            {"family": "weight_divergence", "magnitude": "1e-3", "injected": True, "named": False, "rank": 0,
             "expected": "weight_divergence", "verdict_step": None, "injected_step": 5,
             "verdicts": [{"kind": "weight_divergence", "ranks": [1], "step": 7}]}]
    (line,) = [x for x in sensitivity_jobs.table(rows) if x.startswith("| weight_divergence")]
    assert "1/2 = 0.50" in line and "| 1/1 | 2 |" in line and "weight_divergence [1]" in line
    assert "| – |" in line  # no elements-changed detail in these rows
    assert sensitivity_jobs.smallest(rows)[0] == "- weight_divergence: none of the sizes tried"
