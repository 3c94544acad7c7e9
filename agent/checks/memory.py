"""Memory tracking every step, without a sync: host RSS from /proc, and on
an accelerator the caching allocator's counters (host-side numbers, no
device work), read once per step through the device adapter
(agent/core/device.py) for the device the model's tensors are on.

On CUDA, optionally records allocator history (bounded ``max_entries``),
and attaches the allocator's OOM observer, which runs on the allocating
thread *before* OutOfMemoryError is raised. The observer only notes the
failure (a few attribute writes): a script that catches the error and goes
on (a batch-size finder) gets an ``oom_caught`` event and no verdict, and
pays nothing. When the error ends the rank (uncaught, or the rank exits
non-zero before another step), the ``oom`` event and a bundle with the
memory snapshot (JSON summary for the collector, the pickle for
pytorch.org/memory_viz) are made then, off the allocation path; the
traceback still holds the tensors that were live at the failure.
Never run on a GPU here: tested through the device adapter's test double.
"""

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from rankwatch.config import Config
from rankwatch.wire import StepRecord

from ..core.safety import guarded, log, log_once

if TYPE_CHECKING:
    from ..core.ports import Emit, StepProgress

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
    """``run_dir`` and ``rank``: where an OOM's memory snapshot is written."""

    def __init__(self, *, config: Config, emit: "Emit", progress: "StepProgress", run_dir: Optional[str],
                 rank: int) -> None:
        self.config = config
        self.emit = emit
        self.progress = progress
        self.run_dir = run_dir
        self.rank = rank
        self.device = None  # the device the model's tensors are on (an accelerator)
        self.adapter = None
        self.observer_attached = False
        self.pending_oom: Optional[dict[str, Any]] = None  # noted by the observer, judged later
        # Host memory rankwatch itself took (a profile requested by the collector: torch's
        # profiler and reading its results keep tens of MiB that glibc does not give back).
        # The job's RSS is reported without it, and not at all while such work runs: the
        # ranks asked for a profile after a straggler verdict were called leaking otherwise.
        self.own_rss_bytes = 0
        self._own_since: Optional[int] = None
        self.last_allocated: Optional[int] = None  # device bytes allocated at the last step's end
        progress.step_extras.append(self._on_step_end)

    @property
    def cuda_ready(self) -> bool:  # older name
        return self.device is not None

    def own_work_started(self) -> None:
        """rankwatch starts work that takes host memory (a profile): until
        `own_work_ended`, steps report no RSS."""
        if self._own_since is None:
            self._own_since = rss_bytes()

    def own_work_ended(self) -> None:
        """The growth of RSS since `own_work_started` is rankwatch's, from now
        on subtracted from the job's. (A job's own allocations in those few
        steps are counted as rankwatch's: a steady leak still shows in the
        steps after.)"""
        since, self._own_since = self._own_since, None
        now = rss_bytes()
        if since is not None and now is not None:
            self.own_rss_bytes += max(0, now - since)

    @guarded("memory.step")
    def _on_step_end(self, record: StepRecord) -> None:
        rss = rss_bytes()
        if self._own_since is not None or rss is None:
            record.rss_bytes = None  # rankwatch's own work is running: not the job's memory
        else:
            record.rss_bytes = max(0, rss - self.own_rss_bytes)
        if self.device is not None:
            stats = self.adapter.memory_stats(self.device)  # one read of the allocator's counters
            if stats is not None:
                record.device_allocated_bytes, record.device_reserved_bytes, record.device_peak_bytes = stats
                self.last_allocated = stats[0]
        pending, self.pending_oom = self.pending_oom, None
        if pending is not None:
            # The script caught it and went on to finish a step: not a failure of the rank.
            self.emit("oom_caught", **{k: v for k, v in pending.items() if k != "at"})

    @guarded("memory.cuda")
    def on_model(self, model) -> None:
        from ..core import device as device_mod

        params = model.parameters() if hasattr(model, "parameters") else model
        device = device_mod.model_device(params)
        if device is None:
            return
        adapter = device_mod.for_device(device)
        if not adapter.accelerated():
            return
        self.device, self.adapter = device, adapter
        if self.config.memory_history and adapter.name == "cuda":
            import torch

            torch.cuda.memory._record_memory_history(
                enabled="all", context="all", stacks="python",
                max_entries=self.config.memory_history_max_entries)
        if not self.observer_attached:
            self.observer_attached = adapter.attach_oom_observer(self._on_device_oom)

    def _on_device_oom(self, device: int, requested: int, device_total: int, device_free: int) -> None:
        """Runs inside the allocator, on the allocating thread, before
        OutOfMemoryError is raised: note it, nothing more. The allocator
        passes (device, requested bytes, the device's *total* memory, its
        free memory) (c10/cuda/CUDACachingAllocator.h, torch 2.13); the
        bytes allocated are the last step's counters, not read here."""
        try:
            self.pending_oom = {"device": int(device), "requested_bytes": int(requested),
                                "device_total_bytes": int(device_total), "device_free_bytes": int(device_free),
                                "memory": "device", "at": time.time(), "step": self.progress.step}
            if self.last_allocated is not None:
                self.pending_oom["allocated_bytes_at_last_step"] = self.last_allocated
        except Exception:
            pass

    def oom_evidence(self, exc: Optional[BaseException]) -> Optional[tuple[dict[str, Any], dict[str, Any]]]:
        """The rank is ending with a device OOM (``exc``, or a noted OOM
        with no step since): (event details, bundle members with the
        snapshot). Called off the allocation path (the exception handler,
        shutdown)."""
        pending = self.pending_oom
        is_oom = exc is not None and _is_device_oom(exc)
        if pending is None and not is_oom:
            return None
        self.pending_oom = None
        details = {k: v for k, v in (pending or {"memory": "device"}).items() if k not in ("at", "step")}
        members: dict[str, Any] = {"oom.json": details}
        try:
            members.update(snapshot_members(self.run_dir, self.rank, self.adapter, self.device))
        except Exception as exc2:
            log(f"OOM snapshot failed: {type(exc2).__name__}: {exc2}")
        return details, members


def _is_device_oom(exc: BaseException) -> bool:
    import torch

    kinds = tuple(k for k in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
                  if isinstance(k, type))
    return bool(kinds) and isinstance(exc, kinds)


def snapshot_members(run_dir: Optional[str], rank: int, adapter: Any = None,
                     device: Any = None) -> dict[str, Any]:
    """A device memory snapshot as bundle members (JSON summary + opaque
    pickle, the pickle on CUDA only); the allocator's text summary is of
    ``device``, the rank's own (none without it: the current device may
    be another GPU)."""
    import torch

    from rankwatch.memory_snapshot import summarize, to_jsonable

    from ..core import device as device_mod

    members: dict[str, Any] = {}
    if adapter is None:
        adapter = device_mod.for_device(torch.device("cuda"))
    snapshot = adapter.memory_snapshot()
    if snapshot is None:
        return members
    members["memory_snapshot.json"] = {"summary": summarize(snapshot), "snapshot": to_jsonable(snapshot)}
    if device is not None:
        text = adapter.memory_summary(device)
        if text:
            members["memory_summary.txt"] = text
    if adapter.name != "cuda":
        return members
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
