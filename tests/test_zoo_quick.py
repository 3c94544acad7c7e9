"""The zoo's CI slice (bench/zoo.py --quick): healthy jobs from real
libraries, each run under `rankwatch run` with default settings, must end
with zero verdicts. The slice holds the shapes that were false alarms
(a biased conv before BatchNorm: `broken_update`; dynamic padding: a new
input shape on most steps; uneven inputs under DDP's Join with Adam:
`collective_mismatch`, then `weight_divergence`), a mixture of experts with
unused experts, fp16 GradScaler with skipped steps and a GAN's two
optimizers; then the same verdicts and margins from `--reanalyze` (offline
analysis of the recorded runs). Costs about 125 s on 2 cores (6 runs of 40 steps, 2 ranks
each; join_uneven's first rank runs out of inputs at step 32)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _zoo():
    spec = importlib.util.spec_from_file_location("zoo_bench", ROOT / "bench" / "zoo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["zoo_bench"] = module
    spec.loader.exec_module(module)
    return module


def test_the_zoo_slice_is_healthy(tmp_path):
    pytest.importorskip("transformers")
    zoo = _zoo()
    work = tmp_path / "work"
    exit_code = zoo.main(["--quick", "--out", str(tmp_path), "--timeout", "240", "--work", str(work)])
    rows = zoo.load(tmp_path / "results.jsonl")
    assert sorted(r["job"] for r in rows) == sorted(zoo.QUICK)
    for row in rows:
        assert "failed" not in row, row
        assert row["steps"] >= zoo.QUICK_STEPS, row
        assert row["verdicts"] == [], (row["job"], row["verdicts"])
        margins = row["margins"]
        assert set(zoo.GRADED) <= set(margins), margins
        assert all(m["margin"] < 1.0 for m in margins.values()), (row["job"], margins)
    assert exit_code == 0
    # The table may be rebuilt from the recorded runs after the analyses
    # change (--reanalyze): offline analysis must give what the live
    # collector gave.
    assert zoo.main(["--reanalyze", "--out", str(tmp_path), "--work", str(work), "--no-docs"]) == 0
    again = {(r["job"], r["seed"]): r for r in zoo.load(tmp_path / "results.jsonl")}
    for row in rows:
        other = again[(row["job"], row["seed"])]
        assert "analyzed" in other and other["verdicts"] == row["verdicts"], (row["job"], other["verdicts"])
        assert {k: round(m["margin"], 2) for k, m in other["margins"].items() if m["graded"]} == \
            {k: round(m["margin"], 2) for k, m in row["margins"].items() if m["graded"]}, row["job"]


def test_the_table_lists_jobs_not_run_with_why():
    zoo = _zoo()
    text = zoo.table([{"job": "gan", "seed": 0, "steps_requested": 300, "ranks": 2, "trainer": "t", "torch": "2.13.0",
                       "libraries": {}, "elapsed_s": 1.0, "steps": 12, "exit_code": 1,
                       "failed": "trained 12 of 300 steps (exit 1)"}], 300, 2, [j.name for j in zoo.JOBS])
    gan = next(line for line in text.splitlines() if line.startswith("| gan |"))
    assert "**not run**" in gan and "trained 12 of 300" in gan
    vae = next(line for line in text.splitlines() if line.startswith("| vae |"))
    assert "not reached in this run" in vae
    assert "runs finished: 0" in text and "false alarms): **0**" in text
