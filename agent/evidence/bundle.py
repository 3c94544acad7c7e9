"""Diagnostic bundles from inside a rank: stacks, collectives, metrics,
redacted environment, memory; uploaded to the collector, or spooled to the
run dir when the collector cannot be reached."""

from __future__ import annotations

import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from rankwatch import __version__, wire
from rankwatch.bundles import pack
from rankwatch.redact import redact_env, redact_obj

from ..core.safety import log_once
from ..core.stacks import python_stacks
from ..core.transport import CollectorUnreachable

if TYPE_CHECKING:
    from ..watch.collectives import CollectiveTracker
    from ..checks.memory import MemoryTracker
    from ..core.ports import Emit
    from ..watch.progress import Progress
    from ..core.transport import Transport


def memory_state(tracker: Optional["MemoryTracker"] = None) -> dict[str, Any]:
    """Host memory, and the allocator's counters of the device the model's
    tensors are on (not the current device: a script that never called
    set_device has GPU 0 current while its tensors live on GPU k)."""
    state: dict[str, Any] = {"rss_bytes": _rss_bytes(), "host_available_bytes": _host_available()}
    device = getattr(tracker, "device", None)
    if device is None:
        return state
    try:
        stats = tracker.adapter.memory_stats(device)
        if stats is not None:
            state["cuda"] = {"device": device.index, "allocated_bytes": stats[0], "reserved_bytes": stats[1],
                             "peak_allocated_bytes": stats[2]}
            if tracker.adapter.name == "cuda":
                import torch

                state["cuda"]["summary"] = torch.cuda.memory_summary(device, abbreviated=True)
    except Exception as exc:
        state["cuda_error"] = f"{type(exc).__name__}: {exc}"
    return state


def _rss_bytes() -> Optional[int]:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except Exception:
        return None


def _host_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except Exception:
        return None
    return None


def build(reason: str, incident: str, exception: Optional[dict] = None, extra_members: Optional[dict[str, Any]] = None,
          *, identity: wire.RankIdentity, progress: "Progress", collectives: "CollectiveTracker",
          recent_events: Callable[[], list[wire.Event]], memory: Optional["MemoryTracker"],
          run_dir: Optional[str]) -> bytes:
    """The rank's bundle: ``recent_events()`` gives the event window it carries
    (agent/runtime.py `Agent.recent_events`); ``memory``, the device whose
    allocator counters it carries (None: host memory only)."""
    import torch

    manifest = wire.BundleManifest(
        run_id=identity.run_id,
        rank=identity.rank,
        local_rank=identity.local_rank,
        world_size=identity.world_size,
        host=identity.host or socket.gethostname(),
        pid=os.getpid(),
        step=progress.step,
        created_at=time.time(),
        reason=reason,
        incident=incident,
        source="agent",
        torch_version=torch.__version__,
        rankwatch_version=__version__,
        python_version=platform.python_version(),
        node_rank=identity.node_rank,
        attempt=identity.attempt,
    )
    fr_dump, fr_error = collectives.full_dump()
    if fr_error:
        manifest.notes.append(fr_error)
    # The deques and dicts below belong to the training thread, which keeps
    # appending while this (another) thread builds the bundle: each is read
    # once, as a snapshot (tuple() and dict() of a deque or dict are single
    # C calls under the GIL), and only the snapshot is iterated in Python.
    steps = tuple(progress.recent)
    marks = tuple(progress.marks)
    calls = [dict(call) for call in tuple(collectives.calls)]
    members: dict[str, Any] = {
        "stacks.json": python_stacks(),
        "collectives.json": {
            "python_calls": calls,
            "pg_status": collectives.pg_status(),
            "flight_recorder": fr_dump is not None,
        },
        "flight_recorder.json": fr_dump,
        "metrics.json": {
            "steps": [wire.to_dict(s) for s in steps],
            "marks": [wire.to_dict(m) for m in marks],
            "progress": {
                "step": progress.step,
                "forwards": progress.forwards,
                "phase": progress.phase,
                "phase_since": progress.phase_since,
                "last_progress_at": progress.last_progress_at,
                "started_at": progress.started_at,
            },
            "events": [wire.to_dict(e) for e in recent_events()],
        },
        "env.json": redact_env(dict(os.environ)),
        "memory.json": memory_state(memory),
        "exception.json": redact_obj(exception) if exception else None,
        "runtime.json": {"argv": redact_obj(list(sys.argv)), "python": sys.version, "executable": sys.executable},
    }
    from ..watch.collectives import timeout_dump_members, timeout_dump_prefix

    members.update(timeout_dump_members(identity.rank, timeout_dump_prefix(run_dir)))
    for name, content in (extra_members or {}).items():
        members[name] = content
    return pack(manifest, members)


def deliver(archive: bytes, incident: str, timeout: float = 5.0, *, identity: wire.RankIdentity,
            transport: "Transport", run_dir: Optional[str], emit: "Emit") -> str:
    """Upload to the collector; on failure keep it in the run dir's spool
    (``emit``: an `evidence_lost` event when that fails too). Returns where
    it went."""
    if transport.configured:
        try:
            transport.post(
                "/v1/bundles",
                archive,
                content_type="application/gzip",
                headers={"X-Rankwatch-Run": identity.run_id, "X-Rankwatch-Rank": str(identity.rank),
                         "X-Rankwatch-Incident": incident},
                timeout=timeout,
            )
            return "collector"
        except CollectorUnreachable:
            pass
    path = spool_path(run_dir, incident, identity.rank)
    if path is None:
        log_once("bundle.lost", "bundle could not be delivered: no collector and no run dir")
        return "lost"
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(archive)
        tmp.replace(path)
    except OSError as exc:
        # Disk full, read-only run dir: the evidence is lost, the job goes on.
        try:
            tmp.unlink()
        except OSError:
            pass
        log_once("bundle.spool", f"bundles cannot be kept in {path.parent.parent} ({type(exc).__name__}: {exc}); "
                                 f"evidence that the collector does not receive is lost")
        emit("evidence_lost", incident=incident, reason=f"{type(exc).__name__}: {exc}"[:300])
        return "lost"
    return str(path)


def spool_path(run_dir: Optional[str], incident: str, rank: int) -> Optional[Path]:
    if not run_dir:
        return None
    safe_incident = "".join(c for c in incident if c.isalnum() or c in "-_") or "incident"
    return Path(run_dir) / "spool" / safe_incident / f"rank-{rank:05d}.tar.gz"
