"""The one device adapter: everything rankwatch does with an accelerator goes
through here, so the code above it runs the same way on every device.

What the agent needs from a device is small: an event on the stream that
runs a tensor's work (to time device work and to know when a copy is done), a
non-blocking copy of a few floats into pinned host memory, the time between
two events, the allocator's counters (read once per step), whether the
current stream is being captured into a graph, and the allocator's OOM
observer. Host reads of device values are *deferred on every device*
(`DeferredReads`): a value is read on the host only once its copy's event
has completed, a step or more later on a GPU, at once on a CPU. Nothing here
blocks the host or synchronises the device.

Three implementations:

- `HostDevice` (CPU tensors): work is synchronous, so events complete when
  recorded and time between them is host time.
- `AcceleratorDevice` (CUDA/ROCm, XPU, and any device torch exposes through
  its device-generic APIs): the device module's streams and events
  (`torch.get_device_module(type)`, torch >= 2.3; `torch.cuda`), with
  `torch.accelerator.current_stream` / `torch.Event` (torch >= 2.6) only for
  a module that lacks them: `torch.Event`'s CUDA implementation creates a
  context on the current device (issue 25, finding 4; see `event`). Every call names the device of the tensors actually used (a
  script that never calls `torch.cuda.set_device` has GPU 0 as its current
  device while its tensors live on GPU k: an event recorded on GPU 0's
  stream would not order a copy made on GPU k, and would create a context on
  GPU 0). It was written against torch's sources (2.4-2.13) and is
  exercised on CPU through `GpuLikeDouble`, which behaves the way these
  calls do on a GPU. On a GPU it ran only at world size 1, on one H200
  (torch 2.11.0+cu130; bench/gpu_acceptance.py's DDP and FSDP2 cases in
  float32 and bfloat16, and bench/gpu_stream_stall.py for the stream
  calls, 2026-11-27; the staged reads of `DeferredReads.flush`, 2026-11-28);
  never across GPUs.
- `GpuLikeDouble`: a test double that makes CPU tensors behave as device
  tensors of one rank: events complete only after later work was issued (or
  after a latency), copies become readable only when their event completes,
  a current device (0 unless set) distinct from the device the tensors live
  on, per-device memory counters, a slower device for straggler tests,
  streams that stall on a wait (and a modelled slower peer whose collectives
  make them stall; `serve_streams` hands them to FSDP2's own code), graph
  capture (during which any event, query or pinned copy is a violation, as
  it would invalidate a CUDA graph), and an OOM it can raise through the
  observer. Tests install it (`install(GpuLikeDouble(...))`) so CPU tests run
  the logic that CUDA runs. Its tensors are CPU tensors to the dispatcher:
  a host-to-device copy (`torch.tensor(..., device=d)`, `.to(d)`) dispatches
  nothing, so syncs are looked for on `dispatch_double.DispatchDouble`, a
  device the dispatcher sees (single process: gloo/DDP cannot carry it).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Any, Callable, Optional

import torch

Consume = Callable[[Optional[list[float]]], None]


class HostDevice:
    """CPU tensors: synchronous work; an event is a host timestamp."""

    name = "cpu"
    batches_reads = False  # a read is a finished tensor already: nothing to launch, so nothing to save

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        return tensor.device

    def accelerated(self) -> bool:
        return False

    def event(self, device: torch.device, timing: bool = False) -> Any:
        return time.perf_counter()

    def to_host(self, tensor: torch.Tensor) -> Optional[tuple[Any, Any]]:
        # The tensor is a fresh result (a concatenation of norms): no copy needed.
        return tensor, None

    def ready(self, handle: Any) -> bool:
        return True

    def host_values(self, host: Any) -> list[float]:
        return host.tolist()

    def elapsed_s(self, start: Any, end: Any) -> Optional[float]:
        return max(0.0, end - start)

    def memory_stats(self, device: torch.device) -> Optional[tuple[int, int, int]]:
        return None

    def capturing(self, device: Optional[torch.device] = None) -> bool:
        return False

    def attach_oom_observer(self, observer: Callable[..., None]) -> bool:
        return False

    def memory_snapshot(self) -> Optional[dict[str, Any]]:
        return None

    def memory_summary(self, device: torch.device) -> Optional[str]:
        return None

    def event_type(self) -> Optional[type]:
        return None  # no streams: a wait on a peer blocks the host (the collectives' call windows)


class AcceleratorDevice:
    """CUDA/ROCm, XPU...: torch's device-generic calls where the installed
    torch has them. Ran on one GPU only (see the module docstring)."""

    # Each copy to the host is a pinned allocation, a copy launch and an
    # event: a step's reads go as one (DeferredReads.flush).
    batches_reads = True

    def __init__(self, device_type: str) -> None:
        self.name = device_type
        get = getattr(torch, "get_device_module", None)  # torch >= 2.3
        self.module = get(device_type) if get is not None else getattr(torch, device_type)
        accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
        self._generic = (accelerator is not None and hasattr(accelerator, "current_stream")
                         and hasattr(torch, "Event"))

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        return tensor.device

    def accelerated(self) -> bool:
        return True

    def _stream(self, device: torch.device):
        # The current stream *of that device* (not of the current device).
        if getattr(self.module, "current_stream", None) is None and self._generic:
            return torch.accelerator.current_stream(device)
        return self.module.current_stream(device)

    def event(self, device: torch.device, timing: bool = False) -> Any:
        # The device module's own event (torch.cuda.Event) when there is one:
        # its record, elapsed_time and destructor switch devices with a RAII
        # guard that creates no context. torch.Event goes through InlineEvent
        # -> CUDAGuardImpl, whose record/elapsedTime/destroy end with
        # setDevice(orig): on a rank whose current device is GPU 0 while its
        # tensors live on GPU k, cudaSetDevice(0) creates a primary context on
        # GPU 0 (~0.5 GiB per rank; issue 25, finding 4). torch.Event only
        # for a device module without an Event.
        stream = self._stream(device)
        make = getattr(self.module, "Event", None)
        if make is not None:
            ev = make(enable_timing=timing)
        else:
            ev = torch.Event(device, enable_timing=timing)
        ev.record(stream)
        return ev

    def to_host(self, tensor: torch.Tensor) -> Optional[tuple[Any, Any]]:
        # Pinned host memory: the copy is asynchronous on the tensor's own
        # device's current stream, and the event recorded right after it on
        # that same stream says when the bytes are there. (The caching host
        # allocator takes the primary context of a device that has one, so
        # no context is created on GPU 0 either.)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host, self.event(tensor.device)

    def ready(self, handle: Any) -> bool:
        return handle is None or bool(handle.query())

    def host_values(self, host: Any) -> list[float]:
        return host.tolist()

    def elapsed_s(self, start: Any, end: Any) -> Optional[float]:
        try:
            return max(0.0, float(start.elapsed_time(end)) / 1000.0)
        except Exception:  # an event recorded without timing, or on another device
            return None

    def memory_stats(self, device: torch.device) -> Optional[tuple[int, int, int]]:
        """(allocated, reserved, peak allocated) bytes from one read of the
        allocator's statistics (memory_allocated / memory_reserved /
        max_memory_allocated each rebuild the whole dict).

        The nested dict the allocator gives (``memory_stats_as_nested_dict``:
        torch.cuda and torch.xpu, 2.4-2.13) is read as it is: the flat
        ``memory_stats`` builds it too, then walks its ~160 entries in Python
        and sorts them. On an H100 (torch 2.11, 2026-11-28) that walk was
        0.45 ms of host time per step of the 3.5 ms rankwatch added to a
        host-bound DDP step; the nested read is one C call."""
        nested_of = getattr(self.module, "memory_stats_as_nested_dict", None)
        if nested_of is not None:
            stats = nested_of(device)
            if not stats:  # the allocator has not started
                return 0, 0, 0

            def of(name: str, kind: str) -> int:
                return int(stats.get(name, {}).get("all", {}).get(kind, 0))

            return of("allocated_bytes", "current"), of("reserved_bytes", "current"), of("allocated_bytes", "peak")
        accelerator = getattr(torch, "accelerator", None)
        stats_of = getattr(getattr(accelerator, "memory", None), "memory_stats", None)  # torch >= 2.9
        if stats_of is not None and _accelerator_type() == device.type:
            stats = stats_of(device.index)
        else:
            stats_of = getattr(self.module, "memory_stats", None)
            if stats_of is None:
                return None
            stats = stats_of(device)
        return (int(stats.get("allocated_bytes.all.current", 0)), int(stats.get("reserved_bytes.all.current", 0)),
                int(stats.get("allocated_bytes.all.peak", 0)))

    def capturing(self, device: Optional[torch.device] = None) -> bool:
        # A graph capture makes its stream current on its device and that
        # device current (torch.cuda.graph -> torch.cuda.stream).
        check = getattr(self.module, "is_current_stream_capturing", None)
        try:
            return bool(check()) if check is not None else False
        except Exception:
            return False

    def attach_oom_observer(self, observer: Callable[..., None]) -> bool:
        attach = getattr(torch._C, f"_{self.name}_attach_out_of_memory_observer", None)
        if attach is None:
            return False
        attach(observer)
        return True

    def memory_snapshot(self) -> Optional[dict[str, Any]]:
        memory = getattr(self.module, "memory", None)
        snapshot = getattr(memory, "_snapshot", None)
        return snapshot() if snapshot is not None else None

    def memory_summary(self, device: torch.device) -> Optional[str]:
        """The allocator's text summary *of the rank's device* (without a
        device it describes the current one: GPU 0 on a rank that never
        called set_device; issue 25, finding 8)."""
        summary = getattr(self.module, "memory_summary", None)
        return summary(device) if summary is not None else None

    def event_type(self) -> Optional[type]:
        """The device module's event class when its ``wait`` is Python
        (torch.cuda.Event, torch.xpu.Event: ``wait(stream=None)``), which
        every wait of a stream on an event goes through: ``Stream.wait_event``
        (FSDP2's ``device_handle.current_stream().wait_event``) and
        ``wait_stream`` call it, and so does what torch.compile makes of a
        stream's wait (``torch.ops.streams.wait_event``). torch.Event and
        torch.Stream (``torch.accelerator.current_stream()``) are C++ types
        that cannot be patched: waits made through them are not seen."""
        cls = getattr(self.module, "Event", None)
        if isinstance(cls, type) and callable(cls.__dict__.get("wait")):
            return cls
        return None

    def current_stream(self, device: Optional[torch.device]) -> Any:
        """The current stream of ``device`` (of the current device: None)."""
        if device is None:
            return self.module.current_stream()
        return self._stream(device)

    def stream_event(self, stream: Any) -> Any:
        """A timing event recorded on ``stream`` itself (not on the current
        stream of the calling thread: the backward of a CUDA model runs on
        autograd's device thread)."""
        ev = self.module.Event(enable_timing=True)
        ev.record(stream)
        return ev


def _accelerator_type() -> Optional[str]:
    try:
        return torch.accelerator.current_accelerator().type
    except Exception:
        return None


# -- the test double ---------------------------------------------------------------


class _DoubleEvent:
    """An event of the double: ``at`` is the device time it completes at
    (the time its stream's work reached it), ``order`` its place among the
    device's events. Also what FSDP's code makes through ``Event()`` of the
    device module the double serves (`serve_streams`)."""

    __slots__ = ("device", "at", "order", "double", "marker")

    def __init__(self, device: int = -1, at: float = 0.0, order: int = 0, double: Any = None) -> None:
        self.device, self.at, self.order, self.double = device, at, order, double
        self.marker = False  # one of two around a wait (`stream_event`): its span is a stall, not work

    def record(self, stream: Any = None) -> None:
        (stream if stream is not None else self.double.current_stream(None)).record_event(self)

    def wait(self, stream: Any = None) -> None:
        """Work queued on ``stream`` (the current device's current stream:
        None) from now on starts after this event: the stream stalls."""
        stream = stream if stream is not None else self.double.current_stream(None)
        stream.clock = max(stream.clock, self.at)

    def query(self) -> bool:
        return self.double is None or self.double.ready(self)

    def synchronize(self) -> None:
        pass


def _work(since: Optional[tuple[int, float]], thread: int, cpu: float, most: float) -> float:
    """The double's device work since ``since`` (a thread and its CPU time
    then): that thread's CPU time since, the double's work being host-paced.
    CPU time, not the clock: a host blocked in a gloo collective or on a
    full queue does no work (counting it fed the peers' waits back into
    each other's). More than ``most`` is set-up (imports, data), not device
    work; another thread's time is not known (none)."""
    if since is None or since[0] != thread:
        return 0.0
    return min(max(0.0, cpu - since[1]), most)


class _DoubleStream:
    """A stream of the double. ``clock`` is the device time its work has
    reached: an event recorded on it completes at the later of the host's
    time and the clock, and a wait on an event moves the clock to the
    event's time (the stream stalls until then, as a CUDA stream does). A
    *side* stream (one made through the served ``Stream()``: FSDP's
    all-gather and reduce-scatter streams) runs collectives with a modelled
    peer (`GpuLikeDouble.peer_slowdown`)."""

    def __init__(self, double: "GpuLikeDouble", device: int, side: bool) -> None:
        self.double, self.device_index, self.side = double, device, side
        self.clock = 0.0
        self.queued: Optional[tuple[int, float]] = None  # the thread and its CPU time at the last event

    def wait_event(self, event: Any) -> None:
        event.wait(self)  # as torch.cuda.Stream does

    def wait_stream(self, stream: "_DoubleStream") -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: Optional[_DoubleEvent] = None) -> _DoubleEvent:
        event = event if event is not None else _DoubleEvent(double=self.double)
        self.double._record(event, self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class GpuLikeDouble:
    """CPU tensors behave as tensors of device ``device`` of an accelerator
    (see the module docstring). ``lag``: an event completes once this many
    later events were recorded on its device, or ``latency_s`` after it was
    recorded (never before its device time). A stream's work takes the
    host's CPU time for it (`_work`) times ``slowdown`` (a slower GPU: its
    stream falls behind the host), after whatever stalls it; device time
    between two events is their device times apart, plus ``extra_s`` (a GPU
    slower by a fixed time; not on the span of a stall around a wait).

    ``peer_slowdown``: a peer whose device does the same work this many
    times slower. A collective queued on a side stream ends when that peer
    reaches it: the peer's work since the previous collective took
    ``peer_slowdown`` times ours (`_work`), so a stream that waits on it stalls,
    at every collective, as a fast GPU stalls behind a slow one. The host
    never blocks on a device, so the peer's lead would grow without end: as
    CUDA's launch queue does, the host blocks while its queued work runs
    more than ``queue_s`` ahead of it."""

    name = "double"
    batches_reads = True  # as AcceleratorDevice: a step's reads staged, then one copy

    def __init__(self, device: int = 0, current: int = 0, lag: int = 2, latency_s: float = 0.25,
                 slowdown: float = 1.0, extra_s: float = 0.0, peer_slowdown: float = 0.0,
                 queue_s: float = 0.2) -> None:
        self.device = device
        self.own = torch.device("cpu", device)  # its tensors' device, as the agent sees it
        self.current = current  # the current device: 0 unless the script set it
        self.lag, self.latency_s = lag, latency_s
        self.slowdown, self.extra_s = slowdown, extra_s
        self.peer_slowdown, self.queue_s = peer_slowdown, queue_s
        # The last collective: its end, and the thread that queued it with its CPU time then.
        self._peer: Optional[tuple[float, tuple[int, float]]] = None
        self._orders: dict[int, int] = collections.defaultdict(int)
        self._streams: dict[int, _DoubleStream] = {}  # each device's default (compute) stream
        self._side: Optional[_DoubleStream] = None  # made current by `stream(s)`
        self.touched: set[int] = set()  # devices any call used (a context would be created there)
        self.violations: list[str] = []  # what would have broken a CUDA graph capture
        self.host_buffers: "set[int]" = set()  # ids of host copies (reading those is not a device read)
        self.allocated: dict[int, int] = collections.defaultdict(int)
        self.reserved: dict[int, int] = collections.defaultdict(int)
        self.peak: dict[int, int] = collections.defaultdict(int)
        self.total: dict[int, int] = collections.defaultdict(lambda: 80 << 30)  # the device's memory
        self.stats_reads = 0
        self.snapshot: Optional[dict[str, Any]] = None
        self._observers: list[Callable[..., None]] = []
        self._capturing = False
        self._lock = threading.Lock()

    # what the agent calls
    def device_of(self, tensor: torch.Tensor) -> torch.device:
        return torch.device("cpu", self.device)

    def accelerated(self) -> bool:
        return True

    def _index(self, device: Optional[torch.device]) -> int:
        index = self.current if device is None or device.index is None else device.index
        self.touched.add(index)
        return index

    def _forbidden_in_capture(self, what: str) -> bool:
        if self._capturing:
            self.violations.append(what)
            return True
        return False

    def event(self, device: torch.device, timing: bool = False) -> Any:
        if self._forbidden_in_capture("event record"):
            raise RuntimeError("operation not permitted when stream is capturing")
        return self._record(_DoubleEvent(double=self), self.current_stream(device))

    def _record(self, event: _DoubleEvent, stream: _DoubleStream) -> _DoubleEvent:
        with self._lock:
            now, cpu, thread = time.perf_counter(), time.thread_time(), threading.get_ident()
            # The work queued on the compute stream since its last event runs after
            # what is ahead of it (a stall included) and takes what it took the host.
            # The host's work is all the compute stream's: a side stream's own (a
            # copy, a collective's launch) is nothing next to its wait for the peer.
            work = 0.0 if stream.side else _work(stream.queued, thread, cpu, self.queue_s) * self.slowdown
            at = max(now, stream.clock + work)
            stream.queued = (thread, cpu)
            if stream.side and self.peer_slowdown > 0:
                if self._peer is not None:
                    ended, queued = self._peer
                    at = max(at, ended + _work(queued, thread, cpu, self.queue_s) * self.peer_slowdown)
                self._peer = (at, (thread, cpu))
            stream.clock = at
            self._orders[stream.device_index] += 1
            event.device, event.at, event.order = stream.device_index, at, self._orders[stream.device_index]
        ahead = at - now - self.queue_s
        if ahead > 0:
            time.sleep(ahead)  # the launch queue is full: the host waits for the device
        return event

    def current_stream(self, device: Optional[torch.device]) -> _DoubleStream:
        index = self._index(device)
        if self._side is not None and index == self._side.device_index:
            return self._side
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = _DoubleStream(self, index, side=False)
        return stream

    def event_type(self) -> type:
        return _DoubleEvent

    def stream_event(self, stream: _DoubleStream) -> _DoubleEvent:
        event = stream.record_event()
        event.marker = True
        return event

    def to_host(self, tensor: torch.Tensor) -> Optional[tuple[Any, Any]]:
        if self._forbidden_in_capture("pinned copy"):
            raise RuntimeError("operation not permitted when stream is capturing")
        host = tensor.detach().clone()  # readable only once its event completes
        self.host_buffers.add(id(host))
        return host, self.event(self.device_of(tensor))

    def ready(self, handle: Any) -> bool:
        if self._forbidden_in_capture("event query"):
            raise RuntimeError("operation not permitted when stream is capturing")
        if handle is None:
            return True
        now = time.perf_counter()
        return now >= handle.at and (self._orders[handle.device] - handle.order >= self.lag
                                     or now - handle.at >= self.latency_s)

    def host_values(self, host: Any) -> list[float]:
        values = host.tolist()  # a host copy: reading it is no device read
        self.host_buffers.discard(id(host))
        return values

    def elapsed_s(self, start: Any, end: Any) -> Optional[float]:
        if start.device != end.device:
            return None
        extra = 0.0 if getattr(start, "marker", False) else self.extra_s  # a stall is no slower on a slow device
        return max(0.0, end.at - start.at + extra)

    def memory_stats(self, device: torch.device) -> Optional[tuple[int, int, int]]:
        index = self._index(device)
        self.stats_reads += 1
        return self.allocated[index], self.reserved[index], self.peak[index]

    def capturing(self, device: Optional[torch.device] = None) -> bool:
        return self._capturing

    def attach_oom_observer(self, observer: Callable[..., None]) -> bool:
        self._observers.append(observer)
        return True

    def memory_snapshot(self) -> Optional[dict[str, Any]]:
        return self.snapshot

    def memory_summary(self, device: torch.device) -> Optional[str]:
        index = self._index(device)
        return (f"memory summary of device {index} (test double): allocated {self.allocated[index]} bytes, "
                f"reserved {self.reserved[index]} bytes, peak {self.peak[index]} bytes\n")

    # what a test does with it
    @contextlib.contextmanager
    def capture(self):
        """A CUDA graph capture on this device's current stream."""
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    @contextlib.contextmanager
    def stream(self, stream: Optional[_DoubleStream]):
        """``with torch.cuda.stream(s)``: ``s`` is current on its device."""
        previous, self._side = self._side, (stream if stream is not None else self._side)
        try:
            yield
        finally:
            self._side = previous

    def serve_streams(self, device_module: Any) -> None:
        """Make ``device_module`` (``torch.cpu``, the one FSDP2 uses for CPU
        tensors) hand out this double's streams and events: FSDP2's own
        code then records its collectives' events on side streams and makes
        the current stream wait on them, as it does with ``torch.cuda`` (on
        a plain CPU its events are None and it never waits). For a test
        process only: it replaces the module's Stream, Event,
        current_stream and stream."""
        own = self.own
        device_module.Stream = lambda *args, **kwargs: _DoubleStream(self, self.device, side=True)
        device_module.Event = lambda *args, **kwargs: _DoubleEvent(double=self)
        device_module.current_stream = lambda *args, **kwargs: self.current_stream(own)
        device_module.stream = self.stream

    def set_memory(self, device: int, allocated: int, reserved: Optional[int] = None) -> None:
        self.allocated[device] = allocated
        self.reserved[device] = max(allocated, reserved or 0)
        self.peak[device] = max(self.peak[device], allocated)

    def raise_oom(self, requested: int) -> None:
        """What the caching allocator does when an allocation fails: the
        observers run on the allocating thread with (device, requested
        bytes, the device's total memory, its free memory), as
        c10/cuda/CUDACachingAllocator.h (2.13) calls them; then
        OutOfMemoryError."""
        index = self.device
        free = max(0, self.total[index] - self.reserved[index])
        for observer in list(self._observers):
            observer(index, requested, self.total[index], free)
        raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {requested} bytes (test double)")


# -- which adapter a tensor gets ----------------------------------------------------

_HOST = HostDevice()
_ACCELERATORS: dict[str, AcceleratorDevice] = {}
_installed: Optional[Any] = None


def install(adapter: Optional[Any]) -> None:
    """Use ``adapter`` for every tensor of this process (tests: a
    GpuLikeDouble); ``None`` goes back to the real devices."""
    global _installed
    _installed = adapter


def installed() -> Optional[Any]:
    return _installed


def for_device(device: torch.device) -> Any:
    if _installed is not None:
        return _installed
    if device.type == "cpu" or device.type == "meta":
        return _HOST
    adapter = _ACCELERATORS.get(device.type)
    if adapter is None:
        adapter = _ACCELERATORS[device.type] = AcceleratorDevice(device.type)
    return adapter


def for_tensor(tensor: torch.Tensor) -> Any:
    return for_device(tensor.device)


def device_of(tensor: torch.Tensor) -> torch.device:
    """The device a tensor's work runs on, as the adapter sees it."""
    return for_tensor(tensor).device_of(tensor)


def model_device(parameters) -> Optional[torch.device]:
    """The device of the first floating-point parameter: the rank's device,
    whatever the current device is."""
    for p in parameters:
        if p.is_floating_point():
            return device_of(p)
    return None


def capturing(device: Optional[torch.device] = None) -> bool:
    """A CUDA graph capture is under way on the current stream: nothing may
    record, query or copy now (it would invalidate the capture)."""
    adapter = _installed
    if adapter is None:
        if device is None or device.type == "cpu":
            if not _ACCELERATORS:
                return False
            return any(a.capturing() for a in _ACCELERATORS.values())
        adapter = for_device(device)
    return adapter.capturing(device)


# -- deferred host reads ------------------------------------------------------------


def _flat_float32(values: list[torch.Tensor]) -> torch.Tensor:
    """The values as one detached float32 vector, in order, in a few
    launches whatever their number: runs of scalars stacked at once, one
    cat (which promotes mixed dtypes exactly, and always makes a new
    tensor), one conversion. A detach, reshape and conversion per value
    were 3 launches each (~600 for the update check's per-parameter norms
    of a 200-parameter model)."""
    parts: list[torch.Tensor] = []
    scalars: list[torch.Tensor] = []
    for v in values:
        if v.requires_grad:
            v = v.detach()
        if v.dim() == 0:
            scalars.append(v)
            continue
        if scalars:
            parts.append(torch.stack(scalars))
            scalars = []
        parts.append(v if v.dim() == 1 else v.reshape(-1))
    if scalars:
        parts.append(torch.stack(scalars))
    flat = torch.cat(parts)  # a fresh tensor, even of one part: HostDevice reads it later as it is
    return flat if flat.dtype == torch.float32 else flat.float()


# Staged reads issued as one copy at most this many at a time (a job whose
# steps never end still gets its values back, this many submissions late).
STAGE_LIMIT = 32


class DeferredReads:
    """Device values -> host values without blocking: a submission snapshots
    its values into one flat float32 vector at once (`submit`: a device op,
    in stream order, so later in-place changes never reach it); on a device
    whose copies are launches (``batches_reads``) the step's snapshots are
    staged and go to host memory as one concatenation, one non-blocking copy
    and one event (`flush`, at the step's end), not one of each per
    submission; on the host (synchronous: nothing to save) each is read at
    once. A pair of events whose elapsed device time is wanted goes through
    `submit_spans`. `poll` hands each completed read to its consumer(s), in
    order. Bounded: past ``limit`` pending reads the oldest is given up (its
    consumers get None), so a device that stops making progress costs a
    fixed amount of memory. Call from the training thread only (a query from
    another thread during a graph capture would invalidate it)."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        # (adapter, handle to wait for, read the value, consumer)
        self.pending: collections.deque[tuple[Any, Any, Callable[[], Any], Callable[[Any], None]]] = \
            collections.deque()
        self.given_up = 0
        # Snapshots waiting for `flush`: one device's, in submission order.
        self._staged: list[tuple[torch.Tensor, Consume]] = []
        self._staged_on: Optional[tuple[Any, torch.device]] = None

    def submit(self, values: list[torch.Tensor], consume: Consume) -> bool:
        """``values``: scalars and vectors, read as one flat list of floats
        in their order. False (and ``consume(None)``) when nothing can be
        read now (a graph capture)."""
        if not values:
            return False
        adapter = for_tensor(values[0])
        device = adapter.device_of(values[0])
        if adapter.capturing(device):
            consume(None)
            return False
        flat = _flat_float32(values)
        if not adapter.batches_reads:
            return self._copy(adapter, flat, consume)
        if self._staged and self._staged_on != (adapter, device):
            self.flush()
        self._staged.append((flat, consume))
        self._staged_on = (adapter, device)
        if len(self._staged) >= STAGE_LIMIT:
            self.flush()
        return True

    def flush(self) -> None:
        """Issue the staged snapshots: one concatenation, one copy, one
        event; each consumer later gets its own slice. Left staged during a
        graph capture (the next flush issues them)."""
        if not self._staged or self._staged_on is None:
            return
        adapter, device = self._staged_on
        if adapter.capturing(device):
            return
        staged, self._staged = self._staged, []
        if len(staged) == 1:
            self._copy(adapter, staged[0][0], staged[0][1])
            return
        sizes = [flat.numel() for flat, _ in staged]  # shape metadata: no device read
        consumers = [consume for _, consume in staged]
        self._copy(adapter, torch.cat([flat for flat, _ in staged]),
                   lambda values: _hand_out(values, sizes, consumers))

    def _copy(self, adapter: Any, flat: torch.Tensor, consume: Consume) -> bool:
        try:
            copied = adapter.to_host(flat)
        except Exception:
            consume(None)  # a device in error (a crash's exit): nothing waits for these values
            raise
        if copied is None:
            consume(None)
            return False
        host, handle = copied
        self._add(adapter, handle, lambda: adapter.host_values(host), consume)
        return True

    def submit_spans(self, adapter: Any, spans: list[tuple[Any, Any]],
                     consume: Callable[[Optional[list[Optional[float]]]], None]) -> None:
        """Device seconds of each (start, end) pair of events, once the first
        pair's ``end`` has completed: every other pair was recorded before
        it on the same stream (the waits inside a step's window)."""
        self._add(adapter, spans[0][1], lambda: [adapter.elapsed_s(a, b) for a, b in spans], consume)

    def _add(self, adapter: Any, handle: Any, read: Callable[[], Any], consume: Callable[[Any], None]) -> None:
        if not self.pending and adapter.ready(handle):
            consume(read())  # a CPU: the value is there now
            return
        self.pending.append((adapter, handle, read, consume))
        while len(self.pending) > self.limit:
            dropped = self.pending.popleft()[3]
            self.given_up += 1
            dropped(None)

    def poll(self) -> int:
        """Consume what is ready, in submission order; never waits."""
        done = 0
        while self.pending:
            adapter, handle, read, consume = self.pending[0]
            if adapter.capturing() or not adapter.ready(handle):
                break
            self.pending.popleft()
            consume(read())
            done += 1
        return done

    def give_up(self) -> None:
        """At exit: what has not completed is not waited for (in order: the
        copies issued, then what was still staged)."""
        while self.pending:
            consume = self.pending.popleft()[3]
            consume(None)
        staged, self._staged = self._staged, []
        for _, consume in staged:
            consume(None)


def _hand_out(values: Optional[list[float]], sizes: list[int], consumers: list[Consume]) -> None:
    """One staged copy's floats, back to each submission's consumer in order."""
    at = 0
    for size, consume in zip(sizes, consumers):
        consume(None if values is None else values[at:at + size])
        at += size
