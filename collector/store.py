"""The collector's index: SQLite, one file per collector.

Holds what the analyses need to be re-run offline and after a restart (runs,
ranks, steps, collective marks, events, fingerprints, incidents, verdicts) and
an index of the bundle archives, which stay as files next to it.

Writes are off the request path: ingest hands the store references (a rank's
state, the step records a beat brought) and returns; one writer thread turns
them into rows once a second, in one transaction (SQLite in WAL mode). A
rank's row is its latest state, written at most once per bulk write however
many beats arrived (at most RANK_ROWS_PER_BULK of them a bulk write); marks
and fingerprints go as one row per rank and bulk write, step records as one
row per STEPS_ROW_RANKS ranks (compact rows, not one row per step), and rows
older than the step window are pruned.

A full disk or a read-only data dir never stops the collector: the store
says so once, keeps serving from memory, and `degraded` tells the report.
`Store(path, readonly=True)` opens an index for reading only (`rankwatch
analyze`): no schema change, no write, nothing created.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import operator
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional
from urllib.parse import quote

from rankwatch import wire

from .changes import BeatData, Changes
from .memo import PerObject
from .state import Incident, RankState, RunState

log = logging.getLogger("rankwatch.collector")

FLUSH_INTERVAL = 1.0
PRUNE_INTERVAL = 60.0
BULK_INTERVAL = 10.0  # ranks' rows and step records
RANK_ROWS_PER_BULK = 20_000  # ranks' rows a bulk write takes at most (a rank's row: every BULK_INTERVAL * ranks / this)
SAMPLED_ABOVE = 10_000  # ranks: beyond, the index keeps a sample of the steps
RETAINED_STEPS = 2048  # step records kept in the index per rank (memory keeps fewer)
MAX_PENDING_PER_RANK = RETAINED_STEPS  # records waiting for the writer, per rank and kind
STEPS_ROW_RANKS = 1_000  # ranks per "steps_by_rank" row (one encoding each)

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, world_size INTEGER, started_at REAL, finished_at REAL,
    hang_timeout REAL, on_hang TEXT, interrupted INTEGER DEFAULT 0, aborted TEXT);
CREATE TABLE IF NOT EXISTS ranks (
    run_id TEXT, rank INTEGER, local_rank INTEGER, node_rank INTEGER, host TEXT, pid INTEGER,
    step INTEGER, forwards INTEGER, phase TEXT, last_progress_at REAL,
    exit_code INTEGER, exited_at REAL, killed_by_rankwatch INTEGER DEFAULT 0,
    enqueued TEXT, completed TEXT,
    PRIMARY KEY (run_id, rank));
CREATE TABLE IF NOT EXISTS steps (
    run_id TEXT, rank INTEGER, step INTEGER, record TEXT, PRIMARY KEY (run_id, rank, step));
CREATE TABLE IF NOT EXISTS marks (
    run_id TEXT, rank INTEGER, step INTEGER, seqs TEXT, PRIMARY KEY (run_id, rank, step));
CREATE TABLE IF NOT EXISTS events (
    run_id TEXT, rank INTEGER, kind TEXT, at REAL, step INTEGER, details TEXT);
CREATE TABLE IF NOT EXISTS fingerprints (
    run_id TEXT, rank INTEGER, step INTEGER, data TEXT);
CREATE TABLE IF NOT EXISTS batches (
    run_id TEXT, rank INTEGER, kind TEXT, first_step INTEGER, last_step INTEGER, data TEXT);
CREATE TABLE IF NOT EXISTS incidents (
    run_id TEXT, id TEXT, kind TEXT, opened_at REAL, last_progress_at REAL, timeout REAL,
    details TEXT, PRIMARY KEY (run_id, id));
CREATE TABLE IF NOT EXISTS bundles (
    run_id TEXT, rank INTEGER, incident TEXT, reason TEXT, source TEXT, path TEXT,
    size INTEGER, created_at REAL, received_at REAL);
CREATE TABLE IF NOT EXISTS verdicts (
    run_id TEXT, kind TEXT, ranks TEXT, detected_at TEXT, verdict TEXT,
    PRIMARY KEY (run_id, kind, ranks));
CREATE INDEX IF NOT EXISTS bundles_by_run ON bundles (run_id, incident);
CREATE INDEX IF NOT EXISTS events_by_run ON events (run_id, rank);
CREATE INDEX IF NOT EXISTS batches_by_run ON batches (run_id, kind, last_step);
"""

