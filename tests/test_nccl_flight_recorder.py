"""NCCL's Flight Recorder, read right, and hangs named from progress numbers
when the waiting ranks are not inside a collective call (issue 17, finding 2).

No GPU is here: ProcessGroupNCCL's recorder dump is replaced by recorded
dumps (tests/data/nccl_flight_recorder/, shape from torch's sources and
tests) through the binding torch's NCCL builds have,
``torch._C._distributed_c10d._dump_nccl_trace_json``. Before the fix the
agent read only the generic recorder (gloo's): on NCCL its sequence numbers,
step marks and flight_recorder.json were empty, and the waiting ranks,
blocked in ``loss.item()`` rather than in torch.distributed, made the stack
fallback fail too.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rankwatch import wire
from rankwatch.agent.watch.collectives import CollectiveTracker, fr_environment, timeout_dump_members
from rankwatch.bundles import pack, unpack

DATA = Path(__file__).resolve().parent / "data" / "nccl_flight_recorder"


def _nccl_dump(rank: int):
    """What ProcessGroupNCCL's binding returns: JSON bytes, without
    `entries` when includeCollectives is False."""
    full = json.loads((DATA / f"rank_{rank}.json").read_text())

    def dump(includeCollectives=True, onlyActive=False):  # noqa: N803 - torch's own argument names
        out = dict(full)
        if not includeCollectives:
            out.pop("entries", None)
        return json.dumps(out).encode()

    return dump


def test_the_agent_reads_nccls_own_recorder(world, monkeypatch):
    c10d = torch._C._distributed_c10d
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", _nccl_dump(0), raising=False)
    tracker = CollectiveTracker()
    status = tracker.pg_status()
    assert status["0"] == {"enqueued": 13, "completed": 12}, status
    assert tracker.enqueued_seqs()["0"] == 13


def test_both_recorders_are_read_and_kept_apart(world, monkeypatch):
    """A job with gloo and NCCL groups (or one group with both backends)
    writes into both recorders: both are read, a shared id kept apart."""
    c10d = torch._C._distributed_c10d
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", _nccl_dump(1), raising=False)
    dist.all_reduce(torch.ones(2))  # the generic (gloo) recorder has pg "0" too
    tracker = CollectiveTracker()
    status = tracker.pg_status()
    assert status["0"]["enqueued"] == 13
    if hasattr(c10d, "_dump_fr_trace_json"):  # torch >= 2.8
        assert "0/generic" in status and status["0/generic"]["enqueued"] >= 1
    raw, note = tracker.full_dump()
    dump = json.loads(raw)
    assert any(e["profiling_name"] == "nccl:all_reduce" for e in dump["entries"])
    if hasattr(c10d, "_dump_fr_trace_json"):
        assert dump["recorders"] == ["nccl", "generic"]
        assert any(e["profiling_name"].startswith("gloo:") for e in dump["entries"])


def test_no_recorder_counts_python_collectives_and_their_completion(world, monkeypatch):
    """torch < 2.8 on gloo, < 2.5 on NCCL: no JSON dump at all. Python-API
    collectives still count per process group, completed when their future
    completes (async) or the call returns (a host backend)."""
    c10d = torch._C._distributed_c10d
    monkeypatch.delattr(c10d, "_dump_fr_trace_json", raising=False)
    monkeypatch.delattr(c10d, "_dump_nccl_trace_json", raising=False)
    from rankwatch.agent.core.patching import Patches

    tracker = CollectiveTracker()
    patches = Patches()
    tracker.install(patches)
    try:
        t = torch.ones(3)
        dist.all_reduce(t)
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        deadline = time.time() + 5
        while tracker.pg_status().get("0", {}).get("completed") != 2 and time.time() < deadline:
            time.sleep(0.01)
        assert tracker.pg_status()["0"] == {"enqueued": 2, "completed": 2}
    finally:
        patches.undo()


# -- the collector: a hang on NCCL, named from the numbers --------------------------------

_WAITING = [  # a rank that issued #13 and now waits for the device in loss.item(): no torch.distributed frame
    {"file": "/job/train.py", "line": 90, "name": "<module>", "code": "main()"},
    {"file": "/job/train.py", "line": 51, "name": "main", "code": "print(f'step {step} loss {loss.item():.4f}')"},
]
_STUCK = [
    {"file": "/job/train.py", "line": 90, "name": "<module>", "code": "main()"},
    {"file": "/job/train.py", "line": 44, "name": "main", "code": "time.sleep(3600)  # stuck before the backward"},
]


def _bundle(rank: int, frames, fr=None, pg_status=None) -> bytes:
    manifest = wire.BundleManifest(run_id="nccl", rank=rank, local_rank=rank, world_size=4, host="gpu-node-1",
                                   pid=1000 + rank, step=6, created_at=time.time(), reason="hang",
                                   incident="hang-1", source="agent", torch_version="2.13.0+cu128")
    members = {"stacks.json": [{"thread_id": 1, "name": "MainThread", "main": True, "frames": frames}],
               "metrics.json": {"progress": {"step": 6, "phase": "forward" if frames is _WAITING else "backward"}}}
    if fr is not None:
        members["flight_recorder.json"] = fr
    if pg_status is not None:
        members["collectives.json"] = {"python_calls": [], "pg_status": pg_status}
    return pack(manifest, members)


def _analyze(tmp_path: Path, bundles: dict[int, bytes]):
    from rankwatch.collector.offline import analyze_path

    folder = tmp_path / "bundles" / "hang-1"
    folder.mkdir(parents=True)
    for rank, archive in bundles.items():
        (folder / f"rank-{rank:05d}.tar.gz").write_bytes(archive)
    return analyze_path(tmp_path)


def test_a_hang_on_nccl_is_named_from_the_recorded_dumps(tmp_path):
    dumps = {r: json.loads((DATA / f"rank_{r}.json").read_text()) for r in range(4)}
    report = _analyze(tmp_path, {r: _bundle(r, _STUCK if r == 2 else _WAITING, fr=dumps[r]) for r in range(4)})
    hang = [v for v in report.verdicts if v.kind == "hang"]
    assert len(hang) == 1 and hang[0].ranks == [2], report.verdicts
    assert "never reached collective #13 of process group 0" in hang[0].summary
    assert "train.py:44" in hang[0].summary


def test_waiting_ranks_outside_torch_distributed_with_a_collective_in_flight(tmp_path):
    """No sequence number of the stuck rank (its recorder said nothing), and
    no waiting rank inside a torch.distributed frame: the ranks with a
    collective in flight (enqueued, not completed) are the waiting ones."""
    waiting = {"0": {"enqueued": 13, "completed": 12}}
    bundles = {r: _bundle(r, _WAITING, pg_status=waiting) for r in (0, 1, 3)}
    bundles[2] = _bundle(2, _STUCK)
    report = _analyze(tmp_path, bundles)
    hang = [v for v in report.verdicts if v.kind == "hang"]
    assert len(hang) == 1 and hang[0].ranks == [2], [(v.kind, v.ranks, v.summary) for v in report.verdicts]
    assert "not in a collective while the others wait" in hang[0].summary


def test_an_nccl_dump_in_a_bundle_passes_the_bundle_schema():
    dump = json.loads((DATA / "rank_0.json").read_text())
    manifest = wire.BundleManifest(run_id="nccl", rank=0, local_rank=0, world_size=4, host="h", pid=1, step=6,
                                   created_at=time.time(), reason="hang", incident="hang-1", source="agent")
    bundle = unpack(pack(manifest, {"flight_recorder.json": dump}))
    assert bundle.get("flight_recorder.json")["pg_status"]["0"]["last_enqueued_collective"] == "13"


# -- finding 10: the environment for the whole torch range, and the timeout dumps ----------


def test_the_names_this_torch_reads_are_set(tmp_path, monkeypatch):
    from rankwatch.agent.watch import collectives

    monkeypatch.setattr(collectives, "_reads_fr_names", lambda: False)  # torch < 2.8 reads the old names
    older = fr_environment(tmp_path, {})
    for old, new in (("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"),
                     ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")):
        assert older[old] == older[new], older
    monkeypatch.setattr(collectives, "_reads_fr_names", lambda: True)  # newer: the old ones make torch warn
    env = fr_environment(tmp_path, {})
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in env
    assert int(env["TORCH_FR_BUFFER_SIZE"]) > 0, "torch 2.4/2.5 default to 0: recorder off"
    assert env["TORCH_FR_DUMP_TEMP_FILE"].startswith(str(tmp_path))
    assert "TORCH_NCCL_DEBUG_INFO_PIPE_FILE" not in env
    # A user's own setting, under either name, is kept and given to the other name.
    mine = fr_environment(tmp_path, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"})
    assert mine["TORCH_FR_BUFFER_SIZE"] == "50" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in mine


def test_attach_sets_them_too(tmp_path, monkeypatch):
    import rankwatch.agent as rw

    for name in list(os.environ):
        if name.startswith(("TORCH_FR_", "TORCH_NCCL_")):
            monkeypatch.delenv(name)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    rw._set_flight_recorder_environment(str(tmp_path))
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert (tmp_path / "flight_recorder").is_dir()


def test_a_timeout_dump_is_collected_opaque(tmp_path):
    prefix = str(tmp_path / "flight_recorder" / "rank_")
    (tmp_path / "flight_recorder").mkdir()
    pickled = b"\x80\x04\x95" + os.urandom(64)  # torch's pickle dump: carried, never loaded
    Path(prefix + "3").write_bytes(pickled)
    members = timeout_dump_members(3, prefix)
    assert members == {"fr_timeout_dump.pickle": pickled}
    manifest = wire.BundleManifest(run_id="nccl", rank=3, local_rank=3, world_size=4, host="h", pid=1, step=6,
                                   created_at=time.time(), reason="crash", incident="postmortem-r3",
                                   source="supervisor")
    bundle = unpack(pack(manifest, members))
    assert bundle.opaque_members.get("fr_timeout_dump.pickle") == len(pickled)
    assert timeout_dump_members(2, prefix) == {}
