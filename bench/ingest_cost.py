"""What one node report costs the collector to take in, by part.

    python bench/ingest_cost.py --ranks 10000 --reports 5000
    py-spy record -o ingest.svg -- python bench/ingest_cost.py    # the profile

Steady-state 8-rank node reports, replayed from the recording of a real job
(bench/data/node_reports.json.gz, see bench/collector_load.py's `Recorded`)
for a job of --ranks ranks, are handed to an in-process Collector exactly as
the HTTP route does (`Routes.handle`: decode, then `ingest_node_report`),
after one report per node has made every rank known. Each part is timed
around the real function (the timers' own cost, ~1 us a call, is in the
figures): decoding (JSON + typed checks), expanding step rows, the node view,
each rank's heartbeat (state, records, marks, events, fingerprints), the
index writes queued, the metrics. Printed: microseconds per report, per part
and in all, and the tick's cost at this size: the first (which also seals the
run's first steps: every rank's start-up facts) and a steady one.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import importlib.util
import random
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load_bench():
    spec = importlib.util.spec_from_file_location("collector_load", HERE / "collector_load.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["collector_load"] = module
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=10_000)
    parser.add_argument("--reports", type=int, default=4_000, help="steady reports timed")
    parser.add_argument("--no-parts", action="store_true", help="no per-part timers (the total alone, for py-spy)")
    parser.add_argument("--profile", metavar="FILE", help="cProfile the steady reports and the tick after them into FILE, "
                        "and the steady tick into FILE.steady-tick (pstats format; implies --no-parts)")
    args = parser.parse_args(argv)

    bench = _load_bench()
    from rankwatch.collector import codec, service
    from rankwatch.collector.server import Routes
    from rankwatch.collector.service import Collector
    from rankwatch.config import Config

    collector = Collector(Config(hang_timeout=30.0), data_dir=Path(tempfile.mkdtemp(prefix="rankwatch-ingest-")))
    routes = Routes(collector, None)
    recorded = bench.Recorded()
    job = bench.Job(args.ranks, 1.0, first_step=0, culprit=-1)
    job.started = time.time() - 100  # the job is 100 steps in
    nodes = args.ranks // bench.RANKS_PER_NODE
    interval = service.node_report_interval(args.ranks, 30.0) or 1.0
    stride = service.record_stride(args.ranks, 1.0) or 1

    def body(node: int, since, step: int) -> bytes:
        view, ranks = bench.node_prefix(job, node)
        beats = b",".join(b'{"version":1,"identity":' + job.identity[r]
                          + recorded.tail(r, since, step, job, False, stride) for r in ranks)
        return b'{"version":1,"sent_at":%.3f,"node":' % time.time() + view + b',"heartbeats":[' + beats + b"]}"

    # Every rank known (one report per node), as after a cold start, then one
    # steady report per node (its analyses' per-rank state made, as in a run
    # going for a while). Each round takes the nodes in a new order, as relays
    # at their own random offsets arrive (so each sealed step holds its ranks
    # in a new order, as live).
    rng = random.Random(0)

    def shuffled() -> list[int]:
        order = list(range(nodes))
        rng.shuffle(order)
        return order

    step = 100
    per_report = int(interval)
    started = time.perf_counter()
    for node in shuffled():
        routes.handle("POST", "/v1/node-report", body(node, None, step), lambda k: None)
    first = time.perf_counter() - started
    collector.tick(time.time())
    for node in shuffled():
        routes.handle("POST", "/v1/node-report", body(node, step, step + per_report), lambda k: None)
    step += per_report
    collector.tick(time.time())
    # The collector's own garbage-collection regime, as its loop sets it past
    # GC_MANUAL_RANKS (no automatic full collection; a full one, the survivors
    # frozen, every few minutes): here its first full collection after start-up.
    collector._collect_garbage(time.time())
    collector._gc_full_at = 0.0
    collector._collect_garbage(time.time())

    totals: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    counting = [True]  # the parts of the timed reports only (not the steady tick's own reports)

    def timed(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                if counting[0]:
                    totals[label] += time.perf_counter() - t0
                    calls[label] += 1

        setattr(owner, name, wrapper)

    if not (args.no_parts or args.profile):
        timed(codec, "loads_node_report", "decode (JSON + typed checks)")
        timed(service, "_expand_step_rows", "step rows -> records")
        timed(collector, "ingest_node", "node view")
        timed(collector, "ingest_heartbeat", "heartbeats (all of a rank's ingest)")
        # Ingest only notes what changed (collector/changes.py); the store's
        # writer thread queues it (timed here, not part of the request's time).
        timed(collector.store, "_take_changes", "writer thread: index queue (what ingest noted)")
        if collector.metrics is not None:
            timed(collector.metrics, "observe_heartbeat", "  of which: metrics")

    # Steady reports: each node reports the steps since its last one (the cadence's worth).
    bodies = []
    for i in range(args.reports):
        node = i % nodes
        last = step + per_report * (i // nodes)
        bodies.append(body(node, last, last + per_report))
    sizes = sorted(len(b) for b in bodies)
    profiler = None
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
    started = time.perf_counter()
    for raw in bodies:
        status = routes.handle("POST", "/v1/node-report", raw, lambda k: None)[0]
        assert status == 200, status
    total = time.perf_counter() - started
    collector.store.flush()  # what the writer thread still has to queue, counted in its lines
    counting[0] = False
    tick_started, tick_cpu_started = time.perf_counter(), time.thread_time()
    collector.tick(time.time())
    tick = time.perf_counter() - tick_started
    # The tick's own CPU (this thread's): its wall time also holds the hand-overs
    # to the HTTP thread between pieces of work (analyses/common.py `_yield`),
    # idle here, where no request is waiting.
    tick_cpu = time.thread_time() - tick_cpu_started
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    # That tick sealed the run's first steps too (every rank's start-up facts,
    # its first memory points), where it sealed any: a big job's steps are
    # sealed a few cadences late (the ranks' sampled records must be in), so
    # its start-up facts fall in the next tick. A steady tick: one more
    # cadence's reports of every node, then the tick sealing them, taken
    # after one such round (that round's tick seals what start-up left).
    steady_step = step + per_report * (args.reports // nodes)
    for round_ in range(2):
        for node in shuffled():
            routes.handle("POST", "/v1/node-report", body(node, steady_step, steady_step + per_report), lambda k: None)
        steady_step += per_report
        collector.store.flush()
        last = round_ == 1
        if args.profile and last:
            profiler = cProfile.Profile()
            profiler.enable()
        steady_started, steady_cpu_started = time.perf_counter(), time.thread_time()
        collector.tick(time.time())
        steady, steady_cpu = time.perf_counter() - steady_started, time.thread_time() - steady_cpu_started
        if not last:
            print(f"the next tick (seals what start-up left, if anything): {1000 * steady:.0f} ms, "
                  f"{1000 * steady_cpu:.0f} ms of CPU")
        if args.profile and last:
            profiler.disable()
            profiler.dump_stats(args.profile + ".steady-tick")
    n = len(bodies)
    print(f"{args.ranks} ranks, {n} steady 8-rank node reports (median {sizes[len(sizes) // 2]} bytes, "
          f"cadence {interval:g} s, stride {stride}): {1e6 * total / n:.0f} us per report in all "
          f"(Routes.handle, parts timed: {not (args.no_parts or args.profile)})")
    for label, seconds in totals.items():
        print(f"  {label:40s} {1e6 * seconds / n:8.1f} us per report ({calls[label] / n:.0f} calls)")
    sealed = per_report * (args.reports // nodes)
    print(f"tick after them (with the run's first steps): {1000 * tick:.0f} ms, {1000 * tick_cpu:.0f} ms of CPU (about {sealed} steps of "
          f"{args.ranks} ranks to seal: {1000 * tick / max(1, sealed):.0f} ms a step, "
          f"{1000 * tick_cpu / max(1, sealed):.0f} ms of CPU)")
    print(f"a steady tick: {1000 * steady:.0f} ms, {1000 * steady_cpu:.0f} ms of CPU ({per_report} steps: "
          f"{1000 * steady / per_report:.0f} ms a step, {1000 * steady_cpu / per_report:.0f} ms of CPU)")
    print(f"a node's first report (start-up facts: train config, fingerprints' names): "
          f"{1e6 * first / nodes:.0f} us")
    collector.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
