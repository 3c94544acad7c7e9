"""Hostile input against the collector's boundary (light: an in-process
collector and its HTTP server on 127.0.0.1, no training).

What a user sees: every bad message gets a clear 4xx naming the field, the
collector's state is unchanged by it, nothing is written outside the run
dir, work and memory stay bounded (peaks asserted), and afterwards the
collector still serves and still detects another run's hang.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import resource
import subprocess
import sys
import tarfile
import time
import tracemalloc
import urllib.error
import urllib.request
import zlib
from pathlib import Path

import pytest

from rankwatch import wire
from rankwatch.bundles import BundleError, pack, unpack
from rankwatch.collector import Collector, CollectorServer
from rankwatch.collector.offline import AnalyzeError, analyze_path
from rankwatch.collector.service import RequestError
from rankwatch.config import Config
from rankwatch.redact import REDACTED, redact_obj, redact_text

TOKEN = "hostile-test-token"
MiB = 1024 * 1024


def _strict_loads(text):
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def server(tmp_path):
    collector = Collector(config=Config(hang_timeout=5.0, evidence_window=1.0, on_hang="wait"), data_dir=tmp_path / "data")
    from rankwatch.collector.metrics import CollectorMetrics

    metrics = CollectorMetrics(collector)
    srv = CollectorServer(collector, host="127.0.0.1", port=0, token=TOKEN, metrics_handler=metrics.render).start()
    yield srv
    srv.stop()
    collector.stop()


def _request(url, path, body=None, content_type="application/json", headers=None, token=TOKEN):
    req = urllib.request.Request(url + path, data=body, method="POST" if body is not None else "GET")
    req.add_header("Content-Type", content_type)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _hb(run="good", rank=0, world=2, step=1, at=None, **fields) -> dict:
    at = at or time.time()
    base = wire.to_dict(wire.Heartbeat(identity=wire.RankIdentity(run_id=run, rank=rank, local_rank=rank, world_size=world,
                                                                  host="node-a", pid=1000 + rank),
                                       sent_at=at, seq=step, step=step, forwards=step, phase="forward",
                                       phase_since=at, last_progress_at=at))
    for key, value in fields.items():
        if key.startswith("identity."):
            base["identity"][key.split(".", 1)[1]] = value
        else:
            base[key] = value
    return base


def _raw(obj) -> bytes:
    # Python's json writes NaN / Infinity tokens and lone surrogates as escapes: what an attacker can send.
    return json.dumps(obj).encode()


def _state(collector: Collector):
    return {rid: (run.world_size, sorted(run.ranks), [(r, s.host, s.pid, s.step) for r, s in sorted(run.ranks.items())])
            for rid, run in collector.runs.items()}


def _serves(srv: CollectorServer) -> None:
    for path in ("/healthz", "/v1/status", "/metrics"):
        status, body = _request(srv.url, path)
        assert status == 200, (path, status, body[:300])
        if path != "/metrics":
            _strict_loads(body)


HOSTILE_HEARTBEATS = {
    "nan-sent-at": (_raw({**_hb(run="x1"), "sent_at": math.nan}), "sent_at"),
    "inf-phase-since": (_raw({**_hb(run="x1"), "phase_since": math.inf}), "phase_since"),
    "overflowing-number": (_hb and json.dumps(_hb(run="x1")).replace('"step": 1,', '"step": 1e999,', 1).encode(), "step"),
    "rank-1e30": (_raw(_hb(run="x1", **{"identity.rank": 1e30})), "rank"),
    "pid-2^64": (_raw(_hb(run="x1", **{"identity.pid": 2**64})), "pid"),
    "seq-2^64": (_raw({**_hb(run="x1"), "seq": 2**64}), "seq"),
    "step-negative": (_raw({**_hb(run="x1"), "step": -1}), "step"),
    "surrogate-host": (_raw(_hb(run="x1", **{"identity.host": "node-\ud800"})), "host"),
    "control-host": (_raw(_hb(run="x1", **{"identity.host": "a\nb"})), "host"),
    "world-0": (_raw(_hb(run="x1", **{"identity.world_size": 0})), "world_size"),
    "world-minus-1": (_raw(_hb(run="x1", **{"identity.world_size": -1})), "world_size"),
    "world-1e9": (_raw(_hb(run="x1", **{"identity.world_size": 10**9})), "world_size"),
    "world-float": (_raw(_hb(run="x1", **{"identity.world_size": 1e9})), "world_size"),
    "rank-outside-world": (_raw(_hb(run="x1", **{"identity.rank": 5})), "rank"),
    "run-id-dot": (_raw(_hb(run=".")), "run id"),
    "run-id-dotdot": (_raw(_hb(run="..")), "run id"),
    "run-id-path": (_raw(_hb(run="../../etc")), "run id"),
    "phase-newline": (_raw({**_hb(run="x1"), "phase": "for\nward"}), "phase"),
    "deep-json-100k": (b'{"identity":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
    "deep-details": (_raw({**_hb(run="x1"), "events": [{"kind": "x", "at": 1.0, "details": {"d": json.loads("[" * 20 + "]" * 20)}}]}), "nested"),
    "many-objects": (b'{"identity":{},"fingerprints":[' + b",".join([b"{}"] * 300_000) + b"]}", "objects"),
    "fingerprint-strings": (_raw({**_hb(run="x1"), "fingerprints": [{"step": 1, "names": ["a"], "norms": ["x"]}]}), "norms"),
    "host-memory-negative": (_raw({**_hb(run="x1"), "host_memory": {"RSS": -5}}), "host_memory"),
    "collective-seq-huge": (_raw({**_hb(run="x1"), "collectives_enqueued": {"0": 2**70}}), "collectives_enqueued"),
    "not-an-object": (b"[1,2,3]", "expected an object"),
    "not-json": (b"{nope", "not valid JSON"),
    "future-version": (_raw({**_hb(run="x1"), "version": 99}), "version"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_HEARTBEATS))
def test_hostile_heartbeat_gets_a_clear_400_and_changes_nothing(server, name):
    payload, needle = HOSTILE_HEARTBEATS[name]
    ok = _request(server.url, "/v1/heartbeat", _raw(_hb(run="good", rank=0)))
    assert ok[0] == 200
    before = _state(server.collector)
    status, body = _request(server.url, "/v1/heartbeat", payload)
    assert status == 400, (status, body[:300])
    error = _strict_loads(body)["error"]
    assert needle.lower() in error.lower(), error
    assert _state(server.collector) == before
    _serves(server)


HOSTILE_NODES = {
    "world-1e9": {"world_size": 10**9},
    "worker-pid-2^64": {"workers": [{"local_rank": 0, "rank": 0, "pid": 2**64}]},
    "worker-rank-1e30": {"workers": [{"local_rank": 0, "rank": 1e30, "pid": 5}]},
    "worker-outside-world": {"workers": [{"local_rank": 0, "rank": 7, "pid": 5}]},
    "hang-timeout-string": {"hang_timeout": "soon"},
    "hang-timeout-negative": {"hang_timeout": -1},
    "on-hang-bogus": {"on_hang": "explode"},
    "run-id-dotdot": {"run_id": ".."},
    "host-surrogate": {"host": "\udfff"},
    "exit-code-huge": {"workers": [{"local_rank": 0, "rank": 0, "pid": 5, "alive": False, "exit_code": 2**40}]},
}


@pytest.mark.parametrize("name", sorted(HOSTILE_NODES))
def test_hostile_node_report_gets_a_clear_400(server, name):
    node = {**wire.to_dict(wire.NodeHeartbeat(run_id="good", host="node-a", node_rank=0, world_size=2,
                                              sent_at=time.time())), **HOSTILE_NODES[name]}
    before = _state(server.collector)
    status, body = _request(server.url, "/v1/nodes", _raw(node))
    assert status == 400, (status, body[:300])
    assert _strict_loads(body)["error"]
    assert _state(server.collector) == before
    _serves(server)


def test_oversized_body_is_refused_before_it_is_read(server):
    import socket

    host, port = server.httpd.server_address[:2]
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(f"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {wire.MAX_MESSAGE_BYTES + 1}\r\n\r\n".encode())
        answer = sock.recv(4096).decode("latin-1")
    assert answer.startswith("HTTP/1.1 413"), answer[:200]
    _serves(server)


def test_non_finite_optional_values_map_to_none():
    node = {**wire.to_dict(wire.NodeHeartbeat(run_id="good", host="node-a", node_rank=0, world_size=2,
                                              sent_at=time.time())), "hang_timeout": math.nan}
    assert wire.loads(wire.NodeHeartbeat, _raw(node)).hang_timeout is None  # NaN: adaptive, as if unset


def test_finish_with_bad_exits_is_refused(server):
    for exits in ({"x": {"exit_code": 1, "exited_at": 1.0}}, {"0": {"exit_code": 2**70, "exited_at": 1.0}},
                  {"-1": {"exit_code": 1, "exited_at": 1.0}}):
        status, body = _request(server.url, "/v1/runs/good/finish", _raw({"exits": exits}))
        assert status == 400, (exits, status, body[:200])
    status, _ = _request(server.url, "/v1/runs/../finish", _raw({}))
    assert status in (400, 404)


def test_non_finite_values_are_kept_as_signal_and_written_as_strict_json(server, tmp_path):
    now = time.time()
    step = {"step": 0, "started_at": now - 1, "ended_at": now, "loss": math.nan, "grad_norm": math.inf,
            "compute_s": math.nan}
    assert _request(server.url, "/v1/heartbeat", _raw({**_hb(run="nan-run"), "steps": [step]}))[0] == 200
    record = server.collector.runs["nan-run"].ranks[0].steps[0]
    assert math.isnan(record.loss) and record.grad_norm == math.inf and record.compute_s is None
    for path in ("/v1/status", "/v1/runs/nan-run/report"):
        status, body = _request(server.url, path)
        assert status == 200
        _strict_loads(body)
    report = server.collector.finish("nan-run")
    from rankwatch.outputs import report as report_mod

    report_mod.write(report, tmp_path / "report.json")
    _strict_loads((tmp_path / "report.json").read_text())
    assert wire.json_text({"x": [math.nan, -math.inf]}) == '{"x": ["NaN", "-Infinity"]}'


# --------------------------------------------------------------------------
# Bundles
# --------------------------------------------------------------------------


def _manifest(run="good", rank=0, world=2, incident="hang-1", **kw) -> wire.BundleManifest:
    return wire.BundleManifest(run_id=run, rank=rank, local_rank=rank, world_size=world, host="node-a", pid=1000 + rank,
                               step=1, created_at=time.time(), reason="hang", incident=incident, **kw)


def _manifest_bytes(**kw) -> bytes:
    return wire.json_text(wire.to_dict(_manifest(**kw))).encode()


def _ustar(name: str, size: int, typeflag: bytes = tarfile.REGTYPE) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.type = typeflag
    return info.tobuf(format=tarfile.USTAR_FORMAT if typeflag not in (tarfile.GNUTYPE_LONGNAME,)
                      else tarfile.GNU_FORMAT)


def _gzip_stream(parts) -> bytes:
    """Concatenate byte chunks (or (byte, count) repeats) into one gzip stream, cheaply."""
    comp = zlib.compressobj(6, zlib.DEFLATED, 31)
    out = []
    for part in parts:
        if isinstance(part, tuple):
            chunk, count = part
            for _ in range(count):
                out.append(comp.compress(chunk))
        else:
            out.append(comp.compress(part))
    out.append(comp.flush())
    return b"".join(out)


def _member(name: str, data: bytes) -> bytes:
    return _ustar(name, len(data)) + data + b"\0" * (-len(data) % 512)


def _bomb_gnu_long_name() -> bytes:
    # An 'L' header announcing a 256 MiB name: tarfile reads it whole into memory.
    m = _manifest_bytes()
    return _gzip_stream([_member("manifest.json", m), _ustar("././@LongLink", 256 * MiB, tarfile.GNUTYPE_LONGNAME),
                         (b"a" * MiB, 256), b"\0" * 1024])


def _bomb_pax() -> bytes:
    m = _manifest_bytes()
    return _gzip_stream([_member("manifest.json", m), _ustar("././@PaxHeader", 256 * MiB, tarfile.XHDTYPE),
                         (b"a" * MiB, 256), b"\0" * 1024])


def _bomb_gzip() -> bytes:
    # 40 opaque members of 30 MiB of zeros: 1.2 GiB inflated from ~1.2 MiB.
    m = _manifest_bytes()
    parts = [_member("manifest.json", m)]
    for k in range(40):
        parts += [_ustar(f"blob{k}.pickle", 30 * MiB), (b"\0" * MiB, 30)]
    return _gzip_stream(parts + [b"\0" * 1024])


def _bomb_nested_json() -> bytes:
    # ~24 MiB of tiny nested objects in each JSON member a bundle may hold.
    blob = b"[" + b",".join([b'{"a":{"b":[]}}'] * 1_700_000) + b"]"
    names = ["stacks.json", "metrics.json", "memory.json"]
    return _gzip_stream([_member("manifest.json", _manifest_bytes())] + [_member(n, blob) for n in names]
                        + [b"\0" * 1024])


def _bomb_nested_json_in_limits() -> bytes:
    # Two ~24 MiB members of tiny objects: within the byte limits, far beyond the object budget.
    blob = b"[" + b",".join([b'{"a":{"b":[]}}'] * 1_700_000) + b"]"
    return _gzip_stream([_member("manifest.json", _manifest_bytes()), _member("stacks.json", blob),
                         _member("metrics.json", blob), b"\0" * 1024])


def _bomb_budget_json() -> bytes:
    # Each member within the per-member limits; together beyond the bundle's object budget.
    blob = b"[" + b",".join([b'{"a":{}}'] * 9_000) + b"]"
    names = [f"extra{i}.json" for i in range(40)]
    return _gzip_stream([_member("manifest.json", _manifest_bytes())] + [_member(n, blob) for n in names]
                        + [b"\0" * 1024])


def _bomb_deep_json() -> bytes:
    blob = b"[" * 100_000 + b"]" * 100_000
    return _gzip_stream([_member("manifest.json", _manifest_bytes()), _member("stacks.json", blob), b"\0" * 1024])


def _bomb_many_members() -> bytes:
    return _gzip_stream([_member("manifest.json", _manifest_bytes())]
                        + [_member(f"note{i}.txt", b"x") for i in range(100_000)] + [b"\0" * 1024])


# name -> (builder, refused whole?, peak limit in MiB)
BOMBS = {
    "gnu-long-name": (_bomb_gnu_long_name, True, 32),
    "pax-header": (_bomb_pax, True, 32),
    "gzip-bomb": (_bomb_gzip, True, 32),
    "nested-json": (_bomb_nested_json, True, 192),
    "nested-json-in-limits": (_bomb_nested_json_in_limits, False, 192),
    "json-object-budget": (_bomb_budget_json, False, 128),
    "deep-json": (_bomb_deep_json, False, 32),
    "many-members": (_bomb_many_members, True, 32),
}
PEAKS: dict[str, float] = {}


@pytest.fixture(scope="module")
def bombs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bombs")
    out = {}
    for name, (build, _, _) in BOMBS.items():
        path = folder / f"{name}.tar.gz"
        path.write_bytes(build())
        out[name] = path
    return out


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_bundle_bomb_is_bounded_in_memory_and_never_stored(tmp_path, bombs, name):
    _, refused, limit_mib = BOMBS[name]
    data = bombs[name].read_bytes()
    assert len(data) < 4 * MiB  # small on the wire
    collector = Collector(config=Config(), data_dir=tmp_path / "data")
    try:
        tracemalloc.start()
        try:
            if refused:
                with pytest.raises(RequestError) as err:
                    collector.ingest_bundle(data)
                assert err.value.status == 400 and "bundle rejected" in str(err.value)
            else:
                collector.ingest_bundle(data)
        finally:
            peak = tracemalloc.get_traced_memory()[1] / MiB
            tracemalloc.stop()
    finally:
        collector.stop()
    PEAKS[name] = peak
    print(f"\n{name}: {len(data) / 1024:.0f} KiB archive, peak {peak:.1f} MiB traced in the collector")
    assert peak < limit_mib, f"{name}: peak {peak:.1f} MiB"
    stored = list((tmp_path / "data").rglob("*.tar.gz"))
    assert bool(stored) == (not refused)
    if stored:  # what is stored is the validated re-pack: the bad member is gone, a note says why
        again = unpack(stored[0].read_bytes())
        assert any("dropped" in note for note in again.manifest.notes), again.manifest.notes


@pytest.mark.parametrize("name", ["gnu-long-name", "pax-header", "nested-json", "nested-json-in-limits"])
def test_analyze_of_a_bomb_stays_small(tmp_path, bombs, name):
    run_dir = tmp_path / "run"
    (run_dir / "bundles" / "hang-1").mkdir(parents=True)
    (run_dir / "bundles" / "hang-1" / "rank-00000.tar.gz").write_bytes(bombs[name].read_bytes())
    good = pack(_manifest(rank=1), {"stacks.json": [{"main": True, "frames": []}]})
    (run_dir / "bundles" / "hang-1" / "rank-00001.tar.gz").write_bytes(good)
    # VmHWM (peak RSS of this process image; ru_maxrss would carry pytest's over the exec).
    code = ("import sys; from rankwatch.cli import main; rc = main(['analyze', sys.argv[1], '--json']); "
            "sys.stdout.flush(); hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]; "
            "print('MAXRSS', hwm.split()[1], file=sys.stderr); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rss_mib = int(proc.stderr.split("MAXRSS")[1].split()[0]) / 1024
    print(f"\nrankwatch analyze with {name}: max RSS {rss_mib:.0f} MiB")
    assert rss_mib < 256, rss_mib
    assert "rank-00000.tar.gz" in proc.stderr  # the bad bundle is named in a warning
    _strict_loads(proc.stdout)


WRONG_SHAPES = {
    "stacks-not-a-list": {"stacks.json": {"main": True}},
    "frame-line-string": {"stacks.json": [{"main": True, "frames": [{"file": "a.py", "line": "x", "name": "f"}]}]},
    "fr-entries-scalar": {"flight_recorder.json": {"entries": 5}},
    "fr-seq-string": {"flight_recorder.json": {"entries": [{"collective_seq_id": "x", "profiling_name": "gloo:all_reduce"}]}},
    "metrics-step-nan": {"metrics.json": {"steps": [{"step": "NaN", "started_at": 1, "ended_at": 2}]}},
    "metrics-events-bad": {"metrics.json": {"events": [{"kind": 5, "at": "x"}]}},
    "pg-status-list": {"collectives.json": {"pg_status": [1, 2]}},
    "snapshot-sizes-strings": {"memory_snapshot.json": {"snapshot": {"segments": [{"total_size": "big", "blocks": []}]}}},
    "profile-ops-not-objects": {"profile_summary.json": {"operations": [1, 2]}},
    "exception-message-object": {"exception.json": {"type": "E", "message": {"x": 1}}},
}


@pytest.mark.parametrize("name", sorted(WRONG_SHAPES))
def test_wrong_shaped_member_is_a_clear_note_not_a_traceback(server, name):
    members = WRONG_SHAPES[name]
    archive = pack(_manifest(run="shapes", rank=0), members)
    status, body = _request(server.url, "/v1/bundles", archive, "application/gzip",
                            headers={"X-Rankwatch-Run": "shapes", "X-Rankwatch-Rank": "0"})
    assert status == 200, body[:300]
    bundle = unpack(archive)
    member = next(iter(members))
    assert member not in bundle.json_members
    assert any(note.startswith(f"{member}: dropped") for note in bundle.manifest.notes), bundle.manifest.notes
    status, body = _request(server.url, "/v1/runs/shapes/report")
    assert status == 200
    _strict_loads(body)


def test_bundle_ids_and_ranks_are_checked_before_anything_is_written(server, tmp_path):
    data_dir = tmp_path / "data"
    assert _request(server.url, "/v1/heartbeat", _raw(_hb(run="good", rank=0, world=2)))[0] == 200
    cases = {
        "incident-dotdot": pack(_manifest(incident=".."), {}),
        "incident-dot": pack(_manifest(incident="."), {}),
        "run-dot": pack(_manifest(run="."), {}),
        "rank-outside-world": pack(_manifest(rank=5, world=8), {}),
        "world-0": None,
    }
    raw = wire.to_dict(_manifest())
    raw["world_size"] = 0
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.USTAR_FORMAT) as tar:
        blob = json.dumps(raw).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(blob)
        tar.addfile(info, io.BytesIO(blob))
    cases["world-0"] = buf.getvalue()
    before = sorted(str(p) for p in data_dir.rglob("*"))
    for name, archive in cases.items():
        status, body = _request(server.url, "/v1/bundles", archive, "application/gzip")
        assert 400 <= status < 500, (name, status, body[:200])
        assert _strict_loads(body)["error"]
    after = sorted(str(p) for p in data_dir.rglob("*") if "collector.sqlite" not in str(p))
    assert [p for p in after if p not in before] == [], "a refused bundle left files behind"
    _serves(server)


def test_forged_bundle_claiming_another_rank_is_refused(server):
    """The sender says it is rank 1 (its headers); the archive claims rank 0."""
    assert _request(server.url, "/v1/heartbeat", _raw(_hb(run="good", rank=0)))[0] == 200
    archive = pack(_manifest(run="good", rank=0), {"stacks.json": [{"main": True, "frames": []}]})
    status, body = _request(server.url, "/v1/bundles", archive, "application/gzip",
                            headers={"X-Rankwatch-Run": "good", "X-Rankwatch-Rank": "1"})
    assert 400 <= status < 500, (status, body[:200])
    assert not list(Path(server.collector.data_dir).rglob("rank-00000*.tar.gz"))


def test_after_every_bad_input_another_runs_hang_is_still_detected(server):
    """Garbage of every kind above, then a healthy two-rank run that stops
    progressing: the collector still opens a hang incident and names it."""
    for name in sorted(HOSTILE_HEARTBEATS):
        _request(server.url, "/v1/heartbeat", HOSTILE_HEARTBEATS[name][0])
    for name in sorted(HOSTILE_NODES):
        node = {**wire.to_dict(wire.NodeHeartbeat(run_id="victim", host="node-b", node_rank=0, world_size=2,
                                                  sent_at=time.time())), **HOSTILE_NODES[name]}
        _request(server.url, "/v1/nodes", _raw(node))
    for archive in (b"garbage", _bomb_deep_json(), pack(_manifest(incident=".."), {})):
        _request(server.url, "/v1/bundles", archive, "application/gzip")
    collector = server.collector
    t0 = time.time()
    for step in range(1, 6):  # both ranks progress for 5 steps, then stop
        for rank in (0, 1):
            at = t0 + step
            rec = {"step": step - 1, "started_at": at - 1, "ended_at": at}
            collector.ingest_heartbeat(wire.decode(wire.Heartbeat, _hb(run="victim", rank=rank, step=step, at=at,
                                                                        steps=[rec])), now=at)
        collector.tick(t0 + step)
    last = t0 + 5
    for k in range(1, 40):  # heartbeats keep coming, progress does not
        now = last + k
        for rank in (0, 1):
            collector.ingest_heartbeat(wire.decode(wire.Heartbeat, _hb(run="victim", rank=rank, step=5, at=last)),
                                       now=now)
        collector.tick(now)
    run = collector.runs["victim"]
    assert any(i.kind == "hang" for i in run.incidents), run.incidents
    report = collector.finish("victim")
    assert [v.kind for v in report.verdicts] == ["hang"], wire.json_text(report)
    _serves(server)


# --------------------------------------------------------------------------
# analyze: read-only, and a corrupt index is a clear error
# --------------------------------------------------------------------------


def _run_dir_with_index(tmp_path) -> Path:
    run_dir = tmp_path / "run"
    collector = Collector(config=Config(), data_dir=run_dir, run_dir_for=lambda run_id: run_dir)
    t0 = time.time()
    for rank in (0, 1):
        collector.ingest_heartbeat(wire.decode(wire.Heartbeat, _hb(run="offline", rank=rank, step=3, at=t0)), now=t0)
    collector.ingest_bundle(pack(_manifest(run="offline", rank=1), {"stacks.json": [{"main": True, "frames": []}]}))
    collector.finish("offline")
    collector.stop()
    return run_dir


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_analyze_leaves_the_run_dir_byte_identical(tmp_path):
    run_dir = _run_dir_with_index(tmp_path)
    before = _digest(run_dir)
    assert "collector.sqlite" in before
    os.chmod(run_dir, 0o555)  # even a read-only run dir is enough
    try:
        report = analyze_path(run_dir)
    finally:
        os.chmod(run_dir, 0o755)
    assert report.run_id == "offline"
    assert _digest(run_dir) == before


def test_analyze_of_a_corrupt_index_is_a_clear_error(tmp_path):
    run_dir = _run_dir_with_index(tmp_path)
    for extra in run_dir.glob("collector.sqlite-*"):
        extra.unlink()
    (run_dir / "collector.sqlite").write_bytes(b"SQLite format 3\0" + os.urandom(8192))
    report = analyze_path(run_dir)  # the bundles still tell something
    assert report.run_id == "offline"
    for bundle in run_dir.rglob("*.tar.gz"):
        bundle.unlink()
    with pytest.raises(AnalyzeError, match="not a readable rankwatch index"):
        analyze_path(run_dir)
    proc = subprocess.run([sys.executable, "-m", "rankwatch.cli", "analyze", str(run_dir)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "not a readable rankwatch index" in proc.stderr
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------
# Secrets and the supervisor
# --------------------------------------------------------------------------


def test_secrets_are_redacted_by_value_and_by_shape(monkeypatch):
    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("MY_SERVICE_PASSWORD", "correct-horse-battery")
    import rankwatch.redact as redact_mod

    monkeypatch.setattr(redact_mod, "_cache", (-1e9, None))
    text = (f"failed with key {secret} and hf_abcdefghijklmnopqrstuvwxyz012345 from "
            f"https://user:pw@example.com, Authorization: Bearer abcdef123456789, "
            f"eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV, "
            f"AKIAIOSFODNN7EXAMPLE password=hunter22 correct-horse-battery")
    out = redact_text(text)
    for leaked in (secret, "hf_abcdefghij", "user:pw", "abcdef123456789", "eyJhbGci", "AKIAIOSFODNN7EXAMPLE",
                   "hunter22", "correct-horse-battery"):
        assert leaked not in out, (leaked, out)
    assert out.count(REDACTED) >= 8
    assert redact_obj({"argv": ["--token", secret], "ok": "rank 3 at step 5"}) == \
        {"argv": ["--token", REDACTED], "ok": "rank 3 at step 5"}
    archive = pack(_manifest(), {"exception.json": {"type": "E", "message": f"echo {secret}"},
                                 "native_stacks.txt": f"frame {secret}"})
    assert secret.encode() not in zlib.decompress(archive, 31)


def test_secret_in_a_heartbeat_event_is_never_stored(server, monkeypatch):
    secret = "s3cr3t-value-for-the-test-0123456789"
    monkeypatch.setenv("HF_TOKEN", secret)
    import rankwatch.redact as redact_mod

    monkeypatch.setattr(redact_mod, "_cache", (-1e9, None))
    event = {"kind": "exception", "at": time.time(), "step": 1,
             "details": {"type": "ValueError", "message": f"bad token {secret} hf_abcdefghijklmnopqrstuvwxyz01"}}
    assert _request(server.url, "/v1/heartbeat", _raw({**_hb(run="sec"), "events": [event]}))[0] == 200
    details = server.collector.runs["sec"].ranks[0].events[-1].details
    assert secret not in json.dumps(details) and "hf_abcdefghijklmnopqrstuvwxyz01" not in json.dumps(details)


def test_supervisor_never_writes_outside_the_run_dir_and_survives_bad_commands(tmp_path):
    from rankwatch.node.supervisor import NodeSupervisor, Worker

    run_dir = tmp_path / "deep" / "run"
    run_dir.mkdir(parents=True)
    replies = [{"commands": [{"kind": "capture", "incident": "../../x", "ranks": [0]}]},
               {"commands": [{"kind": "capture", "incident": "ok-1", "details": {"stale": "zz"}}]},
               {"commands": [{"kind": "abort", "reason": 5}]}, {"commands": 5}, "garbage", None, [1, 2]]

    def post(path, body, content_type):
        if path == "/v1/nodes" and replies:
            return replies.pop(0)
        raise ConnectionError("collector down")

    supervisor = NodeSupervisor("r1", run_dir, post, node_rank=0, world_size=1, on_hang="abort", hang_timeout=None)
    while replies:
        supervisor._report()
    assert not supervisor.aborted
    supervisor._command(wire.Command(kind="capture", incident="../../x"), finished=False)
    worker = Worker(pid=os.getpid(), rank=0, local_rank=0, world_size=1)
    supervisor._send_bundle(worker, "../../x", "hang", {"stacks.json": []}, [])
    supervisor._send_bundle(worker, "hang-1", "hang", {"stacks.json": []}, [])
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written == [run_dir / "spool" / "hang-1" / "rank-00000.supervisor.tar.gz"], written

    sent = []
    supervisor.post = lambda path, body, ct: sent.append(path) or {"commands": []}
    supervisor._spool_checked = 0.0
    supervisor._report()  # the collector answers again: the spooled bundle goes
    assert sent == ["/v1/nodes", "/v1/bundles"]
    assert not list((run_dir / "spool").rglob("*.tar.gz"))


def test_bundle_reader_refuses_what_tarfile_would_swallow(bombs):
    with pytest.raises(BundleError, match="GNU long-name"):
        unpack(bombs["gnu-long-name"].read_bytes())
    with pytest.raises(BundleError, match="PAX"):
        unpack(bombs["pax-header"].read_bytes())
    with pytest.raises(BundleError, match="inflates beyond"):
        unpack(bombs["gzip-bomb"].read_bytes())
    with pytest.raises(BundleError, match="more than"):
        unpack(bombs["many-members"].read_bytes())
    with pytest.raises(BundleError, match="checksum|unreadable"):
        unpack(b"\0" * 100 + b"x" * 412 + b"\0" * 1024)


def test_peak_memory_summary():
    """Prints the peaks measured above (for the closing note); asserts nothing new."""
    for name, peak in sorted(PEAKS.items()):
        print(f"bomb {name}: peak {peak:.1f} MiB")


def test_rankwatch_log_lines_are_redacted(monkeypatch):
    import logging

    import rankwatch.redact as redact_mod

    secret = "log-secret-value-0123456789"
    monkeypatch.setenv("SERVICE_TOKEN", secret)
    monkeypatch.setattr(redact_mod, "_cache", (-1e9, None))
    previous = logging.getLogRecordFactory()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    log = logging.getLogger("rankwatch.test-redaction")
    log.addHandler(handler)
    try:
        redact_mod.install_log_redaction()
        log.warning("bundle from %s", secret)
        try:
            raise ValueError(f"echo {secret}")
        except ValueError:
            log.exception("request failed")
    finally:
        log.removeHandler(handler)
        logging.setLogRecordFactory(previous)
    text = stream.getvalue()
    assert secret not in text and text.count(REDACTED) == 2, text


@pytest.mark.parametrize("name", ["pid-2^64", "surrogate-host", "world-0", "run-id-dotdot", "rank-1e30"])
def test_hostile_heartbeat_inside_a_node_report_changes_nothing(server, name):
    payload, _ = HOSTILE_HEARTBEATS[name]
    bad = json.loads(payload)
    good = _hb(run="relayed", rank=0)
    before = _state(server.collector)
    body = json.dumps({"version": 1, "sent_at": time.time(), "node": None, "heartbeats": [good, bad]}).encode()
    status, answer = _request(server.url, "/v1/node-report", body)
    if status == 400:  # refused whole: nothing of it kept
        assert _strict_loads(answer)["error"]
        assert _state(server.collector) == before
    else:  # or the bad beat dropped alone: only the good one kept
        assert status == 200, (status, answer[:300])
        after = _state(server.collector)
        assert set(after) - set(before) <= {"relayed"}
        assert {rid: v for rid, v in after.items() if rid != "relayed"} == before
    ok = json.dumps({"version": 1, "sent_at": time.time(), "node": None, "heartbeats": [good]}).encode()
    assert _request(server.url, "/v1/node-report", ok)[0] == 200
    _serves(server)


# --------------------------------------------------------------------------
# Fuzzing the bundle readers and the evidence parser (deterministic seeds)
# --------------------------------------------------------------------------

_GARBAGE = [None, "x", "", "..", "\x00", -1, -5, 0, 2**40, 2**62, -2**62, 10**15, 1e308, -1e308, 3.5, "NaN",
            "Infinity", True, False, [], {}, [1, "a"], {"a": None}, [[[]]], [None], {"": {}}]


def _fuzz_members(rank: int, now: float) -> dict:
    frames = [{"file": "/x/train.py", "line": 10, "name": "main", "code": "loss.backward()"},
              {"file": "/t/torch/distributed/distributed_c10d.py", "line": 99, "name": "all_reduce", "code": ""}]
    return {
        "stacks.json": [{"thread_id": 1, "name": "MainThread", "daemon": False, "main": True, "frames": frames}],
        "exception.json": {"type": "RuntimeError", "message": "boom", "traceback": "tb", "frames": frames},
        "metrics.json": {"progress": {"step": 3, "forwards": 4, "phase": "backward", "phase_since": now,
                                      "last_progress_at": now, "started_at": now - 10,
                                      "collective": {"op": "all_reduce", "numel": 10, "entered_at": now,
                                                     "callsite": "a.py:1"}},
                         "steps": [wire.to_dict(wire.StepRecord(step=i, started_at=now - 10 + i, ended_at=now - 9 + i,
                                                                loss=0.5, grad_norm=1.0)) for i in range(3)],
                         "marks": [{"step": 1, "seqs": {"0": 5}}],
                         "events": [wire.to_dict(wire.Event("exception", now, 2, {"type": "E", "message": "m"}))]},
        "collectives.json": {"python_calls": [{"started_ns": 1, "ended_ns": 2, "thread": "1", "callsite": "/x/a.py:3",
                                               "op": "all_reduce"}], "pg_status": {"0": {"enqueued": 5, "completed": 4}}},
        "flight_recorder.json": {"entries": [{"process_group": ["0", "default"], "profiling_name": "gloo:all_reduce",
                                              "collective_seq_id": s, "input_sizes": [[10]], "input_dtypes": ["Float"],
                                              "time_created_ns": int((now - 9 + s) * 1e9), "retired": s < 4,
                                              "thread_id": "1", "is_p2p": False} for s in range(1, 6 + rank)],
                                 "pg_status": {"0": {"last_enqueued_collective": str(5 + rank),
                                                     "last_completed_collective": "4"}}},
        "memory.json": {"rss_bytes": 10**9, "cuda": {"device": 0, "allocated_bytes": 5, "summary": "s"}},
        "memory_snapshot.json": {"snapshot": {"segments": [{"total_size": 100, "blocks": [
            {"size": 50, "state": "active_allocated", "frames": [{"filename": "a.py", "line": 1, "name": "f"}]}]}]}},
        "profile_summary.json": {"operations": [{"name": "aten::mm", "self_ms": 1.5, "calls": 3}]},
    }


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def test_fuzzed_bundles_never_crash_the_readers_or_the_analyses():
    """Random wrong values at random places of every member the collector
    reads: the bundle is refused, or a member is dropped with a note, or it
    is analysed; never a traceback from the readers, evidence, analyses or
    the report."""
    import copy
    import random

    from rankwatch.collector import analyses, report as report_mod
    from rankwatch.outputs import report as report_output
    from rankwatch.collector.evidence import from_bundle
    from rankwatch.collector.service import merge_bundle
    from rankwatch.collector.state import Incident, RunState

    now = time.time()
    for seed in range(150):
        rng = random.Random(seed)
        run = RunState(run_id="fuzz", world_size=2, started_at=now - 20)
        run.incidents.append(Incident(id="hang-1", kind="hang", opened_at=now, last_progress_at=now - 5, ready=True,
                                      requested_ranks=[0, 1], details={"diagnosed_at": now}))
        for rank in (0, 1):
            members = _fuzz_members(rank, now)
            name = rng.choice(sorted(members))
            places = list(_paths(members[name]))
            for _ in range(rng.randint(1, 3)):
                place = rng.choice(places)
                if not place:
                    members[name] = copy.deepcopy(rng.choice(_GARBAGE))
                    break
                target = members[name]
                try:
                    for step in place[:-1]:
                        target = target[step]
                    target[place[-1]] = copy.deepcopy(rng.choice(_GARBAGE))
                except (KeyError, IndexError, TypeError):
                    pass
            manifest = _manifest(run="fuzz", rank=rank, source=rng.choice(["agent", "supervisor"]))
            try:
                bundle = unpack(pack(manifest, members))
            except BundleError:
                continue
            from_bundle(bundle)
            merge_bundle(run, bundle)
        report = report_mod.build(run, analyses.run_all(run, now + 1, final=True))
        _strict_loads(wire.json_text(wire.to_dict(report)))
        report_output.text(report)
