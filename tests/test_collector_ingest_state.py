"""The collector's ingest as state, then storage (issue 28, part 4).

`collector/ingest.py` updates run state in memory and notes what changed in
`Changes`: tested here on a bare `RunState`, no database. `Collector`'s
ingest path makes no call on the store (a store that fails on any call
stands in for it); the store's own writer takes the noted changes, and a
restart finds them in the index."""

from __future__ import annotations

import time
from typing import Any

from rankwatch import wire
from rankwatch.collector import changes as changes_mod, codec, ingest
from rankwatch.collector.changes import Changes
from rankwatch.collector.service import Collector
from rankwatch.collector.state import RunState
from rankwatch.collector.store import Store
from rankwatch.config import Config


def _hb(rank: int, step: int, world: int = 2, run: str = "job", events: Any = (), **extra) -> wire.Heartbeat:
    now = time.time()
    data = {"identity": {"run_id": run, "rank": rank, "local_rank": rank, "world_size": world},
            "sent_at": now, "seq": step, "step": step + 1, "forwards": step + 1, "phase": "data",
            "last_progress_at": now, "collectives_enqueued": {"0": 3 * step}, "collectives_completed": {"0": 3 * step},
            "step_columns": list(wire.STEP_COLUMNS),
            "step_rows": [[step, now - 0.1, now, 1, 0.05, 0.01, 2.0, 1.0, 0, 1,
                           1 << 20, None, None, None, None, None, None]],
            "events": list(events), **extra}
    hb = codec.decode_heartbeat(data)
    hb.steps, hb.step_rows = wire.step_records(hb), []
    return hb


def _node(run: str = "job", world: int = 2, **worker) -> wire.NodeHeartbeat:
    workers = [wire.WorkerStatus(local_rank=r, rank=r, pid=100 + r) for r in range(world)]
    if worker:
        workers[worker.pop("rank")] = wire.WorkerStatus(**{"local_rank": 1, "rank": 1, "pid": 101, **worker})
    return wire.NodeHeartbeat(run_id=run, host="node-a", node_rank=0, world_size=world, sent_at=time.time(),
                              hang_timeout=30.0, workers=workers)


def test_a_heartbeat_changes_state_and_notes_what_the_index_keeps():
    run, changes = RunState(run_id="job", world_size=2), Changes()
    effect = ingest.heartbeat(run, _hb(1, 4), time.time(), changes)
    state = run.ranks[1]
    assert (state.step, state.phase, state.enqueued, sorted(state.steps)) == (5, "data", {"0": 12}, [4])
    assert effect == ingest.Effect(touched=True, urgent=False)
    noted = changes.take()
    # The index's part of the beat (its record), not the beat itself.
    assert [(b.run_id, b.rank, b.world_size, [r.step for r in b.steps]) for b in noted.beats] == [("job", 1, 2, [4])]
    assert noted.ranks == {("job", 1): state}
    assert not changes.take(), "taken once"


def test_an_exception_is_urgent_and_a_bare_beat_touches_nothing():
    run, changes = RunState(run_id="job", world_size=2), Changes()
    crash = {"kind": "exception", "at": time.time(), "step": 3, "details": {"type": "RuntimeError", "message": "x"}}
    assert ingest.heartbeat(run, _hb(0, 3, events=[crash]), time.time(), changes).urgent
    bare = _hb(0, 4)
    bare.steps = []
    assert ingest.heartbeat(run, bare, time.time(), changes) == ingest.Effect()


def test_a_late_older_beat_does_not_take_the_phase_back():
    run, changes = RunState(run_id="job", world_size=1), Changes()
    ingest.heartbeat(run, _hb(0, 9, world=1, phase="backward"), time.time(), changes)
    old = _hb(0, 2, world=1, phase="data")
    old.sent_at -= 60
    old.last_progress_at -= 60
    ingest.heartbeat(run, old, time.time(), changes)
    assert run.ranks[0].step == 10 and run.ranks[0].phase == "backward"


def test_a_node_view_records_an_exit_and_who_caused_it():
    run, changes = RunState(run_id="job", world_size=2), Changes()
    effect = ingest.node(run, _node(rank=1, alive=False, exit_code=-9, exited_at=5.0), "node-a#0", 10.0,
                         killed_by_rankwatch=True, changes=changes)
    assert effect.touched
    rank1 = run.ranks[1]
    assert (rank1.exit_code, rank1.exited_at, rank1.killed_by_rankwatch) == (-9, 5.0, True)
    assert run.ranks[0].vouched_at == 10.0 and run.hang_timeout == 30.0
    noted = changes.take()
    assert noted.runs == {"job": run} and list(noted.ranks) == [("job", 1)]
    assert not ingest.node(run, _node(), "node-a#0", 11.0, False, changes).touched


def test_fingerprints_without_names_take_the_ranks_last_names():
    known = [{"step": 1, "names": ["w", "b"], "norms": [1.0, 2.0]}]
    out = ingest.with_names([{"step": 2, "norms": [1.0, 2.0]}], known)
    assert out == [{"step": 2, "norms": [1.0, 2.0], "names": ["w", "b"]}]
    assert ingest.with_names([{"step": 2, "norms": [1.0]}], []) == [], "no names known yet: dropped"


