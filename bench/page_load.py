"""What a run's page costs: its size, the time to make it, and the time
Chromium takes to load and draw it, at 8, 1,024 and 100,000 ranks.

    python bench/page_load.py                      # the table (8, 1,024, 100,000 ranks)
    python bench/page_load.py --ranks 8 1024 --repeat 5 --json
    python bench/page_load.py --keep DIR           # keep the pages (open them in a browser)

The pages are made from synthetic run states shaped like the collector's
(`RunState`, the same per-rank step windows the collector keeps at that size:
256 steps up to 3,906 ranks, 10 at 100,000), with a hang on one rank: its
bundles' evidence on the ranks a hang incident asks (every rank up to 256,
else suspects and references), stacks, Flight Recorder sequence numbers and
a verdict like the real one. Load time is what a person waits for: from
navigation until the page is drawn (the page script has drawn every chart
and the heat map: `data-rw-ready`), in Debian's Chromium, headless, opened
from file:// with every network request refused. Targets (issue 19): 8 ranks
under 1 s; 100,000 ranks under 3 s and under 10 MB.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RANKS = (8, 1024, 100_000)
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
TRAIN = "/work/job/train.py"
WAIT_FRAMES = [
    {"file": "/usr/lib/python3/runpy.py", "line": 88, "name": "_run_code", "code": "exec(code, run_globals)"},
    {"file": TRAIN, "line": 120, "name": "<module>", "code": "main()"},
    {"file": TRAIN, "line": 101, "name": "main", "code": "loss.backward()"},
    {"file": "/site-packages/torch/_tensor.py", "line": 647, "name": "backward",
     "code": "torch.autograd.backward("},
    {"file": "/site-packages/torch/autograd/__init__.py", "line": 354, "name": "backward",
     "code": "_engine_run_backward("},
    {"file": "/site-packages/torch/autograd/graph.py", "line": 829, "name": "_engine_run_backward",
     "code": "return Variable._execution_engine.run_backward("},
]
STUCK_FRAMES = WAIT_FRAMES[:2] + [
    {"file": TRAIN, "line": 94, "name": "main", "code": "time.sleep(3600)  # stuck in compute before the backward"},
]


def synthetic(world: int, culprit: int | None = None, seed: int = 0):
    """A RunState of ``world`` ranks, stuck at a hang of ``culprit``, and its report."""
    from rankwatch import wire
    from rankwatch.collector.analyses.common import iso
    from rankwatch.collector.evidence import CollectiveEntry, RankEvidence
    from rankwatch.collector.state import Incident, RunState, step_window

    rnd = random.Random(seed)
    culprit = world // 2 + 1 if culprit is None else culprit
    run = RunState(run_id=f"synthetic-{world}", world_size=world, started_at=1_700_000_000.0)
    steps = step_window(world)
    last = 400
    t0 = run.started_at
    for rank in range(world):
        state = run.rank(rank)
        state.host = f"node{rank // 8:05d}"
        state.node_rank = rank // 8
        state.local_rank = rank % 8
        state.pid = 1000 + rank
        slow = 1.0 + (0.02 * rnd.random())
        for step in range(last - steps, last):
            start = t0 + step * 0.5
            compute = 0.3 * slow * (1.4 if rank == culprit and step > last - 30 else 1.0)
            state.add_step(wire.StepRecord(
                step=step, started_at=start, ended_at=start + 0.5, forwards=step + 1, compute_s=compute,
                data_s=0.01, loss=2.0 * (0.999 ** step) + 0.01 * rnd.random(),
                grad_norm=1.0 + 0.1 * rnd.random(), nonfinite_grads=0, grad_check_stride=1,
                rss_bytes=2_000_000_000 + step * 1000 + rank, device_allocated_bytes=None))
        state.step = last if rank != culprit else last - 1
        state.phase = "backward" if rank != culprit else "forward"
        state.enqueued = {"0": 5 * last + 1 if rank != culprit else 5 * last}
        state.completed = {"0": 5 * last}
    incident = Incident(id="hang-1", kind="hang", opened_at=t0 + last * 0.5 + 30, last_progress_at=t0 + last * 0.5,
                        ready=True)
    asked = list(range(world)) if world <= 256 else sorted({culprit, *range(8)})
    incident.requested_ranks = asked
    for rank in asked:
        stuck = rank == culprit
        enq = 5 * last if stuck else 5 * last + 1
        ev = RankEvidence(rank=rank, reason="hang", created_at=incident.opened_at + 1, source="agent",
                          host=run.ranks[rank].host, step=run.ranks[rank].step,
                          stacks=[{"name": "MainThread", "main": True,
                                   "frames": STUCK_FRAMES if stuck else WAIT_FRAMES}],
                          pg_enqueued={"0": enq}, pg_completed={"0": 5 * last},
                          bundle_path=f"/data/runs/synthetic-{world}/bundles/hang-1/rank-{rank:05d}.tar.gz",
                          members=["manifest.json", "stacks.json", "collectives.json", "flight_recorder.json",
                                   "metrics.json", "env.json", "memory.json", "runtime.json"])
        ev.collectives = [CollectiveEntry(pg="0", seq=s, op="allreduce", input_sizes=[[1024 * 256]],
                                          input_dtypes=["Float"], created_ns=0, retired=s <= 5 * last)
                          for s in range(enq - 12, enq + 1)]
        run.ranks[rank].evidence["hang-1"] = ev
    run.incidents.append(incident)
    others = [r for r in range(world) if r != culprit]
    evidence = {
        "ranks": {str(r): {"step": run.ranks[r].step, "phase": run.ranks[r].phase,
                           "collective_seq": dict(run.ranks[r].enqueued), "exited": False,
                           "where": "train.py:94 in main (time.sleep(3600))" if r == culprit
                           else "train.py:101 in main (loss.backward()) -> autograd/graph.py:829"}
                  for r in sorted(set(asked) | set(range(min(world, 64))))},
        "waiting_at": {"0": 5 * last + 1}, "incident": "hang-1",
        "hosts": {str(culprit): run.ranks[culprit].host}, "hang_timeout_s": 20.0, "stalled_for_s": 30.0,
        "reason": f"never reached collective #{5 * last + 1} of process group 0",
        "culprit_stack": STUCK_FRAMES, "consequences": []}
    if world > 256:
        evidence["ranks_total"] = world
    summary = (f"Rank {culprit} never reached collective #{5 * last + 1} of process group 0; its main thread is at "
               f"train.py:94 in main (time.sleep(3600)) (step {last - 1}, phase forward). "
               f"{len(others)} ranks wait for it.")
    verdict = wire.Verdict(kind="hang", ranks=[culprit], step=last - 1, first_seen_at=iso(incident.last_progress_at),
                           detected_at=iso(incident.opened_at + 2), summary=summary, evidence=evidence)
    report = wire.Report(run_id=run.run_id, world_size=world, status="faulty", verdicts=[verdict])
    run.finished = True
    return run, report


def make_page(world: int, out_dir: Path) -> dict:
    from rankwatch.outputs import html

    started = time.perf_counter()
    run, report = synthetic(world)
    built = time.perf_counter()
    path = html.write(report, out_dir / f"page-{world}.html", run, argv=["rankwatch", "run", "train.py"], env={})
    made = time.perf_counter()
    return {"ranks": world, "path": str(path), "bytes": path.stat().st_size, "state_s": round(built - started, 2),
            "render_s": round(made - built, 2)}


def load_times(paths: list[str], repeat: int) -> dict[str, list[float]]:
    """Navigation start until the page script has drawn everything, per page."""
    from playwright.sync_api import sync_playwright

    out: dict[str, list[float]] = {p: [] for p in paths}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            for _ in range(repeat):
                for path in paths:
                    context = browser.new_context(viewport={"width": 1400, "height": 900})
                    page = context.new_page()
                    errors: list[str] = []
                    page.on("pageerror", lambda exc: errors.append(str(exc)))
                    page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                               else route.abort())
                    started = time.perf_counter()
                    page.goto(Path(path).as_uri(), wait_until="load")
                    page.wait_for_selector("html[data-rw-ready]", state="attached", timeout=60_000)
                    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
                    out[path].append(time.perf_counter() - started)
                    if errors:
                        raise RuntimeError(f"{path}: page errors: {errors}")
                    context.close()
        finally:
            browser.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    parser.add_argument("--repeat", type=int, default=3, help="loads per page (the median is reported)")
    parser.add_argument("--keep", default=None, help="write the pages to this folder and keep them")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.keep or tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        rows = [make_page(n, out_dir) for n in args.ranks]
        times = load_times([r["path"] for r in rows], args.repeat)
        for row in rows:
            row["load_s_median"] = round(statistics.median(times[row["path"]]), 3)
            row["load_s_max"] = round(max(times[row["path"]]), 3)
            row["mb"] = round(row["bytes"] / 1e6, 2)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'ranks':>8} {'page MB':>8} {'load s (median)':>16} {'load s (max)':>13} {'render s':>9}")
    for row in rows:
        print(f"{row['ranks']:>8} {row['mb']:>8} {row['load_s_median']:>16} {row['load_s_max']:>13} "
              f"{row['render_s']:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
