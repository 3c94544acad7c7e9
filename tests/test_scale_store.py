"""The collector's index: written off the request path, read back after a
restart, read-only for `rankwatch analyze`, degraded (never a traceback)
when the disk refuses."""

from __future__ import annotations

import os
import time

import pytest

from rankwatch import wire
from rankwatch.collector import codec
from rankwatch.collector.service import Collector
from rankwatch.collector import store as store_mod
from rankwatch.collector.state import RunState
from rankwatch.collector.store import Store
from rankwatch.config import Config


def _hb(rank: int, step: int, world: int = 2, run: str = "job", **extra) -> wire.Heartbeat:
    now = time.time()
    data = {"identity": {"run_id": run, "rank": rank, "local_rank": rank, "world_size": world},
            "sent_at": now, "seq": step, "step": step + 1, "forwards": step + 1, "phase": "data",
            "last_progress_at": now, "collectives_enqueued": {"0": 3 * step}, "collectives_completed": {"0": 3 * step},
            "step_columns": list(wire.STEP_COLUMNS),
            "step_rows": [[step, now - 0.1, now, 1, 0.05, 0.01, float("nan") if step == 7 else 2.0, 1.0, 0, 1,
                           1 << 20, None, None, None, None, None, None]], **extra}
    return codec.decode_heartbeat(data)


def test_restart_reloads_runs_and_verdicts_from_the_index(tmp_path):
    collector = Collector(config=Config(), data_dir=tmp_path)
    for step in range(10):
        for rank in range(2):
            collector.ingest_heartbeat(_hb(rank, step))
    verdict = wire.Verdict(kind="straggler", ranks=[1], step=3, first_seen_at="2026-01-01T00:00:00Z",
                           detected_at="2026-01-01T00:00:01Z", summary="rank 1 is slow")
    collector.store.save_verdict("job", verdict)
    collector.stop()  # flushes the write-behind queue

    again = Collector(config=Config(), data_dir=tmp_path)
    try:
        run = again.runs["job"]  # no 404 "unknown run" after a restart
        assert sorted(run.ranks) == [0, 1]
        assert run.ranks[1].step == 10
        assert sorted(run.ranks[0].steps)[-1] == 9
        assert run.ranks[0].steps[7].loss != run.ranks[0].steps[7].loss  # the NaN loss survives
        assert run.ranks[0].enqueued == {"0": 27}
        assert [v.kind for v in again.report("job").verdicts] == ["straggler"]
        again.ingest_heartbeat(_hb(0, 10))  # the run goes on
        assert again.runs["job"].ranks[0].step == 11
    finally:
        again.stop()


def test_a_finished_run_leaves_memory_and_is_served_from_the_index(tmp_path, monkeypatch):
    from rankwatch.collector import service

    monkeypatch.setattr(service, "FINISHED_KEPT_S", 0.0)
    collector = Collector(config=Config(), data_dir=tmp_path)
    try:
        collector.ingest_heartbeat(_hb(0, 0, world=1, run="done"))
        collector.finish("done")
        collector.store.flush()
        collector._evict_checked = 0.0
        collector._evict_finished(time.time())  # seen finished
        collector._evict_checked = 0.0
        collector._evict_finished(time.time() + 1)
        assert "done" not in collector.runs
        assert collector.report("done").world_size == 1  # from the index
        del collector.runs["done"]  # out of memory again
        collector._index_only.add("done")
        # A late message is not a new run: the run comes back from the index
        # (the one read of it on ingest, off the steady path).
        collector.ingest_heartbeat(_hb(0, 1, world=1, run="done"))
        assert collector.runs["done"].finished and sorted(collector.runs["done"].ranks[0].steps) == [0, 1]
    finally:
        collector.stop()


def test_the_index_opens_read_only_without_changing_it(tmp_path):
    collector = Collector(config=Config(), data_dir=tmp_path)
    collector.ingest_heartbeat(_hb(0, 0))
    collector.stop()
    index = tmp_path / "collector.sqlite"
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    os.chmod(tmp_path, 0o555)
    try:
        store = Store(index, readonly=True)
        assert store.run_ids() == ["job"]
        assert store.load_run("job").ranks[0].step == 1
        store.save_run(store.load_run("job"))  # a no-op
        store.close()
    finally:
        os.chmod(tmp_path, 0o755)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_data_dir_degrades_instead_of_failing(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    os.chmod(folder, 0o555)
    try:
        collector = Collector(config=Config(), data_dir=folder)
        collector.ingest_heartbeat(_hb(0, 0))
        assert collector.runs["job"].ranks[0].step == 1
        assert collector.store.degraded and "index" in collector.store.degraded
        collector.stop()
    finally:
        os.chmod(folder, 0o755)


def test_a_disk_that_fails_mid_run_degrades_once(tmp_path, caplog):
    collector = Collector(config=Config(), data_dir=tmp_path)
    try:
        collector.ingest_heartbeat(_hb(0, 0))
        collector.store.flush()

        class Full:
            def execute(self, *a, **k):
                import sqlite3

                raise sqlite3.OperationalError("database or disk is full")

            executemany = execute

            def close(self):
                pass

        collector.store._db = Full()
        for step in range(1, 4):
            collector.ingest_heartbeat(_hb(0, step))
            collector.store.flush()
        assert collector.runs["job"].ranks[0].step == 4  # memory stays the truth
        assert "disk is full" in collector.store.degraded
        assert sum("disk is full" in r.getMessage() for r in caplog.records) == 1  # said once
    finally:
        collector.stop()


def test_a_bulk_write_takes_a_bounded_share_of_ranks_rows_longest_waiting_first(tmp_path, monkeypatch):
    """100,000 ranks' rows in one flush was ~0.5 s of CPU in one burst:
    a bulk write takes RANK_ROWS_PER_BULK of them, those queued longest; a
    stop writes them all."""
    monkeypatch.setattr(store_mod, "RANK_ROWS_PER_BULK", 3)
    store = Store(tmp_path / "i.sqlite", flush_interval=3600.0)  # its writer sleeps: the test flushes
    run = RunState("big", world_size=7)
    store.save_run(run)
    for r in range(7):
        store.save_rank("big", run.rank(r))

    def written() -> list[int]:
        return [rank for (rank,) in store._rows("SELECT rank FROM ranks WHERE run_id='big' ORDER BY rank")]

    store._flush_once(bulk=True, everything=False)
    assert written() == [0, 1, 2]
    run.rank(0).step = 5
    store.save_rank("big", run.rank(0))  # queued again: after those still waiting
    store.save_rank("big", run.rank(3))  # queued again while waiting: keeps its place
    store._flush_once(bulk=True, everything=False)
    assert written() == [0, 1, 2, 3, 4, 5]
    store._flush_once(bulk=True, everything=False)
    assert written() == list(range(7))
    assert store._rows("SELECT step FROM ranks WHERE run_id='big' AND rank=0") == [(5,)]
    for r in range(7):
        run.rank(r).step = 9
        store.save_rank("big", run.rank(r))
    store._flush_once(bulk=True, everything=True)  # a stop's (or a run's end's) flush: every row
    assert store._rows("SELECT count(*) FROM ranks WHERE run_id='big' AND step=9") == [(7,)]
    store.close()
