"""What the collector's analyses cost, by job size N (ranks) and run length S
(steps seen): one tick (hang watch + running summaries updated with one new
step of every rank + every analysis), one analysis pass alone (what runs under
the ingest lock), one /metrics rendering, and the memory per rank.

    python bench/analysis_cost.py                       # the whole table (minutes)
    python bench/analysis_cost.py --ranks 8 256 --steps 100 2048
    python bench/analysis_cost.py --cell 1024 2048      # one cell, JSON

Each cell runs in its own process (RSS per cell). The records are realistic
(compute and data time, loss, local gradient norm, RSS, collective marks)
and go through the same path as live ingest (`RankState.add_step`, the run's
feed, `Collector.tick`), without HTTP or the index (bench/collector_load.py
measures those).

A run of S steps is streamed in full when N x S is at most --full-records;
beyond that only its last steps are streamed, numbered as the end of an
S-step run ("tail" in the table): --tail steps, or more until every per-rank
window is full (records, collective marks, analysis windows), i.e. the
steady state that a run of any length stays in
(tests/test_analyses_incremental.py checks that the memory after 20,000 steps
is the memory after 2,000).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RANKS = (8, 256, 1024, 16_000, 100_000)
STEPS = (100, 2048, 100_000)
HEARTBEAT_STEPS = 10  # steps per heartbeat batch while streaming (the analyses run after each batch)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cell(n: int, s: int, full_records: int, tail: int) -> dict:
    from rankwatch import wire
    from rankwatch.collector import analyses
    from rankwatch.collector.analyses.common import settle
    from rankwatch.collector.metrics import CollectorMetrics
    from rankwatch.collector.service import Collector
    from rankwatch.collector.state import mark_window, step_window
    from rankwatch.config import Config

    rnd = random.Random(n * 7919 + s)
    full = n * s <= full_records
    # Long enough for every window to fill (the steady state of a run of any length).
    tail = max(tail, step_window(n) + 8, 5 * mark_window(n) + 8)
    first = 0 if full else max(0, s - tail)
    collector = Collector(config=Config())
    metrics = CollectorMetrics(collector)
    t0 = time.time() - s  # one step a second, ending now
    gc.collect()
    rss_before = _rss_bytes()
    with collector._lock:
        run = collector._run("bench", n)
    rt = collector._runtime("bench")
    noise = [0.9 + 0.2 * rnd.random() for _ in range(1024)]
    jitter = [rnd.random() for _ in range(1024)]

    def add_step(step: int) -> None:
        at = t0 + step
        for rank in range(n):
            j = (rank * 31 + step) % 1024
            state = run.ranks.get(rank) or run.rank(rank)
            state.add_step(wire.StepRecord(
                step=step, started_at=at, ended_at=at + 0.5, forwards=1, compute_s=0.2 * noise[j],
                data_s=0.01 * jitter[j], loss=2.0 - step * 1e-5 + 0.01 * jitter[j], grad_norm=1.0 + 0.1 * noise[j],
                rss_bytes=(2 << 30) + (j << 12)))
            if step % 5 == 0:  # the agent's collective marks (every 5th step)
                state.marks[step] = {"0": 2 * step + 1}
            state.step = step + 1
            state.last_heartbeat_at = at + 0.5
            state.last_progress_at = at + 0.5
        run.max_step = step + 1
        run.ranks_reported = n
        run.last_progress_seen_at = at + 0.5

    build_started = time.process_time()
    for step in range(first, s - 1):
        add_step(step)
        if step == first:
            collector._collect_garbage(t0 + step)  # the live collector's garbage-collection policy for N ranks
        if (step + 1) % HEARTBEAT_STEPS == 0:
            settle(run)
    settle(run)
    build_cpu = time.process_time() - build_started
    gc.collect()
    rss_after = _rss_bytes()

    # One tick: one new step from every rank, then hang watch + summaries + analyses.
    add_step(s - 1)
    rt.dirty, rt.analysed_at = True, 0.0
    now = t0 + s
    began = time.perf_counter()
    collector.tick(now)
    collector._collect_garbage(now)  # as the collector's loop does after each tick
    tick_s = time.perf_counter() - began
    # The analysis pass alone (under the ingest lock), nothing new to take in.
    began = time.perf_counter()
    with collector._lock:
        verdicts = analyses.run_all(run, now, False)
    pass_s = time.perf_counter() - began
    began = time.perf_counter()
    text = metrics.text(now)
    metrics_s = time.perf_counter() - began
    began = time.perf_counter()
    gc.collect()  # a full collection: every FULL_GC_INTERVAL past GC_MANUAL_RANKS, else Python's own schedule
    full_gc_s = time.perf_counter() - began
    return {
        "ranks": n, "steps": s, "streamed": s - 1 - first + 1, "mode": "full" if full else "tail",
        "tick_ms": tick_s * 1e3, "pass_ms": pass_s * 1e3, "metrics_ms": metrics_s * 1e3, "full_gc_ms": full_gc_s * 1e3,
        "metrics_lines": text.count("\n"), "verdicts": [v.kind for v in verdicts],
        "kib_per_rank": max(0, rss_after - rss_before) / n / 1024, "build_cpu_s": build_cpu,
        "step_window": run.ranks[0].window,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    parser.add_argument("--steps", type=int, nargs="+", default=list(STEPS))
    parser.add_argument("--full-records", type=int, default=2_500_000,
                        help="stream a run in full up to this many records (ranks x steps)")
    parser.add_argument("--tail", type=int, default=64, help="steps streamed otherwise")
    parser.add_argument("--cell", type=int, nargs=2, metavar=("RANKS", "STEPS"), help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="one JSON line per cell")
    a = parser.parse_args()
    if a.cell:
        print(json.dumps(cell(a.cell[0], a.cell[1], a.full_records, a.tail)))
        return
    rows = []
    header = (f"{'ranks':>7} {'steps':>7} {'streamed':>13} {'tick ms':>9} {'pass ms':>9} {'/metrics ms':>11} "
              f"{'full GC ms':>10} {'KiB/rank':>9} {'verdicts':>8}")
    print(header)
    print("-" * len(header))
    for n in a.ranks:
        for s in a.steps:
            out = subprocess.run([sys.executable, __file__, "--cell", str(n), str(s), "--full-records",
                                  str(a.full_records), "--tail", str(a.tail)], capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{n:>7} {s:>7} failed: {out.stderr.strip().splitlines()[-1:]}", flush=True)
                continue
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            if a.json:
                print(json.dumps(row), flush=True)
                continue
            streamed = f"{row['streamed']} ({row['mode']})"
            print(f"{n:>7} {s:>7} {streamed:>13} {row['tick_ms']:>9.1f} {row['pass_ms']:>9.1f} "
                  f"{row['metrics_ms']:>11.1f} {row['full_gc_ms']:>10.1f} {row['kib_per_rank']:>9.2f} "
                  f"{len(row['verdicts']):>8}", flush=True)


if __name__ == "__main__":
    main()