_step_row = operator.attrgetter(*wire.STEP_COLUMNS)


try:  # the collector's extra: ~7x faster for the bulk rows (json otherwise)
    from msgspec.json import encode as _fast_encode
except ImportError:  # pragma: no cover
    _fast_encode = None


def _dumps_seqs(seqs: dict[str, int]) -> str:
    """{process group: sequence number} (validated ints on ingest)."""
    return _dumps_finite(seqs)


def _steps_rows(per_rank: dict[int, list[wire.StepRecord]]) -> Iterator[tuple[int, int, str]]:
    """One run's step records of one flush as rows of STEPS_ROW_RANKS ranks
    each: (first step, last step, text). ~60,000 ranks' records every 10 s at
    100,000 ranks; one encoding of them all held the interpreter for ~45 ms
    (msgspec never lets go inside a call), and every report the event loop
    was answering waited behind it. A row of 1,000 ranks holds it ~1 ms."""
    items = list(per_rank.items())
    for start in range(0, len(items), STEPS_ROW_RANKS):
        if start:
            time.sleep(0)  # hand the interpreter to the collector's HTTP thread
        chunk = items[start:start + STEPS_ROW_RANKS]
        first = min(records[0].step for _, records in chunk)
        last = max(records[-1].step for _, records in chunk)
        yield first, last, _dumps_steps(chunk)


def _dumps_steps(chunk: list[tuple[int, list[wire.StepRecord]]]) -> str:
    """{"columns": [...], "ranks": {rank: [row, ...]}} of some ranks' records."""
    value = {"columns": wire.STEP_COLUMNS,
             "ranks": {str(rank): [_step_row(r) for r in records] for rank, records in chunk}}
    # loss and grad_norm are the only fields that may be non-finite, which
    # msgspec would write as null: those records take the strict encoder.
    if _fast_encode is not None and all((r.loss is None or math.isfinite(r.loss))
                                        and (r.grad_norm is None or math.isfinite(r.grad_norm))
                                        for _, records in chunk for r in records):
        return _fast_encode(value).decode()
    return _dumps(value)


def _prints_row(queued: list[dict[str, Any]]) -> tuple[int, int, str]:
    """A rank's fingerprints of one flush as (first step, last step, text) of
    {"names": [...], "prints": [...]}: a print's names are an index into
    `names`, a list of names written once while it repeats. A non-finite
    norm takes the strict encoder (written as "NaN"), the rest the fast one."""
    names: list[list[str]] = []
    prints = []
    steps = []
    finite = True
    for fp in queued:
        item = dict(fp)
        listed = item.pop("names", None)
        if isinstance(listed, list):
            if not names or listed is not names[-1]:
                names.append(listed)
            item["names"] = len(names) - 1
        step = item.get("step")
        if isinstance(step, int):
            steps.append(step)
        norms = item.get("norms")
        if finite and isinstance(norms, list):
            finite = wire.all_finite(norms)  # else the strict encoder
        prints.append(item)
    value = {"names": names, "prints": prints}
    return min(steps, default=-1), max(steps, default=-1), _dumps_finite(value) if finite else _dumps(value)


def _dumps_finite(value: Any) -> str:
    """_dumps of a value with no non-finite number (validated integers,
    finite floats, text): msgspec's encoder, ~10x json's, gives the same
    JSON text there (every rank's marks and fingerprints, every flush)."""
    return _fast_encode(value).decode() if _fast_encode is not None else _dumps(value)


def _dumps(value: Any) -> str:
    # Strict JSON (wire.json_text): a NaN loss is stored as "NaN" and read back
    # as a float by the wire decoder (fingerprint norms by _norms).
    return wire.json_text(value, compact=True)


# _dumps, once per object: every rank's start-up facts arrive as one shared
# details object (collector/codec.py), written once per rank.
_dumps_shared = PerObject(_dumps)


def _norms(fingerprint: dict[str, Any]) -> dict[str, Any]:
    norms = fingerprint.get("norms")
    if isinstance(norms, list):
        fingerprint["norms"] = [wire.number(v) for v in norms]
    return fingerprint


