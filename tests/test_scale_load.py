"""CI smoke test of bench/collector_load.py: a real standalone collector
(subprocess) fed by simulated nodes over HTTP names the frozen rank of a
hang. Relay mode starts cold and replays the messages recorded from a real
job (bench/data/node_reports.json.gz). Asserts the verdict and that every
rank was seen, never a time (the table in the closing note comes from the
full bench)."""

from __future__ import annotations

import importlib.util
import sys
from argparse import Namespace
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "collector_load.py"


def _bench():
    spec = importlib.util.spec_from_file_location("collector_load", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["collector_load"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["relay", "direct"])
def test_a_hang_among_simulated_ranks_is_named_by_a_real_collector(mode):
    bench = _bench()
    args = Namespace(mode=mode, server="aiohttp", measure=3.0, step_time=0.5, history=64, hang_timeout=6.0,
                     keep=False)
    result = bench.bench_one(48, args)
    assert result["errors"] == 0, result["error_samples"]
    assert result["accepted_per_s"] > 0 and result["ranks_seen"] == 48
    assert 0 <= result["tick_p50_s"] <= result["tick_p99_s"] <= result["tick_max_s"]  # the ticks' spread, measured
    assert not result["generator_failures"], result["generator_failures"]
    if mode == "relay":
        assert result["messages"] == "recorded" and result["all_seen_s"] is not None
    assert result["hang_verdict_after_s"] is not None, "no hang verdict"
    assert result["hang_named"], f"named {result['hang_ranks']}, frozen {result['culprit']}"
    assert "hang" not in result["verdicts_before_hang"], "no false alarm before the freeze"
