"""Evidence of one rank in one incident, read from its diagnostic bundle(s).

Normalises what the bundle holds (Flight Recorder entries, Python call sites,
stacks, exception) into plain dataclasses the analyses compare across ranks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from rankwatch.bundles import Bundle


def rank_shaped(op: str) -> bool:
    """Collectives whose inputs legitimately differ between ranks: all-to-all
    with per-rank split sizes, scatter (only the root passes a list). They are
    compared by op alone, never by size."""
    op = op.lower()
    return "to_all" in op or "alltoall" in op or op in ("scatter", "_scatter_base")


MAX_WORKER_PROCESSES = 16  # a rank's DataLoader workers whose stacks are kept


@dataclass
class CollectiveEntry:
    pg: str
    seq: int
    op: str  # "all_reduce", "broadcast", "barrier", ...
    input_sizes: list
    input_dtypes: list
    created_ns: int
    retired: bool
    thread: str = ""
    origin: str = "internal"  # "internal" (DDP/C++) or the Python call site
    step: Optional[int] = None

    @property
    def signature(self) -> tuple:
        if rank_shaped(self.op):
            return (self.op,)
        return (self.op, json.dumps(self.input_sizes), json.dumps(self.input_dtypes))

    @property
    def shape_text(self) -> str:
        if not self.input_sizes:
            return self.op
        sizes = ", ".join("x".join(str(d) for d in s) if isinstance(s, list) else str(s) for s in self.input_sizes)
        dtypes = ",".join(str(d) for d in self.input_dtypes)
        return f"{self.op} of [{sizes}] {dtypes}".rstrip()


@dataclass
class RankEvidence:
    rank: int
    reason: str
    created_at: float
    source: str
    host: str = ""
    step: Optional[int] = None
    stacks: list[dict[str, Any]] = field(default_factory=list)
    collectives: list[CollectiveEntry] = field(default_factory=list)
    pg_enqueued: dict[str, int] = field(default_factory=dict)
    pg_completed: dict[str, int] = field(default_factory=dict)
    exception: Optional[dict[str, Any]] = None
    progress: dict[str, Any] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    marks: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    native_stacks: str = ""
    faulthandler: str = ""
    # The rank's DataLoader worker processes: [{"pid": ..., "threads": [...]}]
    worker_stacks: list[dict[str, Any]] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    bundle_path: Optional[str] = None
    members: list[str] = field(default_factory=list)
    snapshot: Optional[dict[str, Any]] = None  # CUDA memory snapshot summary
    profile: Optional[dict[str, Any]] = None  # torch.profiler per-op summary
    # The supervisor's bundle (the outside view) is in: on its own, or merged
    # into the agent's. A rank that was silent when asked is judged on it.
    outside_seen: bool = False

    @property
    def main_stack(self) -> list[dict[str, Any]]:
        for thread in self.stacks:
            if thread.get("main"):
                return thread.get("frames", [])
        return []


def from_bundle(bundle: Bundle) -> RankEvidence:
    m = bundle.manifest
    ev = RankEvidence(rank=m.rank, reason=m.reason, created_at=m.created_at, source=m.source, host=m.host,
                      step=m.step, bundle_path=bundle.source_path, notes=list(m.notes),
                      members=list(m.members), outside_seen=m.source != "agent")
    stacks = bundle.get("stacks.json")
    if isinstance(stacks, list):
        ev.stacks = [t for t in stacks if isinstance(t, dict)]
    exc = bundle.get("exception.json")
    if isinstance(exc, dict):
        ev.exception = exc
    metrics = bundle.get("metrics.json") or {}
    if isinstance(metrics, dict):
        ev.progress = metrics.get("progress") or {}
        ev.steps = [s for s in metrics.get("steps") or [] if isinstance(s, dict)]
        ev.marks = [s for s in metrics.get("marks") or [] if isinstance(s, dict)]
        ev.events = [e for e in metrics.get("events") or [] if isinstance(e, dict)]
    memory = bundle.get("memory.json")
    if isinstance(memory, dict):
        ev.memory = memory
    snap = bundle.get("memory_snapshot.json")
    if isinstance(snap, dict):
        from rankwatch.memory_snapshot import summarize

        # Recomputed from the data, not trusted from the sender's summary.
        ev.snapshot = summarize(snap.get("snapshot") or {}) if isinstance(snap.get("snapshot"), dict) else None
    prof = bundle.get("profile_summary.json")
    if isinstance(prof, dict):
        ev.profile = prof
    ev.native_stacks = bundle.text_members.get("native_stacks.txt", "")
    workers = bundle.get("worker_stacks.json")
    if isinstance(workers, list):
        ev.worker_stacks = [w for w in workers if isinstance(w, dict)][:MAX_WORKER_PROCESSES]
    ev.faulthandler = bundle.text_members.get("faulthandler.txt", "")
    calls = []
    collectives = bundle.get("collectives.json") or {}
    if isinstance(collectives, dict):
        calls = [c for c in collectives.get("python_calls") or [] if isinstance(c, dict)]
        for pg, st in (collectives.get("pg_status") or {}).items():
            if isinstance(st, dict):
                ev.pg_enqueued[str(pg)] = _int(st.get("enqueued"), -1)
                ev.pg_completed[str(pg)] = _int(st.get("completed"), -1)
    fr = bundle.get("flight_recorder.json")
    if isinstance(fr, dict):
        ev.collectives = parse_flight_recorder(fr, calls, ev.steps)
        for pg, st in (fr.get("pg_status") or {}).items():
            if isinstance(st, dict):
                ev.pg_enqueued[str(pg)] = _int(st.get("last_enqueued_collective"), -1)
                ev.pg_completed[str(pg)] = _int(st.get("last_completed_collective"), -1)
    elif "flight_recorder.json" in bundle.text_members:
        ev.notes.append("flight_recorder.json is not valid JSON")
    return ev


def parse_flight_recorder(dump: dict[str, Any], python_calls: list[dict[str, Any]],
                          steps: list[dict[str, Any]]) -> list[CollectiveEntry]:
    """FR entries -> CollectiveEntry, labelled with the Python call site that
    enqueued them (by thread and time window) and the step they fell in."""
    out = []
    for raw in dump.get("entries") or []:
        if not isinstance(raw, dict) or raw.get("is_p2p"):
            continue
        pg = raw.get("process_group")
        pg_id = str(pg[0]) if isinstance(pg, list) and pg else str(raw.get("pg_id", "0"))
        name = str(raw.get("profiling_name") or "")
        op = name.split(":", 1)[1] if ":" in name else name
        entry = CollectiveEntry(
            pg=pg_id,
            seq=_int(raw.get("collective_seq_id"), -1),
            op=op,
            input_sizes=raw.get("input_sizes") if isinstance(raw.get("input_sizes"), list) else [],
            input_dtypes=raw.get("input_dtypes") if isinstance(raw.get("input_dtypes"), list) else [],
            created_ns=_int(raw.get("time_created_ns"), 0),
            retired=bool(raw.get("retired")),
            thread=str(raw.get("thread_id") or ""),
        )
        out.append(entry)
    for entry in out:
        for call in python_calls:
            ended = _int(call.get("ended_ns"), 0) or 2**63  # 0: the rank died inside the call
            if (_int(call.get("started_ns"), 0) <= entry.created_ns <= ended
                    and (not entry.thread or str(call.get("thread")) == entry.thread)):
                entry.origin = _short_site(str(call.get("callsite") or "python"))
                break
        entry.step = step_at(steps, entry.created_ns / 1e9)
    out.sort(key=lambda e: (e.pg, e.seq))
    return out


def step_at(steps: list[dict[str, Any]], t: float) -> Optional[int]:
    """The 0-based step in which time ``t`` fell, from a rank's step records."""
    if not steps:
        return None
    for record in steps:
        if record.get("started_at", 0) <= t <= record.get("ended_at", 0):
            return int(record["step"])
    last = steps[-1]
    if t > last.get("ended_at", 0):
        return int(last["step"]) + 1
    return None


