"""Collective tracking: torch's Flight Recorder plus the call sites of
collectives issued from Python.

Flight Recorder (FR) records every collective of every process group with its
sequence number, op, sizes and dtypes, on NCCL and gloo alike. Reading only
``pg_status`` costs ~50 µs, so it is read at marked steps and in heartbeats;
the full dump (~40 ms for 2000 entries) only goes into incident bundles.

FR does not say *who* issued a collective. DDP's gradient allreduces come
from C++; a stray ``dist.all_reduce`` in user code comes through the Python
API. Wrapping the Python API records the call site and the time window of
each call, so the collector can tell "the same op and size, but issued from
train.py:42 instead of DDP's backward" (the silent off-by-one mismatch).
"""

from __future__ import annotations

import collections
import functools
import json
import os
import sys
import threading
import time
from typing import Any, Callable, Optional

from .patching import Patches, argument, binding_error
from .safety import guarded
from .stacks import is_own_file

_PY_API_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "barrier",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "monitored_barrier",
    # newer names and the object / coalesced variants (skipped where torch lacks them)
    "all_gather_single",
    "reduce_scatter_single",
    "all_reduce_coalesced",
    "all_gather_coalesced",
    "gather_object",
    "scatter_object_list",
)



def _fr_module():
    try:
        import torch

        c10d = torch._C._distributed_c10d
    except Exception:
        return None
    return c10d if hasattr(c10d, "_dump_fr_trace_json") else None


class CollectiveTracker:
    def __init__(self, max_calls: int = 1024):
        self.calls: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_calls)
        self._installed = False
        self._torch_dir: Optional[str] = None
        self._local = threading.local()
        self.blackbox = None  # set by the agent: in-flight calls survive a fatal abort
        # Told of each finished call's window (seconds): the step's own data
        # and compute time exclude the waits in collectives (agent/progress.py).
        self.on_call_done: Optional[Callable[[float, float], None]] = None

    # -- Flight Recorder -------------------------------------------------------
    @guarded("collectives.pg_status", default={})
    def pg_status(self) -> dict[str, dict[str, int]]:
        """pg id -> {enqueued, completed}; cheap (no entries)."""
        c10d = _fr_module()
        if c10d is None or not _dist_initialized():
            return {}
        raw = c10d._dump_fr_trace_json(False)
        status = json.loads(raw).get("pg_status", {})
        out = {}
        for pg, st in status.items():
            out[str(pg)] = {
                "enqueued": int(st.get("last_enqueued_collective", -1)),
                "completed": int(st.get("last_completed_collective", -1)),
            }
        return out

    def enqueued_seqs(self) -> dict[str, int]:
        return {pg: st["enqueued"] for pg, st in self.pg_status().items()}

    def full_dump(self) -> tuple[Optional[bytes], str]:
        """The whole FR dump as JSON bytes (unparsed: the collector parses it)."""
        c10d = _fr_module()
        if c10d is None:
            return None, "Flight Recorder is not available in this torch build"
        try:
            return bytes(c10d._dump_fr_trace_json()), ""
        except Exception as exc:
            return None, f"Flight Recorder dump failed: {type(exc).__name__}: {exc}"

    # -- Python API call sites ---------------------------------------------------
    def install(self, patches: Patches) -> None:
        if self._installed:
            return
        import torch
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self._torch_dir = os.path.dirname(torch.__file__)
        for name in _PY_API_COLLECTIVES:
            original = getattr(c10d, name, None)
            wrapped = patches.apply(c10d, name, lambda fn, name=name: self._wrap(name, fn))
            if wrapped is not None:
                patches.alias(dist, name, original, wrapped)
        self._installed = True

    def _wrap(self, op: str, fn):
        tracker = self

        @functools.wraps(fn)
        def collective(*args, **kwargs):
            local = tracker._local
            if getattr(local, "depth", 0):  # nested (e.g. barrier -> all_reduce): record the outer call
                return fn(*args, **kwargs)
            local.depth = 1
            # The first parameter of every collective is its tensor (or list),
            # passed by position or by keyword (tensor=, tensor_list=, ...).
            call = tracker._enter(op, argument(fn, args, kwargs, 0))
            try:
                result = fn(*args, **kwargs)
            except BaseException:
                local.depth = 0
                # Keep the black box's in-flight record: this call is where the
                # rank failed, and it may be killed before it can say so. A
                # wrong call (arguments that do not bind) never started.
                wrong = _wrong_call(fn, args, kwargs)
                tracker._leave(call, clear=wrong, started=not wrong)
                raise
            local.depth = 0
            tracker._leave(call)
            return result

        return collective

    @guarded("collectives.callsite")
    def _enter(self, op: str, tensor: Any) -> Optional[dict[str, Any]]:
        # The call site is the first frame outside torch and rankwatch.
        frame = sys._getframe(1)
        site = None
        while frame is not None:
            filename = frame.f_code.co_filename
            if not (
                (self._torch_dir and filename.startswith(self._torch_dir))
                or is_own_file(filename)
                or filename.startswith("<frozen")
            ):
                site = f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
                break
            frame = frame.f_back
        numel = int(tensor.numel()) if hasattr(tensor, "numel") else 0
        call = {"op": op, "started_ns": time.time_ns(), "ended_ns": 0, "thread": threading.get_ident(),
                "callsite": site or "<unknown>", "numel": numel}
        self.calls.append(call)  # in flight until ended_ns is set
        if self.blackbox is not None:
            self.blackbox.enter_collective(op, numel, time.time(), call["callsite"])
        return call

    @guarded("collectives.callsite")
    def _leave(self, call: Optional[dict[str, Any]], clear: bool = True, started: bool = True) -> None:
        if call is None:
            return
        call["ended_ns"] = time.time_ns()
        if started and self.on_call_done is not None:
            self.on_call_done(call["started_ns"] / 1e9, call["ended_ns"] / 1e9)
        if not started:  # a call with wrong arguments is no collective
            try:
                self.calls.remove(call)
            except ValueError:
                pass
        if not clear:
            call["failed"] = True
        elif self.blackbox is not None:
            self.blackbox.leave_collective()


def _wrong_call(fn, args: tuple, kwargs: dict) -> bool:
    try:
        return binding_error(fn, args, kwargs)
    except Exception:
        return False


def _dist_initialized() -> bool:
    try:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized()
    except Exception:
        return False
