"""The wire format and the bundle archive refuse bad input with a clear
message and never evaluate or unpickle anything."""

from __future__ import annotations

import io
import json
import tarfile
import time

import pytest

from rankwatch import wire
from rankwatch.bundles import BundleError, pack, read_path, unpack
from rankwatch.redact import REDACTED, redact_env, redact_text


def _manifest(**kw) -> wire.BundleManifest:
    base = dict(run_id="r1", rank=1, local_rank=1, world_size=2, host="h", pid=1, step=3,
                created_at=time.time(), reason="hang", incident="hang-1")
    base.update(kw)
    return wire.BundleManifest(**base)


def test_heartbeat_round_trip():
    hb = wire.Heartbeat(identity=wire.RankIdentity(run_id="r", rank=1, local_rank=1, world_size=2),
                        sent_at=1.0, step=4, steps=[wire.StepRecord(step=3, started_at=1.0, ended_at=2.0, loss=0.5)],
                        marks=[wire.CollectiveMark(step=0, seqs={"0": 7})])
    back = wire.loads(wire.Heartbeat, wire.dumps(hb))
    assert back == hb


@pytest.mark.parametrize("payload,needle", ids=["not-json", "missing-field", "wrong-type", "future-version",
                                                "too-many-items"], argvalues=[
    (b"{not json", "not valid JSON"),
    (json.dumps({"sent_at": 1}).encode(), "missing field 'identity'"),
    (json.dumps({"identity": {"run_id": "r", "rank": "one", "local_rank": 0, "world_size": 2}, "sent_at": 1}).encode(),
     "identity.rank: expected an integer"),
    (json.dumps({"identity": {"run_id": "r", "rank": 0, "local_rank": 0, "world_size": 2}, "sent_at": 1,
                 "version": 99}).encode(), "unsupported version"),
    (json.dumps({"identity": {"run_id": "r", "rank": 0, "local_rank": 0, "world_size": 2}, "sent_at": 1,
                 "steps": [{}] * 20000}).encode(), "exceed the limit"),
])
def test_decode_rejects_bad_messages(payload, needle):
    with pytest.raises(wire.WireError) as err:
        wire.loads(wire.Heartbeat, payload)
    assert needle in str(err.value)


def test_bundle_round_trip_keeps_pickle_opaque(tmp_path):
    archive = pack(_manifest(), {"stacks.json": [{"main": True, "frames": []}],
                                 "memory_snapshot.pickle": b"\x80\x04 not for us", "notes.txt": "hello"})
    bundle = unpack(archive)
    assert bundle.manifest.rank == 1 and bundle.manifest.reason == "hang"
    assert bundle.get("stacks.json")[0]["main"] is True
    assert bundle.opaque_members == {"memory_snapshot.pickle": len(b"\x80\x04 not for us")}
    assert "memory_snapshot.pickle" not in bundle.json_members and "memory_snapshot.pickle" not in bundle.text_members
    path = tmp_path / "b.tar.gz"
    path.write_bytes(archive)
    assert read_path(path).manifest.incident == "hang-1"


