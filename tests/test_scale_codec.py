"""The collector's fast decoder gives what wire's decoder gives: the same
objects for good messages, a WireError for bad ones (never more lenient)."""

from __future__ import annotations

import copy
import json
import math
import time

import pytest

from rankwatch import wire
from rankwatch.collector import codec


def _beat(**over):
    now = time.time()
    beat = {
        "version": 1,
        "identity": {"run_id": "job-1", "rank": 3, "local_rank": 3, "world_size": 8, "node_rank": 0,
                     "host": "node-a", "pid": 1234, "attempt": 0},
        "sent_at": now, "seq": 5, "step": 12, "forwards": 12, "phase": "forward", "phase_since": now,
        "last_progress_at": now, "collectives_enqueued": {"0": 36}, "collectives_completed": {"0": 35},
        "host_memory": {"MemTotal": 1 << 34, "MemAvailable": 1 << 33, "RSS": 1 << 30},
        "step_columns": list(wire.STEP_COLUMNS),
        "step_rows": [[11, now - 1, now, 1, 0.8, 0.01, 2.5, 1.25, 0, 1, 1 << 30, None, None, None, 987654321, 123456789, 0.001]],
    }
    beat.update(over)
    return beat


def _slow(data):
    hb = wire.decode(wire.Heartbeat, copy.deepcopy(data))
    hb.steps = wire.step_records(hb)
    hb.step_rows, hb.step_columns = [], []
    return hb


def _same(a, b) -> bool:
    return json.dumps(wire.json_safe(a), sort_keys=True) == json.dumps(wire.json_safe(b), sort_keys=True)


def _row(**values):
    row = _beat()["step_rows"][0]
    for name, value in values.items():
        row[wire.STEP_COLUMNS.index(name)] = value
    return row


GOOD = [
    _beat(),
    _beat(step_rows=[]),
    _beat(step_rows=[_row(loss=float("nan"))]),  # a NaN loss is the signal: kept
    _beat(step_rows=[_row(loss="NaN", grad_norm="Infinity")]),
    _beat(step_rows=[_row(compute_s=None, rss_bytes=None)]),
    _beat(events=[{"kind": "exception", "at": time.time(), "step": 3, "details": {"message": "boom"}}]),
    _beat(marks=[{"step": 10, "seqs": {"0": 30}}]),
    _beat(fingerprints=[{"step": 9, "names": ["param:w"], "norms": [1.5]}]),
    _beat(fingerprints=[{"step": 9, "norms": [1.5, 2]}]),  # names sent only when they change
    _beat(fingerprints=[{"step": 9, "names": ["param:w"], "norms": ["NaN"]}]),  # wire's road: kept as nan
    _beat(fingerprints=[{"step": 9, "names": ["a\tb"], "norms": [1.0]}]),  # not printable: wire's road
    _beat(fingerprints=[{"step": 9, "names": ["w"], "norms": [1.0], "extra": 1}]),
    _beat(marks=[{"step": 10, "seqs": {"0": 30, "1": -1}}, {"step": 11}]),
    _beat(steps=[{"step": 10, "started_at": 1.0, "ended_at": 2.0}]),
    _beat(steps_skipped=7),
    _beat(collectives_enqueued={}, host_memory={}),
    _beat(unknown_field_from_a_newer_agent=1),
]

