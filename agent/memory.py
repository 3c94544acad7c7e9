"""Memory tracking every step, without a sync: host RSS from /proc, and on
CUDA the caching allocator's counters (host-side numbers, no device work).

On CUDA, optionally records allocator history (bounded ``max_entries``) and
attaches torch's OOM observer, which runs *before* OutOfMemoryError is raised:
it dumps a memory snapshot (JSON summary for the collector, the pickle for
pytorch.org/memory_viz) into an ``oom`` bundle.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from rankwatch.wire import StepRecord

from .safety import guarded, log, log_once

if TYPE_CHECKING:
    from .runtime import Agent

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


_STATM_FD: Optional[int] = None
_STATM_PID = 0


def rss_bytes() -> Optional[int]:
    """Resident memory from /proc/self/statm through a descriptor kept open:
    a pread is ~20x cheaper than open/read/close on every step."""
    global _STATM_FD, _STATM_PID
    try:
        if _STATM_FD is None or _STATM_PID != os.getpid():  # a forked child has its own /proc/self
            _STATM_FD, _STATM_PID = os.open("/proc/self/statm", os.O_RDONLY), os.getpid()
        return int(os.pread(_STATM_FD, 128, 0).split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def host_memory() -> dict[str, int]:
    """Available and total host memory (and the cgroup limit, in a container)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
            if text.isdigit() and int(text) < out.get("MemTotal", 1 << 62):
                out["CgroupLimit"] = int(text)
        except OSError:
            continue
    return out


class MemoryTracker:
    def __init__(self, agent: "Agent") -> None:
        self.agent = agent
        self.cuda_ready = False
        self.observer_attached = False
        agent.progress.step_extras.append(self._on_step_end)

    @guarded("memory.step")
    def _on_step_end(self, record: StepRecord) -> None:
        record.rss_bytes = rss_bytes()
        if self.cuda_ready:
            import torch

            device = torch.cuda.current_device()
            record.device_allocated_bytes = torch.cuda.memory_allocated(device)
            record.device_reserved_bytes = torch.cuda.memory_reserved(device)
            record.device_peak_bytes = torch.cuda.max_memory_allocated(device)

    @guarded("memory.cuda")
    def on_model(self, ddp) -> None:
        import torch

        if not (torch.cuda.is_available() and any(p.is_cuda for p in ddp.parameters())):
            return
        self.cuda_ready = True
        if self.agent.config.memory_history:
            torch.cuda.memory._record_memory_history(
                enabled="all", context="all", stacks="python",
                max_entries=self.agent.config.memory_history_max_entries)
        if not self.observer_attached:
            torch._C._cuda_attach_out_of_memory_observer(self._on_device_oom)
            self.observer_attached = True

    def _on_device_oom(self, device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        """Runs inside the allocator before OutOfMemoryError is raised."""
        try:
            details = {"device": device, "requested_bytes": alloc, "device_allocated_bytes": device_alloc,
                       "device_free_bytes": device_free, "kind": "device"}
            self.agent.record_event("oom", **details)
            incident = f"oom-r{self.agent.identity.rank}-{uuid.uuid4().hex[:6]}"
            members = snapshot_members(self.agent.run_dir, self.agent.identity.rank)
            from . import bundle as bundle_mod

            archive = bundle_mod.build(self.agent, "oom", incident, extra_members={**members, "oom.json": details})
            bundle_mod.deliver(self.agent, archive, incident, timeout=3.0)
        except Exception as exc:
            log(f"OOM snapshot failed: {type(exc).__name__}: {exc}")


def snapshot_members(run_dir: Optional[str], rank: int) -> dict[str, Any]:
    """A CUDA memory snapshot as bundle members (JSON summary + opaque pickle)."""
    import torch

    from rankwatch.memory_snapshot import summarize, to_jsonable

    members: dict[str, Any] = {}
    snapshot = torch.cuda.memory._snapshot()
    members["memory_snapshot.json"] = {"summary": summarize(snapshot), "snapshot": to_jsonable(snapshot)}
    members["memory_summary.txt"] = torch.cuda.memory_summary()
    if run_dir:
        path = Path(run_dir) / "memory" / f"rank-{rank:05d}-{int(time.time())}.pickle"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
            if path.stat().st_size < 32 * 1024 * 1024:
                members["memory_snapshot.pickle"] = path.read_bytes()
        except OSError as exc:  # disk full / read-only: the JSON summary still goes out
            log_once("memory.pickle", f"memory snapshot pickle not written to {path.parent} "
                                      f"({type(exc).__name__}: {exc})")
    return members