def _tar(members: list[tarfile.TarInfo], blobs: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info in members:
            data = blobs.get(info.name)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def test_bundle_rejects_path_traversal_and_links():
    manifest = json.dumps(wire.to_dict(_manifest())).encode()
    good = tarfile.TarInfo("manifest.json")
    good.size = len(manifest)
    evil = tarfile.TarInfo("../../etc/cron.d/x.json")
    evil.size = 2
    with pytest.raises(BundleError, match="refused"):
        unpack(_tar([good, evil], {"manifest.json": manifest, evil.name: b"{}"}))
    link = tarfile.TarInfo("stacks.json")
    link.type = tarfile.SYMTYPE
    link.linkname = "/etc/passwd"
    with pytest.raises(BundleError, match="not a regular file"):
        unpack(_tar([good, link], {"manifest.json": manifest}))


def test_truncated_and_garbage_bundles_say_so():
    archive = pack(_manifest(), {"stacks.json": [{"x": "y" * 5000}] * 50})
    with pytest.raises(BundleError, match="truncated|unreadable"):
        unpack(archive[: len(archive) // 2])
    with pytest.raises(BundleError, match="unreadable"):
        unpack(b"definitely not a tarball")
    with pytest.raises(BundleError, match="no manifest"):
        unpack(_tar([], {}))


def test_secrets_never_leave_the_rank():
    env = redact_env({"HF_TOKEN": "hf_abcdefghijklmnopqrstuvwx", "WANDB_API_KEY": "k" * 40,
                      "DATABASE_URL": "postgres://user:hunter2@db/x", "RANK": "3", "PATH": "/usr/bin"})
    assert env["HF_TOKEN"] == REDACTED and env["WANDB_API_KEY"] == REDACTED
    assert "hunter2" not in env["DATABASE_URL"] and env["RANK"] == "3" and env["PATH"] == "/usr/bin"
    assert "ghp_" not in redact_text("token ghp_abcdefghijklmnopqrstuvwxyz0123")
    # The collector redacts again what it receives.
    archive = pack(_manifest(), {"env.json": {"MY_SECRET": "s3cr3t", "URL": "https://a:b@host/"}})
    env_back = unpack(archive).get("env.json")
    assert env_back["MY_SECRET"] == REDACTED and "a:b@" not in env_back["URL"]


# --------------------------------------------------------------------------
# The validated boundary (unit level; tests/test_hostile.py goes through HTTP)
# --------------------------------------------------------------------------


def _strict(text):
    def refuse(constant):
        raise ValueError(constant)
    return json.loads(text, parse_constant=refuse)


def test_ids_are_strict():
    for good in ("run-20261122-1", "job_a.b", "hang-1", "crash-r3-abcdef12", "-x"):
        assert wire.valid_id(good), good
    for bad in (".", "..", ".hidden", "a/b", "a\\b", "", "x" * 129, "a b", "é", "a\0b"):
        assert not wire.valid_id(bad), bad


def test_json_text_is_strict_and_nonfinite_round_trips_where_it_is_the_signal():
    record = wire.StepRecord(step=1, started_at=1.0, ended_at=2.0, loss=float("nan"), grad_norm=float("-inf"),
                             compute_s=float("inf"))
    text = wire.json_text(wire.to_dict(record))
    data = _strict(text)
    assert data["loss"] == "NaN" and data["grad_norm"] == "-Infinity" and data["compute_s"] == "Infinity"
    back = wire.decode(wire.StepRecord, data)
    assert back.loss != back.loss and back.grad_norm == float("-inf")
    assert back.compute_s is None  # a non-finite duration means nothing: None
    with pytest.raises(wire.WireError, match="finite"):
        wire.decode(wire.Event, {"kind": "x", "at": float("nan")})
    assert wire.decode(wire.Event, {"kind": "x", "at": 1.0, "details": {"v": float("inf")}}).details == {"v": "Infinity"}


def test_json_depth_and_object_count_are_checked_without_recursion():
    with pytest.raises(wire.WireError, match="deeper"):
        wire.parse_json(b"[" * 200_000 + b"]" * 200_000, "x")
    with pytest.raises(wire.WireError, match="exceed"):
        wire.parse_json(b"[" + b",".join([b"{}"] * 250_000) + b"]", "x")
    # brackets inside strings are text, not nesting
    assert wire.parse_json(json.dumps({"s": "[" * 1000 + '\\"{'}).encode(), "x") == {"s": "[" * 1000 + '\\"{'}


def test_text_is_made_safe_but_names_are_refused():
    event = wire.decode(wire.Event, {"kind": "exception", "at": 1.0, "details": {"message": "a\ud800b\x1bc\n"}})
    assert event.details["message"] == "a\ufffdb\ufffdc\n"
    with pytest.raises(wire.WireError, match="host"):
        wire.decode(wire.RankIdentity, {"run_id": "r", "rank": 0, "local_rank": 0, "world_size": 1, "host": "h\udc80"})


def test_bundle_is_written_as_plain_ustar_with_strict_json():
    archive = pack(_manifest(), {"metrics.json": {"steps": [wire.to_dict(wire.StepRecord(0, 1.0, 2.0, loss=float("nan")))]}})
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        infos = list(tar)
        assert all(i.type == tarfile.REGTYPE and not i.pax_headers for i in infos)
        _strict(tar.extractfile("metrics.json").read())
    steps = unpack(archive).get("metrics.json")["steps"]
    assert steps[0]["loss"] == "NaN"
    loss = wire.decode(wire.StepRecord, steps[0]).loss
    assert isinstance(loss, float) and loss != loss  # read back as a float NaN


# A real torch 2.13 Flight Recorder dump (gloo, two entries; pg_status counters are strings).
_REAL_FR = '{"comm_lib_version":"","entries":[{"collective_seq_id":1,"input_dtypes":["Float"],"input_sizes":[[4]],"is_p2p":false,"op_id":1,"output_dtypes":["Float"],"output_sizes":[[4]],"p2p_seq_id":0,"pg_id":0,"process_group":["0","default_pg"],"profiling_name":"gloo:all_reduce","record_id":0,"retired":true,"state":"scheduled","thread_id":"140691739446144","thread_name":"python","time_created_ns":1795336311182292988,"time_discovered_completed_ns":0,"time_discovered_started_ns":0,"timeout_ms":1800000},{"collective_seq_id":2,"input_dtypes":["Float"],"input_sizes":[[4]],"is_p2p":false,"op_id":2,"output_dtypes":["Float"],"output_sizes":[[4]],"p2p_seq_id":0,"pg_id":0,"process_group":["0","default_pg"],"profiling_name":"gloo:broadcast","record_id":1,"retired":true,"state":"scheduled","thread_id":"140691739446144","thread_name":"python","time_created_ns":1795336311182489456,"time_discovered_completed_ns":0,"time_discovered_started_ns":0,"timeout_ms":1800000}],"nccl_comm_state":{},"pg_config":{"":{"desc":"","name":"","ranks":"[0]"}},"pg_status":{"0":{"last_completed_collective":"3","last_enqueued_collective":"3","last_started_collective":"-1"}},"version":"2.10"}'


def test_a_real_flight_recorder_dump_passes_its_schema():
    from rankwatch.collector.evidence import from_bundle

    bundle = unpack(pack(_manifest(), {"flight_recorder.json": _REAL_FR.encode()}))
    assert not bundle.manifest.notes, bundle.manifest.notes
    evidence = from_bundle(bundle)
    assert [(e.op, e.seq) for e in evidence.collectives] == [("all_reduce", 1), ("broadcast", 2)]
    assert evidence.pg_enqueued == {"0": 3}


def test_faulthandler_text_is_parsed_with_bounded_numbers():
    from rankwatch.faulttext import parse

    text = ("rankwatch-main-thread: 0x7f00\nThread 0x7f00 (most recent call first):\n"
            '  File "a.py", line 3 in f\n  File "b.py", line ' + "9" * 5000 + " in g\n"
            "Current thread 0x" + "f" * 40 + " (most recent call first):\n")
    threads = parse(text)
    assert [t["thread_id"] for t in threads] == [0x7f00] and threads[0]["main"]
    assert threads[0]["frames"] == [{"file": "a.py", "line": 3, "name": "f", "code": ""}]
