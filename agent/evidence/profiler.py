"""Profiler evidence on request: a short torch.profiler trace (a few steps,
Chrome-trace format) and a per-operation summary, sent in a bundle. The
collector asks the slow rank and one healthy rank for one after a straggler
verdict and compares them.

torch's profiler is driven from the training thread only: started, stopped
and its results read (``key_averages``, the Chrome trace) there, at a step
end; only packing and sending go to a thread. Reading a ``with_stack``
profile's results in another thread while the training thread runs ops and
gloo collectives is not safe in torch 2.13: a plain torchrun DDP loop (no
rankwatch) that profiled 3 steps of every 5 and read each profile in a
thread ended in ``std::bad_alloc`` out of ``_disable_profiler`` on every
rank; read on the training thread, the same loop ran clean (60 profiles a
rank). In CI a rank asked for a profile after a straggler verdict died of
SIGSEGV at that step end, its fatal-signal dump cut off in the newest Python
thread. Reading takes tens of ms for a few steps of a small model
(key_averages ~20-80 ms here), once per straggler incident, on the two
ranks asked."""

from __future__ import annotations

import gzip
import os
import tempfile
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional

from rankwatch.wire import Command, StepRecord

from ..core.safety import guarded, log

if TYPE_CHECKING:
    from ..checks.memory import MemoryTracker
    from ..core.ports import StepProgress

MAX_STEPS = 10


class StepProfiler:
    """``memory``: told of the host memory a profile takes (None: not told);
    ``send_bundle(reason, incident, extra_members=...)``: packs and sends
    the profile's bundle (the runtime's)."""

    def __init__(self, *, progress: "StepProgress", memory: Optional["MemoryTracker"],
                 send_bundle: Callable[..., Any]) -> None:
        self.memory = memory
        self.send_bundle = send_bundle
        self._requested: Optional[Command] = None
        self._profile = None
        self._steps_left = 0
        self._done: set[str] = set()
        progress.step_extras.append(self._on_step_end)

    def on_command(self, command: Command) -> None:
        if command.details.get("action") == "profile" and command.incident not in self._done:
            self._done.add(command.incident)
            self._requested = command  # started by the training thread at the next step end

    def flush(self) -> None:
        """At the rank's exit (Agent.shutdown, atexit): a profile still
        running is stopped and dropped. Left running, torch's Python tracer
        is torn down with the interpreter while still registered and the
        process dies with SIGSEGV ("PythonTracer::stop() was not called"): a
        profile requested near the end of training turned a good job into
        exit code -11 (CI, torch 2.13)."""
        profile, self._profile = self._profile, None
        self._requested = None
        if profile is not None:
            try:
                profile.stop()
            except Exception:
                pass
            self._own_memory("own_work_ended")

    @guarded("profiler")
    def _on_step_end(self, record: StepRecord) -> None:
        if self._profile is None and self._requested is not None:
            import torch.profiler as tp

            activities = [tp.ProfilerActivity.CPU]
            import torch

            if torch.cuda.is_available():
                activities.append(tp.ProfilerActivity.CUDA)
            # with_stack: the Python functions (a time.sleep, a slow collate) are what the
            # comparison with a healthy rank names; safe read on this thread (see above).
            self._own_memory("own_work_started")
            self._profile = tp.profile(activities=activities, with_stack=True, record_shapes=False)
            self._profile.start()
            self._steps_left = max(1, min(MAX_STEPS, int(self._requested.details.get("steps", 3))))
            return
        if self._profile is not None:
            self._steps_left -= 1
            if self._steps_left <= 0:
                profile, self._profile = self._profile, None
                command, self._requested = self._requested, None
                profile.stop()
                summary, trace = read_results(profile)  # here, not in a thread: see the module's docstring
                threading.Thread(target=self._ship, args=(summary, trace, command), name="rankwatch-profile",
                                 daemon=True).start()

    def _own_memory(self, which: str) -> None:
        """The profile's host memory is rankwatch's, not the job's (agent/checks/memory.py)."""
        memory = self.memory
        if memory is not None:
            getattr(memory, which)()

    def _ship(self, summary: dict[str, Any], trace: bytes, command: Command) -> None:
        try:
            self._ship_bundle(summary, trace, command)
        finally:
            self._own_memory("own_work_ended")

    def _ship_bundle(self, summary: dict[str, Any], trace: bytes, command: Command) -> None:
        try:
            members: dict[str, Any] = {"profile_summary.json": summary,
                                       "profile_trace.json.gz": gzip.compress(trace)}
            self.send_bundle("profile", command.incident, extra_members=members)
        except Exception as exc:
            log(f"profiler trace failed: {type(exc).__name__}: {exc}")


def read_results(profile) -> tuple[dict[str, Any], bytes]:
    """The summary and the Chrome trace (JSON bytes) of a stopped profile."""
    summary = summarize(profile)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        profile.export_chrome_trace(path)
        with open(path, "rb") as f:
            trace = f.read()
    return summary, trace


def summarize(profile, top: int = 40) -> dict[str, Any]:
    """Self time per operation / Python function, in ms, largest first."""
    rows = []
    for event in profile.key_averages():
        self_us = float(getattr(event, "self_cpu_time_total", 0.0)) + float(getattr(event, "self_device_time_total", 0.0) or 0.0)
        rows.append({"name": str(event.key)[:200], "self_ms": self_us / 1000.0, "calls": int(event.count)})
    rows.sort(key=lambda r: r["self_ms"], reverse=True)
    return {"operations": rows[:top]}
