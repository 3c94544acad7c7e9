"""`python bench/faultbench.py --quick`: the runner, the injector, every tool's
reader and the scoring work end to end on real jobs (plain DDP, 3 ranks,
gloo). Asserts that the machinery works, not the benchmark's figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "faultbench.py"
sys.path.insert(0, str(ROOT / "bench"))

from faultbench import QUICK_KINDS  # noqa: E402


def test_quick_slice_writes_the_runs_the_table_and_the_plot(tmp_path):
    docs_before = (ROOT / "docs" / "benchmark.md").stat().st_mtime if (ROOT / "docs" / "benchmark.md").exists() else None
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert f"[1/{len(QUICK_KINDS)}" in proc.stdout and f"[{len(QUICK_KINDS)}/{len(QUICK_KINDS)}" in proc.stdout

    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert sorted(r["kind"] for r in runs) == sorted(QUICK_KINDS)
    by_kind = {r["kind"]: r for r in runs}
    for run in runs:
        assert {"rankwatch", "torchrun", "fr_trace"} <= set(run["tools"]), run["run_id"]
        if run["kind"] == "healthy":
            assert run["rank"] is None
            assert run["tools"]["torchrun"]["exit_code"] == 0, run["run_id"]
            assert run["tools"]["rankwatch"]["exit_code"] == 0, run["run_id"]
            assert run["tools"]["torchrun"]["injected"] is None
            continue
        # The injector fired the planned fault, on the planned rank and step, in both runs.
        for tool in ("rankwatch", "torchrun"):
            injected = run["tools"][tool]["injected"]
            assert injected, f"{run['run_id']}: no injection recorded under {tool}"
            assert (injected["kind"], injected["rank"], injected["step"]) == (run["kind"], run["rank"], run["step"])
            assert injected["time"] > run["tools"][tool]["started_at"]

    # Readers: torchrun's "Root Cause" of an exception is the rank that raised.
    crash = by_kind["crash"]
    assert crash["tools"]["torchrun"]["exit_code"] != 0
    assert [v["ranks"] for v in crash["tools"]["torchrun"]["verdicts"]] == [[crash["rank"]]]
    # rankwatch's report is read (whatever it says, it is a list of verdicts with times).
    for run in runs:
        for v in run["tools"]["rankwatch"]["verdicts"]:
            assert v["kind"] and isinstance(v["ranks"], list) and v["time"] > 0
    # fr_trace ran where the plain job failed, over dumps from every rank that lived to write one.
    assert crash["tools"]["fr_trace"]["ran"] and crash["tools"]["fr_trace"]["dump_ranks"]
    assert not by_kind["healthy"]["tools"]["fr_trace"]["ran"]

    text = (tmp_path / "benchmark.md").read_text()
    assert "Machine:" in text and "| fault | expected verdict | tool |" in text and "## Headline" in text
    assert "crash" in text and "rankwatch" in text
    assert (tmp_path / "time_to_verdict.png").stat().st_size > 1000
    docs_after = (ROOT / "docs" / "benchmark.md").stat().st_mtime if (ROOT / "docs" / "benchmark.md").exists() else None
    assert docs_before == docs_after, "--quick must not rewrite docs/benchmark.md"
