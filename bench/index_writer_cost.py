"""What the collector's index writer costs per cadence of a big job.

    python bench/index_writer_cost.py                   # 100,000 ranks, 6 cadences
    python bench/index_writer_cost.py --ranks 10000 --cadences 10

One cadence of a job at a step a second: every rank's heartbeat with the
cadence's step records, collective marks (every 5th step, the agent's
default) and weight fingerprints (every 10th step), each as a node relay
forwards them at this size (every `record_stride`-th, the relay's own
`StepSampler`; --unthinned: every mark and print), queued as the writer
thread queues what ingest noted (`Store._queue_beat`), then one bulk flush
(`Store._flush_once`: encoding, SQLite). Printed per cadence: the CPU
of the queueing and of the flush, in this thread (no writer thread runs:
nothing else shares the interpreter). A bulk flush writes at most
RANK_ROWS_PER_BULK ranks' rows, those waiting longest first, so a rank's
row is written every BULK_INTERVAL x ranks / RANK_ROWS_PER_BULK seconds.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rankwatch import wire
from rankwatch.collector.changes import BeatData
from rankwatch.collector.service import NEVER, record_stride
from rankwatch.collector.state import RunState
from rankwatch.collector.store import Store
from rankwatch.node.relay import StepSampler

MARK_EVERY = 5  # the agent's collective_mark_every default
PRINT_EVERY = 10  # the agent's fingerprint_every default
PARAMETERS = 6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=100_000)
    parser.add_argument("--cadences", type=int, default=6)
    parser.add_argument("--cadence", type=int, default=10, help="steps per cadence (a step a second)")
    parser.add_argument("--unthinned", action="store_true",
                        help="every mark and fingerprint (relays before they thinned them)")
    args = parser.parse_args(argv)

    # The store's own writer thread sleeps through the bench (it would take
    # the queues itself between two of the bench's flushes, whose CPU then
    # read 0 ms while the queueing's held the writer's; process_time counts
    # every thread).
    store = Store(Path(tempfile.mkdtemp(prefix="rankwatch-writer-")) / "index.sqlite", flush_interval=3600.0)
    run = RunState("big", world_size=args.ranks)
    store.save_run(run)
    stride = record_stride(args.ranks, 1.0) or 1
    names = [f"layer{i}.weight" for i in range(PARAMETERS)]
    identities = [wire.RankIdentity(run_id="big", rank=r, local_rank=r % 8, world_size=args.ranks)
                  for r in range(args.ranks)]
    samplers = [StepSampler() for _ in range(0, args.ranks, 8)]  # a relay per node of 8 ranks
    for sampler in samplers:
        sampler.stride = 1 if args.unthinned else stride
    # The collector of a job this size collects only the youngest generation
    # on its own (service.GC_MANUAL_RANKS): the bench's own 100,000 states and
    # beats are frozen, and its full collections left out, as there.
    gc.collect()
    gc.freeze()
    gc.set_threshold(gc.get_threshold()[0], NEVER, NEVER)
    queued, flushed = [], []
    for cadence in range(args.cadences):
        first = 100 + cadence * args.cadence
        steps = range(first, first + args.cadence)
        t0 = time.process_time()
        with store._pending_lock:
            for r, identity in enumerate(identities):
                forwarded = samplers[r // 8].sample(r, {
                    "marks": [{"step": s, "seqs": {"0": 3 * s + 1}} for s in steps if s % MARK_EVERY == 0],
                    "fingerprints": [{"step": s, "names": names, "norms": [1.0 + r * 1e-9, 2.0, 3.0, 0.5, 0.25, 0.125]}
                                     for s in steps if s % PRINT_EVERY == PRINT_EVERY - 1]})
                beat = wire.Heartbeat(
                    identity=identity, sent_at=time.time(), step=steps[-1] + 1,
                    steps=[wire.StepRecord(step=s, started_at=1e9 + s, ended_at=1e9 + s + 0.9, loss=0.5,
                                           grad_norm=1.2) for s in steps if s % stride == 0],
                    marks=[wire.CollectiveMark(m["step"], m["seqs"]) for m in forwarded["marks"]])
                store._queue_beat(BeatData("big", r, identity.world_size, beat.steps, beat.marks, beat.events,
                                           forwarded["fingerprints"]))
                state = run.rank(r)  # its row waits for a bulk write, as ingest notes it
                state.step, state.completed = steps[-1] + 1, {"0": 3 * steps[-1] + 1}
                store._ranks[("big", r)] = state
        t1 = time.process_time()
        waiting = len(store._ranks)
        store._flush_once(bulk=True, everything=False)
        t2 = time.process_time()
        queued.append(t1 - t0)
        flushed.append(t2 - t1)
        print(f"cadence {cadence}: queue {1000 * (t1 - t0):.0f} ms (with building the beats and the relays' sampling), "
              f"flush {1000 * (t2 - t1):.0f} ms of CPU ({waiting - len(store._ranks)} ranks' rows)")
    t0 = time.process_time()
    with store._pending_lock:
        store._ranks.update((("big", r), run.rank(r)) for r in range(args.ranks))
    store._flush_once(bulk=True, everything=True)
    every_row = time.process_time() - t0
    store.close()
    print(f"{args.ranks} ranks, {args.cadence} steps a cadence (records every {stride}, marks and prints "
          f"{'all' if args.unthinned or stride == 1 else f'every {stride}th'}): median flush "
          f"{1000 * statistics.median(flushed):.0f} ms, median queue {1000 * statistics.median(queued):.0f} ms "
          f"of CPU a cadence, max flush {1000 * max(flushed):.0f} ms; a flush of every rank's row (a stop's) "
          f"{1000 * every_row:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
