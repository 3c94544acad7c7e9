"""How many objects Python's garbage collector must track for each heartbeat
the collector takes in: what its state keeps, and what the index journal
(collector/changes.py) keeps until the writer's next flush.

    python bench/retained_objects.py --ranks 100000 --nodes 1000

Every object that outlives a young collection is scanned again by the
middle one, and one that waits for a flush (up to a cadence) always does: at
100,000 ranks ~10,000 beats a second arrive, so each object kept per beat is
~10,000 more a second for the collections to walk. Node reports are replayed
from the recording of a real job (bench/collector_load.py's `Recorded`), two
cadences of --nodes nodes: the first makes the ranks known, the second is
counted with gc.get_objects() after full collections.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ingest_cost import _load_bench  # noqa: E402

from rankwatch.collector import codec, ingest  # noqa: E402
from rankwatch.collector.changes import Changes  # noqa: E402
from rankwatch.collector.state import RunState  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=100_000)
    parser.add_argument("--nodes", type=int, default=1_000, help="nodes (8 ranks each) replayed")
    parser.add_argument("--cadence", type=int, default=10, help="steps between two reports of a node")
    args = parser.parse_args()
    bench = _load_bench()
    recorded = bench.Recorded()
    job = bench.Job(args.ranks, 1.0, first_step=0, culprit=-1)
    job.started = time.time() - 10 * args.cadence

    def report(node: int, since: int) -> bytes:
        view, ranks = bench.node_prefix(job, node)
        beats = b",".join(b'{"version":1,"identity":' + job.identity[r]
                          + recorded.tail(r, since, since + args.cadence, job, False, 8) for r in ranks)
        return b'{"version":1,"sent_at":%.3f,"node":' % time.time() + view + b',"heartbeats":[' + beats + b"]}"

    run, changes = RunState(run_id="bench", world_size=args.ranks), Changes()

    def take_in(since: int) -> int:
        beats = 0
        for body in [report(node, since) for node in range(args.nodes)]:
            for hb in codec.loads_node_report(body, 1 << 24).heartbeats:
                ingest.heartbeat(run, hb, time.time(), changes)
                beats += 1
        return beats

    take_in(5 * args.cadence)  # every rank known
    changes.take()
    gc.collect()
    before = len(gc.get_objects())
    beats = take_in(6 * args.cadence)
    gc.collect()
    with_journal = len(gc.get_objects())
    changes.take()
    gc.collect()
    state_only = len(gc.get_objects())
    print(f"{beats} heartbeats of a {args.ranks}-rank job: tracked objects kept per beat: "
          f"{(with_journal - before) / beats:.1f} until the index flush "
          f"(state {(state_only - before) / beats:.1f}, journal {(with_journal - state_only) / beats:.1f})")


if __name__ == "__main__":
    main()
