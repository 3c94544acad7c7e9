"""Helpers shared by the analyses: verdict construction, stack reading."""

from __future__ import annotations

import collections
import datetime as _dt
import itertools
import operator
import os
import re
import statistics
import time
from typing import Any, Iterable, Optional

import numpy as np

from rankwatch import wire

from ..memo import PerObject
from ..state import DURATIONS_KEPT, percentile

# Frames in these files are torch's or Python's machinery; the user's code is elsewhere.
_MACHINERY = (
    f"{os.sep}torch{os.sep}",
    # rankwatch installed as a package (on any host); a user's own folder that
    # is merely called "rankwatch" is not machinery (see _OWN_DIRS)
    f"site-packages{os.sep}rankwatch{os.sep}",
    f"dist-packages{os.sep}rankwatch{os.sep}",
    "<frozen ",
    f"{os.sep}runpy.py",
    f"{os.sep}threading.py",
)

_WAIT_MARKERS = (
    ("torch/distributed/", "collective"),
    ("torch/nn/parallel/distributed.py", "DDP"),
    ("torch/autograd/", "backward"),
    ("torch/_tensor.py", "backward"),
)


def iso(t: Optional[float]) -> str:
    t = time_or_now(t)
    return _dt.datetime.fromtimestamp(t, tz=_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def time_or_now(t: Optional[float]) -> float:
    import time

    return t if t else time.time()


def verdict(kind: str, ranks: Iterable[int], step: Optional[int], first_seen: Optional[float],
            detected: Optional[float], summary: str, evidence: dict[str, Any]) -> wire.Verdict:
    assert kind in wire.VERDICT_KINDS, kind
    culprits = sorted(set(int(r) for r in ranks))
    return wire.Verdict(
        kind=kind,
        ranks=culprits,
        step=step,
        first_seen_at=iso(first_seen),
        detected_at=iso(detected),
        summary=summary,
        evidence=evidence,
        id=wire.verdict_id(kind, step, culprits),
    )


# The standard library (not site-packages): select(), queue.get() and the like
# are where a stuck rank waits, not where its bug is.
_STDLIB = re.compile(r"[\\/]lib[\\/]python3\.\d+[\\/](?!site-packages|dist-packages)")


def _own_dirs() -> tuple[str, ...]:
    """The real folders of this rankwatch: the package, and agent/ and
    collector/ (in a source checkout they sit next to rankwatch/)."""
    import rankwatch

    here = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # collector/
    return tuple(sorted({os.path.dirname(os.path.realpath(rankwatch.__file__)) + os.sep, here + os.sep,
                         os.path.join(os.path.dirname(here), "agent") + os.sep}))


_OWN_DIRS = _own_dirs()


def is_machinery(filename: str) -> bool:
    return (any(marker in filename for marker in _MACHINERY) or bool(_STDLIB.search(filename))
            or filename.startswith(_OWN_DIRS))


def user_frame(frames: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The innermost frame of the user's code (frames are outermost first)."""
    for frame in reversed(frames):
        if not is_machinery(str(frame.get("file", ""))):
            return frame
    return None


def innermost(frames: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    return frames[-1] if frames else None


def where(frames: list[dict[str, Any]]) -> str:
    """'train.py:41 in train_step -> time.sleep' style location."""
    frame = user_frame(frames)
    inner = innermost(frames)
    if frame is None and inner is None:
        return "unknown location"
    text = ""
    if frame is not None:
        text = f"{os.path.basename(str(frame.get('file')))}:{frame.get('line')} in {frame.get('name')}"
        code = str(frame.get("code") or "").strip()
        if code:
            text += f" ({code[:80]})"
    if inner is not None and inner is not frame:
        inner_text = f"{_short(str(inner.get('file')))}:{inner.get('line')} {inner.get('name')}"
        text = f"{text} -> {inner_text}" if text else inner_text
    return text


def waits_in_collective(frames: list[dict[str, Any]]) -> bool:
    """A main-thread stack parked in torch.distributed / DDP / backward (waiting for peers)."""
    for frame in frames[-12:]:
        name = str(frame.get("file", "")).replace(os.sep, "/")
        if any(marker in name for marker, _ in _WAIT_MARKERS):
            return True
    return False


_WORKER_WAITS = ("_try_get_data", "_get_data")  # the multi-process DataLoader iterator's waits


def in_dataloader(frames: list[dict[str, Any]]) -> bool:
    """The main thread waits for a DataLoader *worker process*. A Dataset read
    running in the main process (num_workers=0) also passes through
    torch/utils/data, but it is the rank's own code at work, not a wait."""
    return any(f.get("name") in _WORKER_WAITS and "torch/utils/data/" in str(f.get("file", "")).replace(os.sep, "/")
               for f in frames[-15:])


def dataloader_worker_frame(workers: list[dict[str, Any]]) -> Optional[tuple[int, list[dict[str, Any]]]]:
    """(pid, frames) of the DataLoader worker busy in the user's code: the
    frames below torch's `_worker_loop` whose innermost user frame is the
    stuck line (a read in `__getitem__`, a transform). Idle workers, waiting
    for an index in the worker loop itself, have no user frame there."""
    for worker in workers:
        for thread in worker.get("threads") or []:
            if not thread.get("main"):
                continue
            frames = thread.get("frames") or []
            loop = next((i for i, f in enumerate(frames) if f.get("name") == "_worker_loop"
                         and "torch/utils/data/" in str(f.get("file", "")).replace(os.sep, "/")), None)
            if loop is None:
                continue
            below = frames[loop + 1:]
            if user_frame(below) is not None:
                return int(worker.get("pid") or 0), below
    return None


def _short(path: str) -> str:
    parts = path.replace(os.sep, "/").split("/")
    if "torch" in parts:
        return "/".join(parts[parts.index("torch"):])
    return os.path.basename(path)


def located(run, ranks: Iterable[int]) -> str:
    """'rank 3 (host a, node 1)': where the culprit runs, for multi-node jobs."""
    ranks = sorted(ranks)
    places = []
    for r in ranks[:4]:
        state = run.ranks.get(r)
        if state is not None and state.host:
            places.append(f"rank {r} on {state.host}" + (f" node {state.node_rank}" if state.node_rank else ""))
    return "; ".join(places)


def verb(ranks, singular: str, plural: str) -> str:
    """'holds' for one rank, 'hold' for several."""
    return singular if len(list(ranks)) == 1 else plural


def ranks_text(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 8:
        return f"{len(ranks)} ranks ({', '.join(map(str, ranks[:8]))}, ...)"
    return "ranks " + ", ".join(map(str, ranks))


def majority(values: dict[int, Any]) -> tuple[Any, list[int]]:
    """(most common value, ranks that differ from it). Ties: no minority."""
    counts: dict[Any, int] = {}
    for value in values.values():
        counts[value] = counts.get(value, 0) + 1
    if not counts:
        return None, []
    best = max(counts.values())
    winners = [v for v, c in counts.items() if c == best]
    if len(winners) > 1:
        return None, []
    value = winners[0]
    return value, sorted(r for r, v in values.items() if v != value)


# -- running summaries -------------------------------------------------------------
#
# The analyses never rescan history. Everything a rank sends is queued on the
# run's feed (state.py); `settle` drains it into each analysis' tracker:
#   on_nonfinite(run, records)     the step records taken in by one settle whose
#                                  loss or gradients are not finite, as
#                                  [(rank, record)] in arrival order (ingest
#                                  picks them: a pass over every record cost
#                                  ~0.1 s a 100,000-rank tick)
#   on_event(run, rank, event)     every event, per rank in arrival order
#   on_mark(run, rank, mark)       every collective mark, (step, seqs)
#   on_step(run, step, records)    a sealed step: {rank: record}, steps in order
#   on_prints(run, step, prints)   a sealed fingerprint step: {rank: fingerprint}
# A step is sealed once every live rank has sent a later one (records of a
# rank arrive in order), so live and offline (`rankwatch analyze`, which feeds
# the whole run at once) see the same steps with the same records and reach
# the same verdicts. Cross-rank work happens once per sealed step: O(ranks).

# The live collector settles on its analysis thread while its HTTP thread
# serves the ingest: a long pass (a sealed step of 100,000 ranks) hands the
# interpreter over between pieces of work, so requests are not held behind it.
YIELD_EVERY = 2_000  # feed items between two chances to hand over


YIELD_RANKS = 2_000  # ranks of a sealed step between two chances to hand over (~1-2 ms of work)
YIELD_AFTER_S = 0.01  # ... taken once this long has passed since the last hand-over

_handed_over_at = 0.0


def _yield() -> None:
    # Off the interpreter for a moment, not just a release (a bare release is
    # taken back one switch interval later): queued requests go first. At most
    # once per YIELD_AFTER_S: getting the interpreter back costs a switch
    # interval (5 ms) or more while the ingest thread is busy, and the hang
    # watch runs on the same thread. A 100,000-rank tick beside a busy ingest
    # thread took 10.7-12.5 s of wall this way, 13.6-14.0 s with a hand-over
    # every 1-2 ms of work (the same work: ~6-7 s of the tick thread's CPU).
    global _handed_over_at
    if time.perf_counter() - _handed_over_at < YIELD_AFTER_S:
        return
    time.sleep(0.0005)
    _handed_over_at = time.perf_counter()


def paced(items: Iterable) -> Iterable:
    """`items` (a sealed step's ranks), handing the interpreter over every
    YIELD_RANKS of them: a 100,000-rank step takes ~0.3 s of work. Taken as
    a list first (a snapshot: other threads run during the hand-overs), then
    walked in chunks, so the per-item walk is C's (a generator resumed per
    item cost ~10 % of a 10,000-rank tick)."""
    items = items if type(items) is list else list(items)
    if len(items) <= YIELD_RANKS:
        return items

    def chunks():
        for start in range(0, len(items), YIELD_RANKS):
            if start:
                _yield()
            yield items[start:start + YIELD_RANKS]

    return itertools.chain.from_iterable(chunks())


SEAL_LAG = 2  # steps: a GPU rank fills a step's loss and norm a step late
PENDING_RECORDS = 1_000_000  # records held for sealing, at most (then the oldest step is sealed)
MIN_PENDING_STEPS = 64
PENDING_PRINTS = 4  # fingerprint steps held for sealing

TRACKERS: dict[str, Any] = {}  # name -> factory, registered by the analysis modules


def register_tracker(name: str, factory) -> None:
    TRACKERS[name] = factory


# Margins: how close each check's statistic came to firing, at its worst moment of
# the run (statistic / what firing needs; 1.0 = it fired). Kept per check as the
# largest seen, with its step and rank (report.json `margins`, docs/contract.md).
MARGINS = "_margins"


def note_margin(run, check: str, margin: float, step: int, rank: Optional[int]) -> None:
    """Keep ``margin`` for ``check`` when it is the largest so far. Below 1.0
    unless the check fired: the caller passes the statistic of a step that
    did not fire, so it is kept just under 1.0 at most."""
    if not margin > 0:
        return
    margins = run.trackers.get(MARGINS)
    if margins is None:
        margins = run.trackers[MARGINS] = {}
    worst = margins.get(check)
    if worst is None or margin > worst["margin"]:
        margins[check] = {"margin": min(float(margin), 0.999), "step": step, "rank": rank}


def margins(run) -> dict[str, dict]:
    return dict(run.trackers.get(MARGINS) or {})


def tracker(run, name: str):
    """The analysis' running summary for this run (created on first use)."""
    found = run.trackers.get(name)
    if found is None:
        found = run.trackers[name] = TRACKERS[name]()
    return found


class _Sealer:
    def __init__(self) -> None:
        self.pending: dict[int, dict[int, Any]] = {}
        self.frontier: dict[int, int] = {}
        self.sealed_upto = -1
        self.prints: dict[int, dict[int, dict[int, dict]]] = {}  # step -> model -> rank -> print
        self.print_frontier: dict[int, int] = {}
        self.prints_sealed_upto = -1
        self.late = 0  # records that arrived after their step was sealed (ignored)


def settle(run, final: bool = False) -> None:
    """Bring every tracker up to date with what arrived (cheap when nothing did).

    Live, the collector calls it from its analysis thread; the analyses call it
    too (idempotent), so offline callers need nothing else. While the live
    collector has deferred it (`RunState.settle_deferred`), only a final
    settle does anything."""
    if run.settle_deferred and not final:
        return
    with run.analysis_lock:
        _settle(run, final)


def _settle(run, final: bool) -> None:
    sealer = run.trackers.get("_sealer")
    if sealer is None:
        sealer = run.trackers["_sealer"] = _Sealer()
    active = [tracker(run, name) for name in TRACKERS]
    drained = run.feed.drain()
    if not any(drained.values()) and not final:
        return  # nothing new: O(1), however many ranks (each analysis calls settle)
    hooks = [t.on_event for t in active if hasattr(t, "on_event")]
    for rank, event in paced(drained["event"]):
        for hook in hooks:
            hook(run, rank, event)
    hooks = [t.on_mark for t in active if hasattr(t, "on_mark")]
    for rank, mark in paced(drained["mark"]):
        for hook in hooks:
            hook(run, rank, mark)
    for rank, fingerprint in paced(drained["fingerprint"]):
        _take_print(sealer, rank, fingerprint)
    taken = _take_records(sealer, drained["step"])
    if taken:
        # Only the newest DURATIONS_KEPT stay in the run's window: the same
        # window as noting every record, without a call per record.
        for _, record in taken[-DURATIONS_KEPT:]:
            run.note_duration(record)
    nonfinite = [(rank, record) for rank, record in drained["nonfinite"] if record.step > sealer.sealed_upto]
    if nonfinite:  # those taken (a late one is not), picked at ingest: no pass over every record
        for hook in [t.on_nonfinite for t in active if hasattr(t, "on_nonfinite")]:
            hook(run, nonfinite)
    if run.durations:
        run.typical_step_s = statistics.median(run.durations)
        run.step_p99_s = percentile(run.durations, 0.99)
    if not sealer.pending and not sealer.prints:
        return
    exited = {s.rank for s in run.notable_ranks() if s.exit_code is not None}
    live = [r for r in list(run.ranks) if r not in exited] if exited else list(run.ranks)
    # Each live rank's newest step record, fetched once for both seals (a
    # walk of every rank per tick: in C, not a generator per rank).
    reached = np.fromiter(map(sealer.frontier.get, live, itertools.repeat(-1)), np.int64, len(live))
    _seal_steps(run, sealer, reached, active, final)
    _seal_prints(run, sealer, live, reached, active, final)


def _take_print(sealer: _Sealer, rank: int, item: dict) -> None:
    step = item.get("step")
    if not isinstance(step, int) or step <= sealer.prints_sealed_upto:
        return
    # One rank's prints of one step, per model (a job with two DDP models, a
    # GAN, prints each; a rank may sample one out): each is compared
    # with the same model's on the other ranks, never with another's.
    sealer.prints.setdefault(step, {}).setdefault(wire.fingerprint_model(item), {})[rank] = item
    if step > sealer.print_frontier.get(rank, -1):
        sealer.print_frontier[rank] = step


TAKE_IN_ARRAYS = 64  # records: a chunk from this size is taken in array operations
_STEP_OF = operator.attrgetter("step")
_RANK_OF = operator.itemgetter(0)


def _take_records(sealer: _Sealer, steps: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """The drained (rank, record)s into the sealer's pending steps and each
    rank's frontier; returns those taken (a record of a step already sealed
    is late: counted, not taken), in arrival order. In chunks, handing the
    interpreter over between them. A chunk whose records are all new, none
    older than its rank's frontier (the usual one), is grouped by step in
    numpy and each group put in with dict.update: a Python statement per
    record took about twice as long (200,000 records of a 100,000-rank job,
    both ways in one process on a slow machine: 0.35-0.59 s, this 0.16-0.29 s)."""
    taken: list[tuple[int, Any]] = []
    pending, frontier = sealer.pending, sealer.frontier
    for start in range(0, len(steps), YIELD_EVERY):
        if start:
            _yield()
        chunk = steps[start:start + YIELD_EVERY]
        n = len(chunk)
        if n < TAKE_IN_ARRAYS:
            _take_one_by_one(sealer, chunk, taken)
            continue
        ranks, records = zip(*chunk)
        at = np.fromiter(map(_STEP_OF, records), np.int64, n)
        before = np.fromiter(map(frontier.get, ranks, itertools.repeat(-1)), np.int64, n)
        if at.min() <= sealer.sealed_upto or (at < before).any():
            _take_one_by_one(sealer, chunk, taken)  # late or out-of-order records: rare
            continue
        first = int(at[0])
        if first == at[-1] and not (at != first).any():  # one step (a big job's usual chunk)
            at_step = pending.get(first)
            if at_step is None:
                at_step = pending[first] = {}
            at_step.update(chunk)
            frontier.update(zip(ranks, itertools.repeat(first)))
            taken.extend(chunk)
            continue
        order = np.argsort(at, kind="stable")  # arrival order within a step
        ordered = at[order]
        cuts = [0, *(np.flatnonzero(ordered[1:] != ordered[:-1]) + 1).tolist(), n]
        by_step = operator.itemgetter(*order.tolist())(chunk)  # (rank, record)s, steps ascending
        for lo, hi in zip(cuts, cuts[1:]):
            step = int(ordered[lo])
            at_step = pending.get(step)
            if at_step is None:
                at_step = pending[step] = {}
            at_step.update(by_step[lo:hi])
        # Steps ascending, none older than its rank's frontier: each rank's
        # last update is its newest step.
        frontier.update(zip(map(_RANK_OF, by_step), ordered.tolist()))
        taken.extend(chunk)
    return taken


def _take_one_by_one(sealer: _Sealer, chunk: list[tuple[int, Any]], taken: list) -> None:
    pending, frontier, sealed_upto = sealer.pending, sealer.frontier, sealer.sealed_upto
    take, reached = taken.append, frontier.get
    for rank, item in chunk:
        step = item.step
        if step <= sealed_upto:
            sealer.late += 1
            continue
        at_step = pending.get(step)
        if at_step is None:
            at_step = pending[step] = {}
        at_step[rank] = item
        if step > reached(rank, -1):
            frontier[rank] = step
        take((rank, item))


def record_frontier(run) -> dict[int, int]:
    """Each rank's newest step record taken in (rank -> step): what settle has
    seen of every rank, for an analysis that asks which ranks reached a step."""
    sealer = run.trackers.get("_sealer")
    return sealer.frontier if sealer is not None else {}


def _seal_steps(run, sealer: _Sealer, reached: np.ndarray, active: list, final: bool) -> None:
    """``reached``: each live rank's newest step record (-1: none yet)."""
    if not sealer.pending:
        return
    limit = max(sealer.pending) if final or not len(reached) else int(reached.min()) - SEAL_LAG
    cap = max(MIN_PENDING_STEPS, PENDING_RECORDS // max(1, len(run.ranks)))
    hooks = [t.on_step for t in active if hasattr(t, "on_step")]
    for step in sorted(sealer.pending):
        if step > limit and len(sealer.pending) <= cap:
            break
        records = sealer.pending.pop(step)
        sealer.sealed_upto = step
        big = len(records) >= YIELD_RANKS  # a small step is never paced (offline: 100,000 steps)
        for hook in hooks:
            if big:
                _yield()
            hook(run, step, records)


def _seal_prints(run, sealer: _Sealer, live: list[int], reached: np.ndarray, active: list, final: bool) -> None:
    if not sealer.prints:
        return
    # A fingerprint of step p arrives by the rank's record of p + SEAL_LAG (a GPU
    # reads it a step late): a rank that sent neither blocks p; one whose
    # records went past that without one does not fingerprint p (a rank that
    # never fingerprints, or a sampled-out step), so p's comparison need not
    # wait for it. Sealing on the prints alone compared a first fingerprint
    # step with whichever ranks' prints had come first.
    if final or not live:
        limit = max(sealer.prints)
    else:
        printed = np.fromiter(map(sealer.print_frontier.get, live, itertools.repeat(-1)), np.int64, len(live))
        limit = int(np.maximum(printed, reached - SEAL_LAG).min())
    hooks = [t.on_prints for t in active if hasattr(t, "on_prints")]
    for step in sorted(sealer.prints):
        if step > limit and len(sealer.prints) <= PENDING_PRINTS:
            break
        models = sealer.prints.pop(step)
        sealer.prints_sealed_upto = step
        for model in sorted(models):
            for hook in hooks:
                hook(run, step, models[model])


class RankRows:
    """Each rank's row in a tracker's per-rank arrays, in the order ranks
    were first seen. A step's ranks come in their reports' arrival order, a
    new order every step, so their rows are looked up as one array
    operation on a table indexed by rank (ranks are below
    wire.MAX_WORLD_SIZE): a dict lookup per rank, even in C, cost ~36 ms a
    100,000-rank step (random access into a 100,000-key dict), the table
    ~2 ms."""

    def __init__(self) -> None:
        self.ranks: list[int] = []  # row -> rank
        self._row_at = np.full(64, -1, np.int64)  # rank -> row, -1: none yet

    def __len__(self) -> int:
        return len(self.ranks)

    def get(self, rank: int) -> Optional[int]:
        row = int(self._row_at[rank]) if 0 <= rank < len(self._row_at) else -1
        return row if row >= 0 else None

    def rows(self, ranks: list[int]) -> tuple[np.ndarray, list[int]]:
        """The rows of ``ranks`` (distinct, >= 0), in their order, and the
        ranks among them seen for the first time: they got the next rows,
        len(self) - len(new) onwards, in their order."""
        at = np.fromiter(ranks, np.int64, len(ranks))
        if not len(at):
            return at, []
        if int(at.min()) < 0:  # ingest admits none (wire's rank range); a negative index would wrap
            raise ValueError(f"rank {int(at.min())} < 0")
        top = int(at.max())
        if top >= len(self._row_at):
            grown = np.full(max(top + 1, 2 * len(self._row_at)), -1, np.int64)
            grown[:len(self._row_at)] = self._row_at
            self._row_at = grown
        rows = self._row_at[at]
        missing = np.flatnonzero(rows < 0)
        if not len(missing):
            return rows, []
        start = len(self.ranks)
        fresh = np.arange(start, start + len(missing))
        self._row_at[at[missing]] = fresh
        rows[missing] = fresh
        new = at[missing].tolist()
        self.ranks.extend(new)
        return rows, new


def peer_medians_of(given: np.ndarray) -> np.ndarray:
    """For each element of an array (n >= 2 finite values), the median of the
    *others*: element i is the median of every value but the i-th. One sort
    for all (O(n log n)), not one median per element (O(n^2)): dropping one
    value from the sorted array leaves a median that depends only on where
    that value sits (before or after the middle), so all of them come from a
    few array operations. Same numbers as statistics.median over the others.
    Where each value sits comes from the sort's own order (a binary search
    per value cost ~3x the sort); of equal values any copy may be the one
    dropped, as the rest are the same numbers."""
    m = len(given) - 1
    half = m // 2
    order = np.argsort(given)
    ordered = given[order]
    at = np.empty(len(given), np.int64)
    at[order] = np.arange(len(given))  # where each value sits in the sorted array
    hi = np.where(half < at, ordered[half], ordered[half + 1])
    if not m % 2:
        hi = (np.where(half - 1 < at, ordered[half - 1], ordered[half]) + hi) / 2
    return hi


def median(values) -> float:
    return statistics.median(values)


class StepEvents:
    """Events of some kinds, held until their step is sealed: a rank's event
    for step s always arrives before its record of step s + 1, and a step is
    sealed only once every live rank sent a later one, so at the seal of s
    every rank's events up to s are in, live and offline alike (the
    silent-error analyses read them there). Held by step, so a seal costs
    what is due, not a walk of every rank holding something (every rank's
    start-up facts, due at as many steps as a cold start spreads them over:
    100,000 ranks walked per sealed step). Bounded per rank: past PER_RANK
    held, a rank's oldest arrival is dropped. O(1) per sealed step while
    nothing is due."""

    PER_RANK = 512

    def __init__(self, kinds: tuple[str, ...]) -> None:
        self.kinds = kinds
        # step -> {arrival: (rank, event)}, in arrival order (dicts keep it)
        self.by_step: dict[int, dict[int, tuple[int, Any]]] = {}
        self._held: dict[int, collections.deque] = {}  # rank -> (step, arrival) of its held events, in arrival order
        self._lowest: Optional[int] = None  # the lowest step held
        self._seq = 0

    def add(self, rank: int, event) -> None:
        if event.kind not in self.kinds:
            return
        step = event.step if isinstance(event.step, int) and event.step >= 0 else 0
        held = self._held.get(rank)
        if held is None:
            held = self._held[rank] = collections.deque()
        if len(held) >= self.PER_RANK:
            old_step, old_seq = held.popleft()
            at_old = self.by_step[old_step]
            del at_old[old_seq]
            if not at_old:
                del self.by_step[old_step]
                if old_step == self._lowest:
                    self._lowest = min(self.by_step, default=None)
        self._seq += 1
        held.append((step, self._seq))
        at_step = self.by_step.get(step)
        if at_step is None:
            at_step = self.by_step[step] = {}
        at_step[self._seq] = (rank, event)
        if self._lowest is None or step < self._lowest:
            self._lowest = step

    def held(self) -> int:
        """How many events are held."""
        return sum(map(len, self.by_step.values()))

    def due(self, step: int) -> list[tuple[int, Any]]:
        """(rank, event) of every event up to ``step``, in step then arrival order."""
        if self._lowest is None or step < self._lowest:
            return []
        out: list[tuple[int, Any]] = []
        for s in sorted(s for s in self.by_step if s <= step):
            out.extend(self.by_step.pop(s).values())
        self._lowest = min(self.by_step, default=None)
        held = self._held
        for rank in {rank for rank, _ in out}:  # what each rank still holds: its events of later steps
            if len(held[rank]) == 1:  # the one just taken (every rank's start-up facts)
                del held[rank]
                continue
            rest = collections.deque(item for item in held[rank] if item[0] > step)
            if rest:
                held[rank] = rest
            else:
                del held[rank]
        return out


def _details_pairs(details: Any, key: str) -> dict[str, str]:
    return pairs(details.get(key) if isinstance(details, dict) else None)


# `pairs(details[key])`, once per details object: every rank's start-up facts
# arrive as one shared details object, so a big job's sealed step held
# 100,000 copies of one computation (~1 s of a 100,000-rank tick). The
# mapping returned is shared: read it, never change it.
event_pairs = PerObject(_details_pairs)


def pairs(value: Any, limit: int = 256) -> dict[str, str]:
    """[[name, text], ...] from an agent's event (untrusted): a mapping of the well-formed pairs."""
    out: dict[str, str] = {}
    if isinstance(value, dict):
        value = list(value.items())
    if not isinstance(value, list):
        return out
    for item in value[:limit]:
        if isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str) and isinstance(
                item[1], str):
            out[item[0][:64]] = item[1][:256]
    return out