BAD = [
    _beat(identity={**_beat()["identity"], "rank": 8}),  # outside the world
    _beat(identity={**_beat()["identity"], "run_id": ".."}),
    _beat(identity={**_beat()["identity"], "host": "a\ud800b"}),
    _beat(identity={**_beat()["identity"], "world_size": 0}),
    _beat(identity={**_beat()["identity"], "rank": True}),
    _beat(sent_at=float("inf")),
    _beat(sent_at=1e30),
    _beat(step=-1),
    _beat(step=2**70),
    _beat(phase="for ward\n"),
    _beat(collectives_enqueued={"0": "x"}),
    _beat(step_rows=[[1, 2, 3]]),
    _beat(step_rows=[_row(step=-5)]),
    _beat(step_rows=[_row(started_at="NaN")]),
    _beat(step_rows=[_row(rss_bytes=-1)]),
    _beat(step_rows=[_row(forwards=1.5)]),
    _beat(step_columns=["step", "step"], step_rows=[[1, 2]]),
    _beat(version=99),
    _beat(identity=5),
    _beat(fingerprints=[{"step": -1, "names": ["w"], "norms": [1.0]}]),
    _beat(fingerprints=[{"step": 9, "names": ["w", "v"], "norms": [1.0]}]),
    _beat(fingerprints=[{"step": 9, "names": ["w"], "norms": [2**70]}]),
    _beat(fingerprints=[{"step": 9, "names": [5], "norms": [1.0]}]),
    _beat(fingerprints=[{"step": 9, "names": ["w"], "norms": "x"}]),
    _beat(marks=[{"step": 10, "seqs": {"0": "x"}}]),
    _beat(marks=[{"step": True, "seqs": {}}]),
    _beat(events=[{"kind": "exception", "at": time.time(), "details": "not an object"}]),
    _beat(events=[{"kind": "exception", "at": time.time(), "details": {"deep": json.loads("[" * 40 + "]" * 40)}}]),
    _beat(events=[{"kind": "bad kind!", "at": time.time(), "details": {}}]),
]


def _recorded_beats():
    """Every heartbeat a real job's relay sent (bench/data/node_reports.json.gz)."""
    import gzip
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "data" / "node_reports.json.gz"
    with gzip.open(path, "rt") as f:
        reports = [json.loads(r) for r in json.load(f)["reports"]]
    return [hb for r in reports for hb in r["heartbeats"]]


def test_recorded_heartbeats_decode_alike_and_take_the_fast_road():
    """The messages real agents send (fingerprints, marks, GPU-flavour rows)
    decode as wire decodes them, and all but events take the fast road
    (wire's generic decoder cost ~10x per beat: issue 29's ingest cost)."""
    beats = _recorded_beats()
    assert any(hb.get("fingerprints") for hb in beats) and any(hb.get("marks") for hb in beats)
    slow = 0
    for data in beats:
        assert _same(codec.decode_heartbeat(copy.deepcopy(data)), _slow(data))
        try:
            codec._fast(copy.deepcopy(data))
        except codec._Slow:
            slow += 1
            assert data.get("events"), sorted(data)
    assert slow <= sum(1 for hb in beats if hb.get("events"))


@pytest.mark.parametrize("data", GOOD)
def test_good_heartbeats_decode_alike(data):
    assert _same(codec.decode_heartbeat(copy.deepcopy(data)), _slow(data))


@pytest.mark.parametrize("data", BAD)
def test_bad_heartbeats_are_refused_alike(data):
    with pytest.raises(wire.WireError):
        _slow(data)
    with pytest.raises(wire.WireError):
        codec.decode_heartbeat(copy.deepcopy(data))


def _report(*beats, node=None) -> bytes:
    return json.dumps({"version": 1, "sent_at": time.time(), "node": node, "heartbeats": list(beats)}).encode()


@pytest.mark.parametrize("data", GOOD)
def test_good_heartbeats_in_a_node_report_decode_alike(data):
    """The typed road (a whole report through msgspec's typed structs) or,
    where it refuses, the road above: wire's values either way."""
    decoded = codec.loads_node_report(_report(data, data), 1 << 20)
    assert all(_same(hb, _slow(data)) for hb in decoded.heartbeats)


@pytest.mark.parametrize("data", BAD)
def test_bad_heartbeats_in_a_node_report_are_refused(data):
    with pytest.raises(wire.WireError):
        codec.loads_node_report(_report(_beat(), data), 1 << 20)


def test_recorded_node_reports_take_the_typed_road_alike():
    """Every report a real job's relay sent decodes in one typed pass (no
    per-value Python checks: issue 29's ingest cost) to what the generic
    road and wire's decoder give."""
    import gzip
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "data" / "node_reports.json.gz"
    with gzip.open(path, "rt") as f:
        raws = [r.encode() for r in json.load(f)["reports"]]
    assert len(raws) > 20
    for raw in raws:
        typed = codec._typed_node_report(raw)  # raises codec._Slow if it took the other road
        data = json.loads(raw)
        assert len(typed.heartbeats) == len(data["heartbeats"])
        for hb, beat in zip(typed.heartbeats, data["heartbeats"]):
            assert _same(hb, _slow(beat))
        if data.get("node") is not None:
            assert typed.node == wire.decode(wire.NodeHeartbeat, data["node"])


