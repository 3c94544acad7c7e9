"""`oom`: a rank ran out of device or host memory.

Device: the agent's OOM observer dumped a CUDA memory snapshot before the
error propagated; the verdict points at it and at the allocation sites that
hold the most memory. Host: an allocation failure ("can't allocate memory",
MemoryError), or a SIGKILL while the host or container had no memory left
(the kernel's OOM killer).
"""

from __future__ import annotations

from rankwatch import wire
from rankwatch.memory_snapshot import human

from ..state import RunState
from .common import ranks_text, verdict
from .crash import failures


def detect(run: RunState, now: float, final: bool) -> list[wire.Verdict]:
    found = failures(run)
    device_events = {s.rank: e for s in run.notable_ranks() if (e := s.first_event("oom")) is not None}
    ooms = [f for f in found if f.oom]
    ranks = sorted({f.rank for f in ooms} | set(device_events))
    if not ranks:
        return []
    first_at = min([f.at for f in ooms] + [e.at for e in device_events.values()])
    # Only the first ones: a peer may run out of memory as a consequence, rarely at the same moment.
    ranks = sorted({f.rank for f in ooms if f.at - first_at <= 2.0} |
                   {r for r, e in device_events.items() if e.at - first_at <= 2.0})
    rank = ranks[0]
    failure = next((f for f in ooms if f.rank == rank), None)
    event = device_events.get(rank)
    snapshot, bundle_path, memory = None, None, {}
    for ev in run.ranks[rank].evidence.values():
        if "memory_snapshot.json" in ev.members or ev.reason == "oom":
            bundle_path = ev.bundle_path
        if ev.memory:
            memory = ev.memory
    snapshot = _snapshot_summary(run, rank)
    if event is not None:
        requested = event.details.get("requested_bytes")
        kind = "device"
        summary = (f"{ranks_text(ranks).capitalize()} ran out of device memory"
                   + (f" allocating {human(requested)}" if isinstance(requested, int) else ""))
    elif failure is not None and failure.kind == "signal":
        kind = "host"
        summary = (f"{ranks_text(ranks).capitalize()} was killed (SIGKILL) with the host out of memory: "
                   f"the kernel's OOM killer")
    else:
        kind = "host"
        summary = f"{ranks_text(ranks).capitalize()} ran out of host memory: {failure.cause if failure else ''}"
    step = failure.step if failure is not None else (event.step if event is not None else None)
    if step is not None:
        summary += f" at step {step}"
    if snapshot and snapshot.get("top_sites"):
        top = snapshot["top_sites"][0]
        summary += f"; largest holder: {top['site']} ({human(top['bytes'])})"
    rss = run.ranks[rank].host_memory.get("RSS") or memory.get("rss_bytes")
    if kind == "host" and rss:
        summary += f"; its resident memory was {human(rss)}"
    summary += "."
    evidence = {"kind": kind, "bundle": bundle_path, "snapshot_summary": snapshot,
                "host_memory": run.ranks[rank].host_memory, "memory": memory,
                "device_event": event.details if event else None,
                "cause": failure.cause if failure else None}
    return [verdict("oom", ranks, step, first_at, now, summary, evidence)]


def _snapshot_summary(run: RunState, rank: int):
    for ev in run.ranks[rank].evidence.values():
        data = getattr(ev, "snapshot", None)
        if data:
            return data
    return None
