"""Collective tracking: torch's Flight Recorder, completion callbacks, and
the call sites of collectives issued from Python.

Flight Recorder (FR) records every collective of every process group with its
sequence number, op, sizes and dtypes. There are two recorders, and a job
with both gloo and NCCL groups needs both:

- ProcessGroupNCCL's own (``FlightRecorder<at::cuda::CUDAEvent>``): read with
  ``torch._C._distributed_c10d._dump_nccl_trace_json(includeCollectives,
  onlyActive)``, torch >= 2.5 in NCCL builds (older releases have only the
  pickle dump ``_dump_nccl_trace``, which rankwatch never unpickles);
- the generic one that gloo writes (``FlightRecorder<c10::Event>``): read with
  ``_dump_fr_trace_json(includeCollectives, onlyActive)``, torch >= 2.8.

Reading only ``pg_status`` (``includeCollectives=False``) costs ~50 µs, so
it is read at marked steps and in heartbeats; the full dump (~40 ms for 2000
entries) only goes into incident bundles. The JSON dump writes pg_status
numbers as strings (FlightRecorderDetail.hpp ``getPgStatusJson``).

Where FR gives nothing (torch < 2.8 with gloo, < 2.5 with NCCL, the
recorder off), every Python-API collective still counts, per process group:
enqueued when called, completed when its future completes
(``work.get_future().then``, for ``async_op=True`` calls) or when a
synchronous call returns on a host backend. NCCL collectives return as soon
as they are queued, so a rank that waits for a peer sits in ``loss.item()``
or ``work.wait()``, not in ``torch.distributed``: the numbers, not the
stacks, say who is behind. The NCCL paths were never run on a GPU here; the
NCCL dump's format is tested with recorded dumps (tests/data/).

FR does not say *who* issued a collective. DDP's gradient allreduces come
from C++; a stray ``dist.all_reduce`` in user code comes through the Python
API. Wrapping the Python API records the call site and the time window of
each call, so the collector can tell "the same op and size, but issued from
train.py:42 instead of DDP's backward" (the silent off-by-one mismatch).

Under ``torch.compile`` the wrappers step aside: ``torch.compiler.is_compiling``
is the first thing they ask, so Dynamo traces the bare collective (also with
``fullgraph=True``) and never reaches the recording (``sys._getframe``). The
recording is not wrapped in ``torch.compiler.disable`` on top: that would
graph-break a ``fullgraph=True`` region if it were ever reached, and the
first ``torch.compiler.disable`` imports Dynamo (~2 s of every rank's start).
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

from ..core.patching import Patches, argument, binding_error
from ..core.safety import guarded
from ..core.stacks import is_own_file
from ..core.torch_state import compiling

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



def fr_readers() -> list[tuple[str, Callable[..., Any]]]:
    """The Flight Recorder dumps this torch has, NCCL's first:
    (name, dump(includeCollectives, onlyActive) -> JSON bytes)."""
    try:
        import torch

        c10d = torch._C._distributed_c10d
    except Exception:
        return []
    readers = []
    for name, attribute in (("nccl", "_dump_nccl_trace_json"), ("generic", "_dump_fr_trace_json")):
        dump = getattr(c10d, attribute, None)
        if dump is not None:
            readers.append((name, dump))
    return readers


# -- torch's settings for Flight Recorder and its dump on timeout -----------------------

FR_DIR = "flight_recorder"  # in the run dir: where torch writes its dumps on a collective timeout
TIMEOUT_DUMP_MAX_BYTES = 32 << 20

# (names torch reads, newest first: torch >= 2.8 reads TORCH_FR_*, older
# releases only TORCH_NCCL_*), value rankwatch wants.
_FR_SETTINGS: tuple[tuple[tuple[str, ...], str], ...] = (
    # Older releases default the buffer to 0: recorder and dump-on-timeout off.
    (("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"), "2000"),
    (("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"), ""),  # the run dir's prefix
    (("TORCH_NCCL_DUMP_ON_TIMEOUT",), "1"),
    # 3 = kill the process on a collective error without aborting the
    # communicator: keeps Flight Recorder dumps (1 suppresses them).
    (("TORCH_NCCL_ASYNC_ERROR_HANDLING",), "3"),
    (("TORCH_NCCL_ENABLE_MONITORING",), "1"),
)


def fr_environment(run_dir: Any, env: Any = None) -> dict[str, str]:
    """The variables to add to a worker's environment: each setting under the
    name this torch reads (both spellings below 2.8, so the whole supported
    range 2.4-2.13 reads it). Where
    the user set one name, the others get the user's value; where the user
    set none, rankwatch's. The timeout dump's prefix lies in the run dir
    (file = prefix + rank), where rankwatch collects it. Torch's debug-info
    pipe (TORCH_NCCL_DEBUG_INFO_PIPE_FILE) is not set: nothing writes it, and
    it needs FIFO support on the run dir's filesystem."""
    env = os.environ if env is None else env
    out: dict[str, str] = {}
    for names, value in _FR_SETTINGS:
        given = next((env[n] for n in names if n in env), None)
        if given is None:
            if names[0] == "TORCH_FR_DUMP_TEMP_FILE":
                if not run_dir:
                    continue
                value = os.path.join(str(run_dir), FR_DIR, "rank_")
            given = value
        for name in names:
            if name not in env and (name == names[0] or not _reads_fr_names()):
                out[name] = given
    return out