def test_node_reports_that_bend_the_rules_take_the_other_road():
    """What the typed structs cannot say is still checked: a rank outside
    its world, an unprintable host, a worker beyond the world size."""
    ident = _beat()["identity"]
    for beat in (_beat(identity={**ident, "rank": 8}), _beat(identity={**ident, "host": "a\x07b"}),
                 _beat(identity={**ident, "host": " a"}), _beat(marks=[{"step": 1, "seqs": {"0": 1}, "x": 2}])):
        with pytest.raises(codec._Slow):
            codec._typed_node_report(_report(beat))
    node = {"run_id": "job-1", "host": "node-a", "node_rank": 0, "world_size": 8, "sent_at": time.time(),
            "workers": [{"local_rank": 0, "rank": 9, "pid": 10}]}
    with pytest.raises(codec._Slow):
        codec._typed_node_report(_report(node=node))
    with pytest.raises(wire.WireError):
        codec.loads_node_report(_report(node=node), 1 << 20)


def test_identical_event_details_are_checked_once_and_redacted_for_every_rank(tmp_path):
    """Every rank sends the same start-up facts: decoded once (one shared,
    checked object), yet each rank's stored event is redacted and each keeps
    its own time and step."""
    from rankwatch.collector.service import Collector
    from rankwatch.config import Config

    secret = "hf_" + "a1B2" * 8
    facts = {"facts": [["mode", "train"], ["note", f"pulled with {secret}"]]}
    beats = []
    for rank in range(4):
        beat = _beat(identity={**_beat()["identity"], "rank": rank, "local_rank": rank},
                     events=[{"kind": "train_config", "at": 1000.0 + rank, "step": rank, "details": facts}])
        beats.append(beat)
    report = codec.loads_node_report(_report(*beats), 1 << 20)
    events = [hb.events[0] for hb in report.heartbeats]
    assert all(e.details is events[0].details for e in events)
    assert [(e.at, e.step) for e in events] == [(1000.0 + r, r) for r in range(4)]
    assert _same(events[2], wire.decode(wire.Event, beats[2]["events"][0]))

    collector = Collector(Config(), data_dir=tmp_path)
    try:
        collector.ingest_node_report(report)
        stored = [collector.runs["job-1"].rank(r).events for r in range(4)]
        assert all(len(s) == 1 for s in stored)
        texts = [json.dumps(s[0].details) for s in stored]
        assert all(secret not in t and "pulled with" in t for t in texts), texts
    finally:
        collector.stop()


def test_node_report_parse_bounds_and_nan_tokens():
    report = {"version": 1, "sent_at": time.time(), "node": {
        "run_id": "job-1", "host": "node-a", "node_rank": 0, "world_size": 8, "sent_at": time.time(),
        "workers": [{"local_rank": 0, "rank": 0, "pid": 10}, {"local_rank": 1, "rank": 1, "pid": 11, "alive": False,
                                                               "exit_code": -9, "exited_at": time.time()}]},
        "heartbeats": [_beat()]}
    raw = json.dumps(report).encode()
    decoded = codec.loads_node_report(raw, 1 << 20)
    assert decoded.node == wire.decode(wire.NodeHeartbeat, report["node"])
    assert decoded.heartbeats[0].steps[0].step == 11
    # A bare NaN token (older agents) still reads as wire reads it.
    nan = raw.replace(b'"step_rows": [[11, ', b'"step_rows": [[11, ').replace(b"2.5, 1.25", b"NaN, 1.25")
    assert math.isnan(codec.loads_node_report(nan, 1 << 20).heartbeats[0].steps[0].loss)
    with pytest.raises(wire.WireError):
        codec.loads_node_report(b"[" * 100_000 + b"]" * 100_000, 1 << 20)
    with pytest.raises(wire.WireError):
        codec.loads_node_report(raw, 100)
    bad_worker = json.loads(raw)
    bad_worker["node"]["workers"][0]["rank"] = 9
    with pytest.raises(wire.WireError):
        codec.loads_node_report(json.dumps(bad_worker).encode(), 1 << 20)