def _short_site(site: str) -> str:
    path, _, rest = site.partition(":")
    return f"{os.path.basename(path)}:{rest}" if rest else site


def _int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def fill_source(frames: list[dict[str, Any]], donors: list[RankEvidence]) -> list[dict[str, Any]]:
    """``frames`` with the source text filled in where it is missing (a stack
    taken from outside by an older supervisor, or a faulthandler text) from
    any other evidence of the run that shows the same file and line (the
    agent's own stacks and tracebacks carry it)."""
    if all(f.get("code") for f in frames):
        return frames
    known: dict[tuple[str, Any], str] = {}
    for ev in donors:
        threads = [t.get("frames") or [] for t in ev.stacks]
        if ev.exception and isinstance(ev.exception.get("frames"), list):
            threads.append(ev.exception["frames"])
        for thread in threads:
            for frame in thread:
                if isinstance(frame, dict) and frame.get("code"):
                    known.setdefault((str(frame.get("file")), frame.get("line")), str(frame["code"]))
                    # py-spy's native dump names files by their short name
                    known.setdefault((os.path.basename(str(frame.get("file"))), frame.get("line")),
                                     str(frame["code"]))
    return [f if f.get("code") else {**f, "code": known.get((str(f.get("file")), f.get("line")), "")}
            for f in frames]