def _reads_fr_names() -> bool:
    """This torch reads TORCH_FR_* (>= 2.8): the old TORCH_NCCL_* spelling is
    then left out, since torch warns on every rank for each old name set."""
    try:
        import torch

        major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
        return (major, minor) >= (2, 8)
    except Exception:
        return False


def timeout_dump_prefix(run_dir: Any, env: Any = None) -> str:
    """Where torch writes this job's dumps on a collective timeout."""
    env = os.environ if env is None else env
    for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        if env.get(name):
            return env[name]
    if run_dir:
        return os.path.join(str(run_dir), FR_DIR, "rank_")
    return "/tmp/nccl_trace_rank_"  # torch's default


def timeout_dump_members(rank: int, prefix: str) -> dict[str, Any]:
    """The Flight Recorder dump torch wrote for ``rank`` on a collective
    timeout, as a bundle member. Torch writes its pickle format there
    (``dump_nccl_trace``): it travels as an opaque member for torch's own
    ``torchfrtrace``/``fr_trace`` tool and is never unpickled by rankwatch;
    a JSON dump is kept as JSON."""
    path = f"{prefix}{rank}"
    try:
        with open(path, "rb") as f:
            data = f.read(TIMEOUT_DUMP_MAX_BYTES + 1)
    except OSError:
        return {}
    if not data or len(data) > TIMEOUT_DUMP_MAX_BYTES:
        return {}
    if data.lstrip()[:1] == b"{":
        try:
            return {"fr_timeout_dump.json": json.loads(data)}
        except ValueError:
            return {}
    return {"fr_timeout_dump.pickle": data}


def _int(value: Any, default: int = -1) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def merge_pg_status(dumps: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, int]]:
    """pg -> {enqueued, completed} over the recorders' dumps. A process
    group id both recorders use (one group with a gloo and an NCCL backend)
    is kept apart: the second one's key gets its recorder's name."""
    out: dict[str, dict[str, int]] = {}
    for name, dump in dumps:
        status = dump.get("pg_status") if isinstance(dump, dict) else None
        if not isinstance(status, dict):
            continue
        for pg, st in status.items():
            if not isinstance(st, dict):
                continue
            key = str(pg) if str(pg) not in out else f"{pg}/{name}"
            out[key] = {"enqueued": _int(st.get("last_enqueued_collective")),
                        "completed": _int(st.get("last_completed_collective"))}
    return out