def test_a_second_models_fingerprints_take_their_own_models_names():
    """A GAN fingerprints its generator (model 0, the key left out) and its
    discriminator (model 1): a print without names takes its own model's."""
    gen, disc = ["g.w"], ["d.w", "d.b"]
    known = [{"step": 1, "names": gen, "norms": [1.0]}, {"step": 1, "names": disc, "norms": [1.0, 2.0], "model": 1}]
    out = ingest.with_names([{"step": 2, "norms": [1.0], "model": 1}, {"step": 2, "norms": [1.0]}], known)
    assert [fp["names"] for fp in out] == [disc, gen]
    # Within one beat too: the generator's names, sent in full, are not the discriminator's.
    out = ingest.with_names([{"step": 3, "names": gen, "norms": [1.0]}, {"step": 3, "norms": [1.0, 2.0], "model": 1}],
                            [{"step": 2, "names": disc, "norms": [1.0, 2.0], "model": 1}])
    assert [fp["names"] for fp in out] == [gen, disc]


def test_the_journal_is_bounded_when_nothing_takes_it_and_keeps_the_dropped_beats_events(monkeypatch):
    monkeypatch.setattr(changes_mod, "MAX_BEATS", 8)
    changes, hb = Changes(), _hb(0, 1)
    crash = _hb(0, 2, events=[{"kind": "exception", "at": time.time(), "step": 2, "details": {"type": "E"}}])
    changes.heartbeat("job", 0, crash, [])
    for _ in range(19):
        changes.heartbeat("job", 0, hb, [])
    bare = _hb(0, 3)
    bare.steps = []
    changes.heartbeat("job", 0, bare, [])  # nothing for the index: not noted
    noted = changes.take()
    assert len(noted.beats) <= 8 and changes.beats_dropped == 12
    assert noted.events == [("job", 0, crash.events)]


def test_a_row_that_cannot_be_written_is_dropped_alone(tmp_path, caplog, monkeypatch):
    from rankwatch.collector import store as store_mod

    encode = store_mod._dumps_shared

    def refuse_poison(value):
        if isinstance(value, dict) and "poison" in value:
            raise ValueError("cannot encode")
        return encode(value)

    monkeypatch.setattr(store_mod, "_dumps_shared", refuse_poison)
    collector = Collector(config=Config(), data_dir=tmp_path)
    try:
        collector.ingest_heartbeat(_hb(0, 0))
        collector.ingest_heartbeat(_hb(1, 0, events=[{"kind": "note", "at": time.time(), "step": 0,
                                                      "details": {"poison": 1}}]))
        collector.store.flush()
    finally:
        collector.stop()
    again = Collector(config=Config(), data_dir=tmp_path)
    try:
        assert sorted(again.runs["job"].ranks) == [0, 1] and sorted(again.runs["job"].ranks[0].steps) == [0]
        assert "row not written" in caplog.text
    finally:
        again.stop()


class Tripwire:
    """A store that fails the test on any call."""

    def __init__(self, real: Store) -> None:
        self.real, self.calls = real, []

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.real, name)
        if callable(value):
            def refused(*a, **k):
                self.calls.append(name)
                raise AssertionError(f"the ingest path called store.{name}")
            return refused
        return value


def test_the_ingest_path_makes_no_storage_call_and_the_writer_keeps_it_all(tmp_path):
    collector = Collector(config=Config(), data_dir=tmp_path)
    real = collector.store
    collector.store = Tripwire(real)
    try:
        collector.ingest_node(_node())  # a run never seen: made in memory
        for step in range(3):
            collector.ingest_node_report(wire.NodeReport(node=_node(), heartbeats=[_hb(0, step), _hb(1, step)]))
        collector.ingest_heartbeat(_hb(1, 3))
        collector.ingest_node(_node(rank=1, alive=False, exit_code=1, exited_at=time.time()))
        assert collector.store.calls == []
        assert collector.runs["job"].ranks[1].exit_code == 1
    finally:
        collector.store = real
    real.flush()  # the writer takes the journal with everything else
    collector.stop()
    again = Collector(config=Config(), data_dir=tmp_path)  # a restart reads the index
    try:
        run = again.runs["job"]
        assert sorted(run.ranks) == [0, 1] and run.ranks[1].exit_code == 1
        assert run.ranks[1].step == 4 and sorted(run.ranks[0].steps) == [0, 1, 2]
    finally:
        again.stop()


def test_a_read_only_store_starts_no_writer(tmp_path):
    Store(tmp_path / "i.sqlite").close()
    store = Store(tmp_path / "i.sqlite", readonly=True, changes=Changes())
    assert store._thread is None
    store.close()


def test_a_report_that_waited_in_the_collectors_queue_neither_silences_its_ranks_nor_moves_their_clock():
    """A relay's report arrives, then waits 2.5 s for ingest behind a busy
    collector. Its ranks' beats (0.9 s old when the relay sent them) are
    measured against when it arrived: the node vouches for them as of then,
    and their clock offset holds transit only. Measured against when ingest
    reached it, the wait read as 2.5 s of silence (the hang watch asks a
    rank silent 3 heartbeat intervals about from outside) and as transit."""
    collector = Collector(Config(hang_timeout=30.0))
    sent = time.time()
    workers = [wire.WorkerStatus(local_rank=r, rank=r, pid=100 + r) for r in range(2)]
    view = wire.NodeHeartbeat(run_id="q", host="n0", node_rank=0, world_size=2, sent_at=sent, workers=workers)
    beats = [wire.Heartbeat(identity=wire.RankIdentity(run_id="q", rank=r, local_rank=r, world_size=2, host="n0",
                                                       pid=100 + r),
                            sent_at=sent - 0.9, seq=5, step=3, phase="forward", last_progress_at=sent - 0.9)
             for r in range(2)]
    collector.ingest_node_report(wire.NodeReport(node=view, heartbeats=beats), now=sent + 2.5, arrived_at=sent + 0.01)
    for state in collector.runs["q"].ranks.values():
        assert state.silent_for(sent + 2.5) < 0.1
        assert abs(state.clock_offset - 0.91) < 1e-6  # relay hold and network, not the queue
        assert state.beat_at <= sent + 0.01 + 1e-6
    collector.stop()
