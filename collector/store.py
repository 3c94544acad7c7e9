"""The collector's index: SQLite, one file per collector.

Holds what the analyses need to be re-run offline (ranks, steps, collective
marks, events, exits, incidents) and an index of the bundle archives, which
stay as files next to it. Writes are batched and committed once per tick.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Iterable, Optional

from rankwatch import wire

from .state import Incident, RankState, RunState

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
"""


class Store:
    def __init__(self, path: Optional[Path]):
        self.path = path
        target = str(path) if path else ":memory:"
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(target, check_same_thread=False, isolation_level=None)
        self._lock = threading.RLock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL" if path else "PRAGMA journal_mode=MEMORY")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('schema', 'rankwatch.index/v1')")
            self._db.execute("BEGIN")

    def _end_transaction(self) -> None:
        try:
            self._db.execute("COMMIT")
        except sqlite3.OperationalError:
            pass  # nothing was open

    def commit(self) -> None:
        with self._lock:
            self._end_transaction()
            self._db.execute("BEGIN")

    def close(self) -> None:
        with self._lock:
            self._end_transaction()
            self._db.close()

    def _exec(self, sql: str, args: Iterable = ()) -> None:
        with self._lock:
            self._db.execute(sql, tuple(args))

    def _many(self, sql: str, rows: list[tuple]) -> None:
        if rows:
            with self._lock:
                self._db.executemany(sql, rows)

    # -- writes ------------------------------------------------------------------
    def save_run(self, run: RunState, finished_at: Optional[float] = None) -> None:
        self._exec(
            "INSERT INTO runs VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(run_id) DO UPDATE SET "
            "world_size=excluded.world_size, finished_at=COALESCE(excluded.finished_at, finished_at), "
            "hang_timeout=excluded.hang_timeout, on_hang=excluded.on_hang, interrupted=excluded.interrupted, "
            "aborted=excluded.aborted",
            (run.run_id, run.world_size, run.started_at, finished_at, run.hang_timeout, run.on_hang,
             int(run.interrupted), run.aborted),
        )

    def save_rank(self, run_id: str, s: RankState) -> None:
        self._exec(
            "INSERT OR REPLACE INTO ranks VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (run_id, s.rank, s.local_rank, s.node_rank, s.host, s.pid, s.step, s.forwards, s.phase,
             s.last_progress_at, s.exit_code, s.exited_at, int(s.killed_by_rankwatch),
             json.dumps(s.enqueued), json.dumps(s.completed)),
        )

    def save_heartbeat_data(self, run_id: str, rank: int, hb: wire.Heartbeat) -> None:
        self._many("INSERT OR REPLACE INTO steps VALUES (?,?,?,?)",
                   [(run_id, rank, r.step, json.dumps(wire.to_dict(r))) for r in hb.steps])
        self._many("INSERT OR REPLACE INTO marks VALUES (?,?,?,?)",
                   [(run_id, rank, m.step, json.dumps(m.seqs)) for m in hb.marks])
        self.save_events(run_id, rank, hb.events)
        self._many("INSERT INTO fingerprints VALUES (?,?,?,?)",
                   [(run_id, rank, int(f.get("step", -1)), json.dumps(f)) for f in hb.fingerprints])

    def save_events(self, run_id: str, rank: int, events: list[wire.Event]) -> None:
        self._many("INSERT INTO events VALUES (?,?,?,?,?,?)",
                   [(run_id, rank, e.kind, e.at, e.step, json.dumps(e.details)) for e in events])

    def save_incident(self, run_id: str, inc: Incident) -> None:
        self._exec("INSERT OR REPLACE INTO incidents VALUES (?,?,?,?,?,?,?)",
                   (run_id, inc.id, inc.kind, inc.opened_at, inc.last_progress_at, inc.timeout,
                    json.dumps({**inc.details, "requested_ranks": inc.requested_ranks})))

    def save_bundle(self, run_id: str, manifest: wire.BundleManifest, path: str, size: int, received_at: float) -> None:
        self._exec("INSERT INTO bundles VALUES (?,?,?,?,?,?,?,?,?)",
                   (run_id, manifest.rank, manifest.incident, manifest.reason, manifest.source, path, size,
                    manifest.created_at, received_at))

    def save_verdict(self, run_id: str, v: wire.Verdict) -> None:
        self._exec("INSERT OR REPLACE INTO verdicts VALUES (?,?,?,?,?)",
                   (run_id, v.kind, json.dumps(v.ranks), v.detected_at, json.dumps(wire.to_dict(v))))

    # -- reads ----------------------------------------------------------------------
    def run_ids(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT run_id FROM runs ORDER BY started_at")]

    def bundle_paths(self, run_id: str) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT path FROM bundles WHERE run_id=?", (run_id,))]

    def detected_at(self, run_id: str) -> dict[tuple[str, str], str]:
        with self._lock:
            rows = self._db.execute("SELECT kind, ranks, detected_at FROM verdicts WHERE run_id=?", (run_id,))
            return {(k, r): d for k, r, d in rows}

    def load_run(self, run_id: str) -> Optional[RunState]:
        with self._lock:
            row = self._db.execute(
                "SELECT world_size, started_at, hang_timeout, on_hang, interrupted, aborted, finished_at "
                "FROM runs WHERE run_id=?", (run_id,)).fetchone()
            if row is None:
                return None
            run = RunState(run_id=run_id, world_size=row[0] or 0, started_at=row[1] or 0.0,
                           hang_timeout=row[2], on_hang=row[3] or "abort", interrupted=bool(row[4]),
                           aborted=row[5], finished=row[6] is not None)
            for r in self._db.execute("SELECT * FROM ranks WHERE run_id=?", (run_id,)):
                (_, rank, local_rank, node_rank, host, pid, step, forwards, phase, lpa, exit_code, exited_at,
                 killed, enq, comp) = r
                s = run.rank(rank)
                s.local_rank, s.node_rank, s.host, s.pid = local_rank, node_rank, host, pid
                s.step, s.forwards, s.phase, s.last_progress_at = step, forwards, phase, lpa or 0.0
                s.exit_code, s.exited_at, s.killed_by_rankwatch = exit_code, exited_at, bool(killed)
                s.enqueued, s.completed = json.loads(enq or "{}"), json.loads(comp or "{}")
                s.world_size = run.world_size
            for rank, step, record in self._db.execute(
                    "SELECT rank, step, record FROM steps WHERE run_id=? ORDER BY rank, step", (run_id,)):
                run.rank(rank).add_step(wire.decode(wire.StepRecord, json.loads(record)))
            for rank, step, seqs in self._db.execute("SELECT rank, step, seqs FROM marks WHERE run_id=?", (run_id,)):
                run.rank(rank).marks[step] = json.loads(seqs)
            for rank, kind, at, step, details in self._db.execute(
                    "SELECT rank, kind, at, step, details FROM events WHERE run_id=? ORDER BY at", (run_id,)):
                run.rank(rank).events.append(wire.Event(kind=kind, at=at, step=step, details=json.loads(details)))
            for rank, data in self._db.execute("SELECT rank, data FROM fingerprints WHERE run_id=?", (run_id,)):
                run.rank(rank).fingerprints.append(json.loads(data))
            for iid, kind, opened, lpa, timeout, details in self._db.execute(
                    "SELECT id, kind, opened_at, last_progress_at, timeout, details FROM incidents WHERE run_id=?",
                    (run_id,)):
                d = json.loads(details or "{}")
                run.incidents.append(Incident(id=iid, kind=kind, opened_at=opened, last_progress_at=lpa,
                                              timeout=timeout, requested_ranks=d.pop("requested_ranks", []),
                                              ready=True, details=d))
            return run