class CollectiveTracker:
    def __init__(self, max_calls: int = 1024):
        self.calls: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_calls)
        # Python-API collectives per process group: enqueued / completed counts
        # (where Flight Recorder says nothing).
        self.counted_enqueued: dict[str, int] = {}
        self.counted_completed: dict[str, int] = {}
        self._count_lock = threading.Lock()
        self._pg_keys: dict[int, str] = {}
        self._host_backends: dict[str, bool] = {}
        self._installed = False
        self._torch_dir: Optional[str] = None
        self._local = threading.local()
        self.blackbox = None  # set by the agent: in-flight calls survive a fatal abort
        # Told of each finished call's window (seconds): the step's own data
        # and compute time exclude the waits in collectives (agent/watch/progress.py).
        self.on_call_done: Optional[Callable[[float, float], None]] = None

    # -- Flight Recorder ----------------------------------------------------------
    @guarded("collectives.pg_status", default={})
    def pg_status(self) -> dict[str, dict[str, int]]:
        """pg id -> {enqueued, completed}; cheap (no entries). Flight
        Recorder's numbers when any recorder has a process group, else the
        Python-API counts (the same choice on every rank: same torch)."""
        if not _dist_initialized():
            return {}
        dumps = []
        for name, dump in fr_readers():
            try:
                dumps.append((name, json.loads(dump(False, False))))
            except Exception:
                continue
        status = merge_pg_status(dumps)
        if status:
            return status
        with self._count_lock:
            return {pg: {"enqueued": seq, "completed": self.counted_completed.get(pg, -1)}
                    for pg, seq in self.counted_enqueued.items()}

    def enqueued_seqs(self) -> dict[str, int]:
        return {pg: st["enqueued"] for pg, st in self.pg_status().items()}

    def full_dump(self) -> tuple[Optional[bytes], str]:
        """The whole FR dump as JSON bytes: one recorder's as it wrote it, or
        both merged (entries of both, pg_status and pg_config keyed apart)."""
        readers = fr_readers()
        if not readers:
            return None, "Flight Recorder JSON dumps are not available in this torch build"
        raw: list[tuple[str, bytes]] = []
        errors = []
        for name, dump in readers:
            try:
                raw.append((name, bytes(dump(True, False))))
            except Exception as exc:
                errors.append(f"Flight Recorder ({name}) dump failed: {type(exc).__name__}: {exc}")
        if not raw:
            return None, "; ".join(errors)
        if len(raw) == 1:
            return raw[0][1], "; ".join(errors)
        try:
            parsed = [(name, json.loads(text)) for name, text in raw]
        except ValueError as exc:
            return raw[0][1], f"Flight Recorder dumps not merged: {exc}"
        parsed = [(name, d) for name, d in parsed if isinstance(d, dict)]
        populated = [(name, d) for name, d in parsed if d.get("entries") or d.get("pg_status")]
        if len(populated) <= 1:
            return (json.dumps(populated[0][1]).encode() if populated else raw[0][1]), "; ".join(errors)
        merged: dict[str, Any] = {"version": populated[0][1].get("version"), "recorders": [n for n, _ in populated],
                                  "pg_config": {}, "pg_status": {}, "entries": []}
        for name, dump in populated:
            for key in ("pg_config", "pg_status"):
                for pg, value in (dump.get(key) or {}).items():
                    merged[key][str(pg) if str(pg) not in merged[key] else f"{pg}/{name}"] = value
            merged["entries"].extend(dump.get("entries") or [])
        return json.dumps(merged).encode(), "; ".join(errors)

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
        record_call = self._recorded_call

        @functools.wraps(fn)
        def collective(*args, **kwargs):
            if compiling():  # Dynamo traces the bare collective (also with fullgraph=True)
                return fn(*args, **kwargs)
            if getattr(tracker._local, "depth", 0):  # nested (e.g. barrier -> all_reduce): record the outer call
                return fn(*args, **kwargs)
            return record_call(op, fn, args, kwargs)

        return collective

    def _recorded_call(self, op: str, fn, args: tuple, kwargs: dict):
        local = self._local
        local.depth = 1
        # The first parameter of every collective is its tensor (or list),
        # passed by position or by keyword (tensor=, tensor_list=, ...).
        call = self._enter(op, argument(fn, args, kwargs, 0))
        counted = self._count_enqueued(fn, args, kwargs)
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            local.depth = 0
            # Keep the black box's in-flight record: this call is where the
            # rank failed, and it may be killed before it can say so. A
            # wrong call (arguments that do not bind) never started.
            wrong = _wrong_call(fn, args, kwargs)
            self._leave(call, clear=wrong, started=not wrong)
            raise
        local.depth = 0
        self._leave(call)
        if counted is not None:
            self._count_completion(counted, result)
        return result

    # -- completion without Flight Recorder ---------------------------------------------
    @guarded("collectives.counts")
    def _count_enqueued(self, fn, args: tuple, kwargs: dict) -> Optional[tuple[str, int, Any]]:
        """(pg key, this call's number in its group, the group)."""
        group = kwargs.get("group")
        if group is None:
            group = _positional_group(fn, args)
        key = self._pg_key(group)
        if key is None:
            return None
        with self._count_lock:
            seq = self.counted_enqueued.get(key, 0) + 1
            self.counted_enqueued[key] = seq
        return key, seq, group

    def _pg_key(self, group: Any) -> Optional[str]:
        try:
            import torch.distributed.distributed_c10d as c10d

            if group is None:
                group = c10d._get_default_group()
            key = self._pg_keys.get(id(group))
            if key is None:
                key = str(getattr(group, "group_name", None) or c10d._world.pg_names.get(group, id(group)))
                if len(self._pg_keys) < 1024:
                    self._pg_keys[id(group)] = key
            return key
        except Exception:
            return None

    @guarded("collectives.counts")
    def _count_completion(self, counted: tuple[str, int, Any], result: Any) -> None:
        key, seq, group = counted
        get_future = getattr(result, "get_future", None)
        if get_future is not None:  # async_op=True: completed when its future is
            def done(future, key=key, seq=seq):
                self._completed(key, seq)
                return None

            get_future().then(done)
            return
        host = self._host_backends.get(key)
        if host is None:
            host = self._host_backends[key] = _host_backend(group)
        if host:  # a synchronous call on a host backend returned: done
            self._completed(key, seq)

    def _completed(self, key: str, seq: int) -> None:
        with self._count_lock:
            if seq > self.counted_completed.get(key, 0):
                self.counted_completed[key] = seq

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


def _positional_group(fn, args: tuple) -> Any:
    """The ``group`` argument given by position, if any."""
    from ..core.patching import _signature

    sig = _signature(fn)
    if sig is None:
        return None
    names = list(sig.parameters)
    if "group" in names:
        index = names.index("group")
        if index < len(args):
            return args[index]
    return None


def _host_backend(group: Any) -> bool:
    """A synchronous collective on this group has completed when it returns
    (gloo, mpi); NCCL-like backends return once it is queued."""
    try:
        import torch.distributed as dist

        backend = str(dist.get_backend(group)).lower()
    except Exception:
        return False
    return "nccl" not in backend and "xccl" not in backend and "cuda" not in backend


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