def _queue(per_rank: dict[int, list], rank: int, items: list, bound: int) -> None:
    """A rank's items waiting for the next bulk write, the newest `bound` of them."""
    queue = per_rank.get(rank)
    if queue is None:
        per_rank[rank] = items[-bound:]  # a copy: the caller's list is not kept
    else:
        queue.extend(items)
        if len(queue) > bound:
            del queue[:-bound]


def _index_stride(world: int) -> int:
    """Past SAMPLED_ABOVE ranks the index keeps every 2^k-th step of each rank
    (the same steps on every rank): its step record and its collective mark,
    where it has one. ~10,000 ranks' worth of records: enough to rebuild the
    analyses offline (a mark counts collectives since the start, so a rank's
    extra or missing one shows at every later mark), cheap to write."""
    return 1 << max(0, (world - 1) // SAMPLED_ABOVE).bit_length() if world > SAMPLED_ABOVE else 1


class Store:
    def __init__(self, path: Optional[Path], readonly: bool = False, flush_interval: float = FLUSH_INTERVAL,
                 changes: Optional[Changes] = None):
        """``changes``: the collector's journal (changes.py), taken and
        written at every flush of the writer thread."""
        self.path = path
        self.changes = changes
        self.readonly = readonly
        self.degraded: Optional[str] = None  # why the index is not being written (said once)
        self._lock = threading.RLock()  # the connection
        self._pending_lock = threading.Lock()  # the queues below
        self._sql: list[tuple[str, tuple]] = []
        self._ranks: dict[tuple[str, int], RankState] = {}
        self._verdicts: dict[tuple[str, str, str], wire.Verdict] = {}
        self._bulk_wanted = False
        self._saved_runs: dict[str, tuple] = {}  # run -> the runs row last queued
        # What the next bulk write takes, per run and rank (steps: one row per STEPS_ROW_RANKS ranks).
        self._steps: dict[str, dict[int, list[wire.StepRecord]]] = {}
        self._marks: dict[str, dict[int, list[wire.CollectiveMark]]] = {}
        self._prints: dict[str, dict[int, list[dict[str, Any]]]] = {}
        self._max_step: dict[str, int] = {}
        self._flush_interval = flush_interval
        self._wake = threading.Event()
        self._flushed = threading.Condition()
        self._generation = 0  # flushes done
        self._started = 0  # flushes begun (each takes what is queued when it begins)
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self._pruned_at = time.monotonic()
        self._db = self._open(path, readonly)
        if changes is not None:
            self._ensure_writer()  # ingest notes changes and never calls in: the writer comes to them

    # -- opening -----------------------------------------------------------------
    def _open(self, path: Optional[Path], readonly: bool) -> sqlite3.Connection:
        if readonly:
            if path is None:
                raise ValueError("a read-only store needs a path")
            if not Path(f"{path}-wal").exists():
                # Closed cleanly (no write-ahead log): read the file as it is,
                # creating nothing next to it (no -wal, no -shm).
                return sqlite3.connect(f"file:{quote(str(path))}?immutable=1", uri=True, check_same_thread=False)
            try:
                db = sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True, check_same_thread=False)
                db.execute("SELECT count(*) FROM sqlite_master").fetchone()
                return db
            except sqlite3.Error:
                # A read-only directory cannot hold WAL's shared-memory file:
                # read the file as it is, without its uncheckpointed tail.
                return sqlite3.connect(f"file:{quote(str(path))}?immutable=1", uri=True, check_same_thread=False)
        try:
            if path:
                path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(str(path) if path else ":memory:", check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL" if path else "PRAGMA journal_mode=MEMORY")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(SCHEMA)
            db.execute("INSERT OR REPLACE INTO meta VALUES ('schema', 'rankwatch.index/v1')")
            return db
        except (sqlite3.Error, OSError) as exc:
            self._degrade(f"cannot write the index {path}: {exc}")
            db = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
            db.executescript(SCHEMA)
            return db

    def _degrade(self, why: str) -> None:
        if self.degraded is None:
            self.degraded = why
            log.warning("%s; the collector keeps working from memory (the index of this run is incomplete)", why)

    # -- writer thread -------------------------------------------------------------
    def _ensure_writer(self) -> None:
        if self._thread is None and not self.readonly:
            self._thread = threading.Thread(target=self._writer, name="rankwatch-store", daemon=True)
            self._thread.start()

    def _writer(self) -> None:
        bulk_at = time.monotonic()
        while True:
            self._wake.wait(self._flush_interval)
            self._wake.clear()
            stopping = self._stop
            # Ranks' rows and step records every BULK_INTERVAL (or when asked):
            # a rank's row at most once per interval however many beats it sent.
            everything = stopping or self._bulk_wanted
            bulk = everything or time.monotonic() - bulk_at >= BULK_INTERVAL
            if bulk:
                bulk_at = time.monotonic()
                self._bulk_wanted = False
            try:
                self._flush_once(bulk, everything)
            except Exception:  # the writer must survive anything
                log.exception("index writer failed")
            with self._flushed:
                self._generation += 1
                self._flushed.notify_all()
            if stopping:
                return

    def _take_changes(self) -> None:
        """What ingest noted since the last flush joins the queues below. One
        row that cannot be queued (its details refuse to encode) is dropped
        alone, logged, never the rest of the batch. Heartbeats are queued
        under one hold of the lock (100,000 ranks: ~10,000 beats a second)."""
        if self.changes is None:
            return
        noted = self.changes.take()
        if not noted:
            return
        saves: list[tuple[Callable[..., None], tuple]] = [(self.save_run, (run,)) for run in noted.runs.values()]
        saves += [(self.save_bundle, bundle) for bundle in noted.bundles]
        saves += [(self.save_events, events) for events in noted.events]
        for save, args in saves:
            try:
                save(*args)
            except Exception:
                log.exception("index: one %s row not written", save.__name__.removeprefix("save_"))
        with self._pending_lock:
            for beat in noted.beats:
                try:
                    self._queue_beat(beat)
                except Exception:
                    log.exception("index: one heartbeat row not written")
            self._ranks.update(noted.ranks)

    def _flush_once(self, bulk: bool = True, everything: bool = True) -> None:
        with self._pending_lock:
            # Counted before the journal is taken: a flush() asked for after
            # something was noted waits for a flush that takes it.
            self._started += 1
        self._take_changes()
        with self._pending_lock:
            sql, self._sql = self._sql, []
            verdicts, self._verdicts = self._verdicts, {}
            ranks: dict[tuple[str, int], RankState] = {}
            steps: dict[str, dict[int, list[wire.StepRecord]]] = {}
            marks: dict[str, dict[int, list[wire.CollectiveMark]]] = {}
            prints: dict[str, dict[int, list[dict[str, Any]]]] = {}
            if bulk:
                steps, marks, prints = self._steps, self._marks, self._prints
                self._steps, self._marks, self._prints = {}, {}, {}
                # A rank's row is its latest state, for a restart: on a big job
                # at most RANK_ROWS_PER_BULK of them a bulk write, those
                # waiting longest first (100,000 rows at once cost ~0.5 s of
                # CPU in one burst, and every report waited behind it).
                if everything or len(self._ranks) <= RANK_ROWS_PER_BULK:
                    ranks, self._ranks = self._ranks, {}
                else:  # the oldest keys, taken out in place (a copy of 100,000 was ~10 ms in one C call)
                    ranks = dict(itertools.islice(self._ranks.items(), RANK_ROWS_PER_BULK))
                    for key in ranks:
                        del self._ranks[key]
        for (run_id, _, _), v in verdicts.items():
            sql.append(("INSERT OR REPLACE INTO verdicts VALUES (?,?,?,?,?)",
                        (run_id, v.kind, _dumps(v.ranks), v.detected_at, _dumps(wire.to_dict(v)))))
        if self.degraded:
            return  # said once; what is in memory stays the truth
        rank_rows = []
        for i, ((run_id, _), s) in enumerate(ranks.items()):
            if i % 2_000 == 1_999:
                time.sleep(0)  # hand the interpreter to the collector's HTTP thread (100,000 rows)
            try:
                rank_rows.append((run_id, s.rank, s.local_rank, s.node_rank, s.host, s.pid, s.step, s.forwards,
                                  s.phase, s.last_progress_at, s.exit_code, s.exited_at, int(s.killed_by_rankwatch),
                                  _dumps_seqs(dict(s.enqueued)), _dumps_seqs(dict(s.completed))))
            except RuntimeError:  # a dict changed while it was copied: next flush
                with self._pending_lock:
                    self._ranks.setdefault((run_id, s.rank), s)
        # The step records of STEPS_ROW_RANKS ranks in one row; marks and
        # fingerprints in one row per rank (one encoding each: a single
        # encoding of 100,000 ranks' prints was no cheaper than 100,000).
        batch_rows = []
        for run_id, per_rank in marks.items():
            batch_rows += [(run_id, rank, "marks", queued[0].step, queued[-1].step,
                            _dumps_finite([[m.step, m.seqs] for m in queued])) for rank, queued in per_rank.items()]
        for run_id, per_rank in prints.items():
            for i, (rank, queued) in enumerate(per_rank.items()):
                if i % 2_000 == 1_999:
                    time.sleep(0)  # hand the interpreter to the collector's HTTP thread
                batch_rows.append((run_id, rank, "fingerprints", *_prints_row(queued)))
        for run_id, per_rank in steps.items():
            for first, last, text in _steps_rows(per_rank):
                batch_rows.append((run_id, -1, "steps_by_rank", first, last, text))
                if last > self._max_step.get(run_id, -1):
                    self._max_step[run_id] = last
        try:
            with self._lock:
                self._db.execute("BEGIN")
                try:
                    for statement, args in sql:
                        self._db.execute(statement, args)
                    if rank_rows:
                        self._db.executemany("INSERT OR REPLACE INTO ranks VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                                             rank_rows)
                    if batch_rows:
                        self._db.executemany("INSERT INTO batches VALUES (?,?,?,?,?,?)", batch_rows)
                    if time.monotonic() - self._pruned_at >= PRUNE_INTERVAL:
                        self._pruned_at = time.monotonic()
                        self._prune()
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
        except sqlite3.Error as exc:
            # Disk full, read-only file system, a deleted data dir: degrade, never crash.
            self._degrade(f"index {self.path} not written ({type(exc).__name__}: {exc})")

    def _prune(self) -> None:
        """Retention: step, mark and fingerprint rows older than the step
        window the analyses read (a long run's index does not grow without end)."""
        for run_id, top in self._max_step.items():
            self._db.execute("DELETE FROM batches WHERE run_id=? AND last_step < ?", (run_id, top - RETAINED_STEPS))
            self._db.execute("DELETE FROM steps WHERE run_id=? AND step < ?", (run_id, top - RETAINED_STEPS))

    def flush(self, timeout: float = 30.0) -> None:
        """Write everything queued so far, and wait for it (end of a run, stop)."""
        if self.readonly or self._thread is None:
            return
        with self._pending_lock:
            target = self._started + 1  # the first flush that begins after this call
            self._bulk_wanted = True
        with self._flushed:
            self._wake.set()
            self._flushed.wait_for(lambda: self._generation >= target or not self._thread.is_alive(), timeout)

    def close(self) -> None:
        if self._thread is not None:
            self._stop = True
            self._wake.set()
            self._thread.join(timeout=30)
        with self._lock:
            try:
                self._db.close()
            except sqlite3.Error:
                pass

    # -- writes (queued; never block on SQLite) ------------------------------------
    def _exec(self, sql: str, args: Iterable = ()) -> None:
        if self.readonly:
            return
        with self._pending_lock:
            self._sql.append((sql, tuple(args)))
        self._ensure_writer()

    def save_run(self, run: RunState, finished_at: Optional[float] = None) -> None:
        row = (run.run_id, run.world_size, run.started_at, finished_at, run.hang_timeout, run.on_hang,
               int(run.interrupted), run.aborted)
        if finished_at is None and self._saved_runs.get(run.run_id) == row:
            return  # every node report saves its run: only a change is written
        self._saved_runs[run.run_id] = row
        self._exec(
            "INSERT INTO runs VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(run_id) DO UPDATE SET "
            "world_size=excluded.world_size, finished_at=COALESCE(excluded.finished_at, finished_at), "
            "hang_timeout=excluded.hang_timeout, on_hang=excluded.on_hang, interrupted=excluded.interrupted, "
            "aborted=excluded.aborted",
            (run.run_id, run.world_size, run.started_at, finished_at, run.hang_timeout, run.on_hang,
             int(run.interrupted), run.aborted),
        )

    def save_rank(self, run_id: str, s: RankState) -> None:
        """The rank's latest state goes out with the next flush (once, however
        many beats came in between)."""
        if self.readonly:
            return
        with self._pending_lock:
            self._ranks[(run_id, s.rank)] = s
        self._ensure_writer()

    def save_heartbeat_data(self, run_id: str, rank: int, hb: wire.Heartbeat,
                            fingerprints: Optional[list[dict[str, Any]]] = None) -> None:
        """One heartbeat's records, marks, events and fingerprints (those
        given, else the beat's) queued for the next bulk write, as ingest's
        journal (`changes.py`) hands them to the writer: for tools and tests
        that fill an index without a collector."""
        if self.readonly:
            return
        with self._pending_lock:
            self._queue_beat(BeatData(run_id, rank, hb.identity.world_size, hb.steps, hb.marks, hb.events,
                                      hb.fingerprints if fingerprints is None else fingerprints))
        self._ensure_writer()

    def _queue_beat(self, beat: BeatData) -> None:
        """One heartbeat's records, marks, fingerprints and events, queued
        (the caller holds the pending lock)."""
        run_id, rank, world, steps, marks, events, fingerprints = beat
        stride = _index_stride(world)
        if steps:
            if stride > 1:
                steps = [r for r in steps if r.step % stride == 0]
            if steps:
                bound = max(16, min(MAX_PENDING_PER_RANK, 2_000_000 // max(1, world)))
                _queue(self._steps.setdefault(run_id, {}), rank, steps, bound)
        if marks and stride > 1:
            marks = [m for m in marks if m.step % stride == 0]
        if marks:
            _queue(self._marks.setdefault(run_id, {}), rank, marks, MAX_PENDING_PER_RANK)
        if fingerprints:
            _queue(self._prints.setdefault(run_id, {}), rank, fingerprints, 256)
        for e in events:
            self._sql.append(("INSERT INTO events VALUES (?,?,?,?,?,?)",
                              (run_id, rank, e.kind, e.at, e.step, _dumps_shared(e.details))))

    def save_events(self, run_id: str, rank: int, events: list[wire.Event]) -> None:
        for e in events:
            self._exec("INSERT INTO events VALUES (?,?,?,?,?,?)",
                       (run_id, rank, e.kind, e.at, e.step, _dumps_shared(e.details)))

    def save_incident(self, run_id: str, inc: Incident) -> None:
        self._exec("INSERT OR REPLACE INTO incidents VALUES (?,?,?,?,?,?,?)",
                   (run_id, inc.id, inc.kind, inc.opened_at, inc.last_progress_at, inc.timeout,
                    _dumps({**inc.details, "requested_ranks": inc.requested_ranks})))

    def save_bundle(self, run_id: str, manifest: wire.BundleManifest, path: str, size: int, received_at: float) -> None:
        self._exec("INSERT INTO bundles VALUES (?,?,?,?,?,?,?,?,?)",
                   (run_id, manifest.rank, manifest.incident, manifest.reason, manifest.source, path, size,
                    manifest.created_at, received_at))

    def save_verdict(self, run_id: str, v: wire.Verdict) -> None:
        """The latest figures of a verdict go out with the next flush (the
        analyses re-issue it every pass: encoded once per flush, not per pass)."""
        if self.readonly:
            return
        with self._pending_lock:
            self._verdicts[(run_id, v.kind, ",".join(map(str, v.ranks)))] = v
        self._ensure_writer()

    # -- reads ----------------------------------------------------------------------
    def _rows(self, sql: str, args: tuple = ()) -> list[tuple]:
        """Rows of a query; none from a table an older index does not have."""
        with self._lock:
            try:
                return self._db.execute(sql, args).fetchall()
            except sqlite3.OperationalError as exc:
                if "no such table" in str(exc):
                    return []
                raise

    def run_ids(self) -> list[str]:
        return [r[0] for r in self._rows("SELECT run_id FROM runs ORDER BY started_at")]

    def unfinished_run_ids(self) -> list[str]:
        return [r[0] for r in self._rows("SELECT run_id FROM runs WHERE finished_at IS NULL ORDER BY started_at")]

    def has_run(self, run_id: str) -> bool:
        return bool(self._rows("SELECT 1 FROM runs WHERE run_id=?", (run_id,)))

    def bundle_paths(self, run_id: str) -> list[str]:
        return [r[0] for r in self._rows("SELECT path FROM bundles WHERE run_id=?", (run_id,))]

    def detected_at(self, run_id: str) -> dict[tuple[str, str], str]:
        rows = self._rows("SELECT kind, ranks, detected_at FROM verdicts WHERE run_id=?", (run_id,))
        return {(k, r): d for k, r, d in rows}

    def verdicts(self, run_id: str) -> list[wire.Verdict]:
        """Verdicts already issued for the run (they survive a restart)."""
        out = []
        for (raw,) in self._rows("SELECT verdict FROM verdicts WHERE run_id=?", (run_id,)):
            try:
                out.append(wire.decode(wire.Verdict, json.loads(raw)))
            except (ValueError, wire.WireError):
                continue
        return out

    def load_run(self, run_id: str) -> Optional[RunState]:
        rows = self._rows("SELECT world_size, started_at, hang_timeout, on_hang, interrupted, aborted, finished_at "
                          "FROM runs WHERE run_id=?", (run_id,))
        if not rows:
            return None
        row = rows[0]
        run = RunState(run_id=run_id, world_size=row[0] or 0, started_at=row[1] or 0.0,
                       hang_timeout=row[2], on_hang=row[3] or "abort", interrupted=bool(row[4]),
                       aborted=row[5], finished=row[6] is not None)
        for r in self._rows("SELECT * FROM ranks WHERE run_id=?", (run_id,)):
            (_, rank, local_rank, node_rank, host, pid, step, forwards, phase, lpa, exit_code, exited_at,
             killed, enq, comp) = r
            s = run.rank(rank)
            s.local_rank, s.node_rank, s.host, s.pid = local_rank, node_rank, host, pid
            s.step, s.forwards, s.phase, s.last_progress_at = step, forwards, phase, lpa or 0.0
            s.exit_code, s.exited_at, s.killed_by_rankwatch = exit_code, exited_at, bool(killed)
            s.enqueued, s.completed = json.loads(enq or "{}"), json.loads(comp or "{}")
            s.world_size = run.world_size
        decode_step = wire.StepRecord
        for rank, step, record in self._rows(
                "SELECT rank, step, record FROM steps WHERE run_id=? ORDER BY rank, step", (run_id,)):
            try:
                run.rank(rank).add_step(wire.decode(decode_step, json.loads(record)))
            except (ValueError, wire.WireError):
                continue
        for rank, kind, data in self._rows(
                "SELECT rank, kind, data FROM batches WHERE run_id=? ORDER BY rowid", (run_id,)):
            try:
                if kind == "steps_by_rank":  # one flush's records of up to STEPS_ROW_RANKS ranks
                    data = json.loads(data)
                    for key, rows in data["ranks"].items():
                        self._load_batch(run.rank(int(key)), "steps", {"columns": data["columns"], "rows": rows})
                    continue
                self._load_batch(run.rank(rank), kind, json.loads(data))
            except (ValueError, TypeError, KeyError, wire.WireError):
                continue
        for rank, step, seqs in self._rows("SELECT rank, step, seqs FROM marks WHERE run_id=?", (run_id,)):
            run.rank(rank).marks[step] = json.loads(seqs)
        for rank, kind, at, step, details in self._rows(
                "SELECT rank, kind, at, step, details FROM events WHERE run_id=? ORDER BY at", (run_id,)):
            run.rank(rank).events.append(wire.Event(kind=kind, at=at, step=step, details=json.loads(details)))
        for rank, data in self._rows("SELECT rank, data FROM fingerprints WHERE run_id=?", (run_id,)):
            run.rank(rank).fingerprints.append(_norms(json.loads(data)))
        for iid, kind, opened, lpa, timeout, details in self._rows(
                "SELECT id, kind, opened_at, last_progress_at, timeout, details FROM incidents WHERE run_id=?",
                (run_id,)):
            d = json.loads(details or "{}")
            run.incidents.append(Incident(id=iid, kind=kind, opened_at=opened, last_progress_at=lpa,
                                          timeout=timeout, requested_ranks=d.pop("requested_ranks", []),
                                          ready=True, details=d))
        return run

    @staticmethod
    def _load_batch(state: RankState, kind: str, data: Any) -> None:
        if kind == "steps":
            columns = data["columns"]
            decode = wire.StepRecord
            for row in data["rows"]:
                state.add_step(wire.decode(decode, dict(zip(columns, row))))
        elif kind == "marks":
            for step, seqs in data:
                state.marks[int(step)] = seqs
        elif kind == "fingerprints":
            names = data["names"]
            for item in data["prints"]:
                index = item.pop("names", None)
                if isinstance(index, int) and 0 <= index < len(names):
                    item["names"] = names[index]
                state.fingerprints.append(_norms(item))  # the rank's log keeps its own bound

