"""A device the dispatcher sees as distinct from the host, for the sync tests.

`device.GpuLikeDouble` makes CPU tensors *behave* as device tensors, but to
the dispatcher they stay CPU tensors: ``torch.tensor(..., device=d)`` and
``.to(d)`` dispatch no copy at all, so a host-to-device copy (a
``cudaStreamSynchronize`` on CUDA) cannot be seen. This module registers
torch's PrivateUse1 backend from Python under the name ``rwdev``
(``torch.utils.backend_registration._setup_privateuseone_for_python_backend``,
torch >= 2.5; experimental in torch) and gives it tensors whose values live
in CPU memory behind a ``__torch_dispatch__`` wrapper (`DeviceTensor`).
Every transfer then dispatches to this module, from every thread (the
dispatcher is global; torch's dispatch and function modes are
thread-local), and is counted in `TRANSFERS` with its call site and thread
when it would block the host on CUDA (REFERENCE.md, "CUDA semantics"):

- host to device, unless ``non_blocking`` from a pinned buffer
  (``torch.tensor(list, device=d)``, ``.to(d)`` of a CPU tensor);
- device to host, unless ``non_blocking`` into a pinned buffer (``.cpu()``,
  ``.to("cpu")``, ``copy_`` into pageable memory, ``.tolist()``,
  ``.numpy()``);
- ``.item()`` / ``float()`` / ``bool()`` (``aten::_local_scalar_dense``,
  ``aten::is_nonzero``) and the ops whose output size depends on values
  (``nonzero``, ``masked_select``, boolean indexing, ``unique``).

A non-blocking copy into a pinned buffer (`pinned_empty`) is *asynchronous*:
the buffer holds NaN until an event recorded after the copy on the same
stream has completed and was queried (`DispatchDouble.ready`); reading it
earlier gives garbage, as on a GPU. Events are ordered per stream, there can
be several streams (`DispatchDouble.stream`), and a stream can be made to
wait on another (`DispatchDouble.wait_stream`: the wait of the current
stream on a collective's stream).

What it cannot carry: gloo and DDP accept only CPU and CUDA tensors, so
multi-rank jobs keep `device.GpuLikeDouble`; this device runs single-process
training (autograd, optimizers, the agent's own hooks). It has one device
index (0): the autograd engine sizes its queues by the backend's device
count, which the Python registration fixes at 1. Registering it changes
what ``torch.accelerator`` reports for the whole process, so tests use it
in a subprocess of their own (`tests/test_no_host_sync.py`). Nothing here
ever ran on a GPU; it models what CUDA does, from torch's sources.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import time
import weakref
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_map

from .device import GpuLikeDouble

BACKEND = "rwdev"
aten = torch.ops.aten

_SIZE_FROM_VALUES = {"aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::unique_dim",
                     "aten::unique_consecutive", "aten::nonzero_static"}
_SCALAR_READS = {"aten::_local_scalar_dense", "aten::is_nonzero"}


class Transfers:
    """Every blocking transfer seen, from any thread: (what, file, line, thread) -> count."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()

    def note(self, what: str) -> None:
        site = _call_site()
        with self._lock:
            self.counts[(what, *site, threading.current_thread().name)] += 1

    def snapshot(self) -> collections.Counter:
        with self._lock:
            return collections.Counter(self.counts)

    def clear(self) -> None:
        with self._lock:
            self.counts.clear()


TRANSFERS = Transfers()
_pinned: "set[int]" = set()  # data_ptr of host buffers made by pinned_empty
_state_lock = threading.Lock()
_double: "Optional[DispatchDouble]" = None
_HERE = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _call_site() -> tuple[str, int]:
    """The first frame outside torch and this module: the line that asked."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename == _HERE
                                 or frame.f_code.co_filename.startswith(_TORCH)):
        frame = frame.f_back
    if frame is None:
        return ("?", 0)
    return (frame.f_code.co_filename, frame.f_lineno)


class DeviceTensor(torch.Tensor):
    """A tensor of device ``rwdev:0`` whose values are the CPU tensor ``host``."""

    host: torch.Tensor

    @staticmethod
    def __new__(cls, host: torch.Tensor) -> "DeviceTensor":
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, host.shape, strides=host.stride(), storage_offset=host.storage_offset(), dtype=host.dtype,
            device=torch.device(BACKEND, 0), requires_grad=host.requires_grad)
        wrapper.host = host
        return wrapper

    def __repr__(self) -> str:  # no device read: printing is a test's own business
        return f"DeviceTensor(shape={tuple(self.shape)}, dtype={self.dtype})"

    def tolist(self):  # torch refuses tolist on subclasses; on CUDA it is a blocking copy
        TRANSFERS.note("Tensor.tolist")
        return self.host.tolist()

    def numpy(self, *args, **kwargs):
        TRANSFERS.note("Tensor.numpy")
        return self.host.numpy(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in _SCALAR_READS:
            TRANSFERS.note(name)
        elif name in _SIZE_FROM_VALUES or (name in ("aten::index", "aten::index_put", "aten::index_put_")
                                           and _has_bool_index(args)):
            TRANSFERS.note(f"{name} (output size from device values)")
        if name == "aten::copy_":
            return _copy(args[0], args[1], bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False)))
        if name == "aten::_to_copy" and _is_host(kwargs.get("device")) and isinstance(args[0], DeviceTensor):
            TRANSFERS.note("device to host copy")
            return aten._to_copy.default(args[0].host, **kwargs)
        inputs: dict[int, DeviceTensor] = {}

        def unwrap(value):
            if isinstance(value, DeviceTensor):
                inputs[id(value.host)] = value
                return value.host
            if isinstance(value, torch.device) and value.type == BACKEND:
                return torch.device("cpu")
            return value

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

        def wrap(value):
            if isinstance(value, torch.Tensor) and not isinstance(value, DeviceTensor):
                same = inputs.get(id(value))
                return same if same is not None else DeviceTensor(value)  # in place: the input itself
            return value

        return tree_map(wrap, out)


def _is_host(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (indices or ()))


def _copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> torch.Tensor:
    """copy_ between the device and the host, with CUDA's blocking rules."""
    to_device, from_device = isinstance(dst, DeviceTensor), isinstance(src, DeviceTensor)
    dst_host = dst.host if to_device else dst
    src_host = src.host if from_device else src
    if to_device and from_device:
        dst_host.copy_(src_host)
        return dst
    pinned = (src_host if to_device else dst_host).data_ptr() in _pinned
    if not (non_blocking and pinned):
        TRANSFERS.note("host to device copy" if to_device else "device to host copy")
        dst_host.copy_(src_host)
        return dst
    if to_device or _double is None:
        dst_host.copy_(src_host)  # host to device from pinned memory: the host is not read back
        return dst
    _double.enqueue_copy(dst_host, src_host.detach().clone())
    return dst


def _empty_memory_format(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return DeviceTensor(torch.empty(size, dtype=dtype, layout=layout))


def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return DeviceTensor(torch.empty_strided(size, stride, dtype=dtype, layout=layout))


def _copy_from(src, dst, non_blocking=False):
    # Reached when torch.tensor(...) builds a device tensor with the Python
    # key excluded (torch/csrc/utils/tensor_new.cpp): a host to device copy.
    return _copy(dst, src, bool(non_blocking))


_registered = False
_library: Optional[torch.library.Library] = None


def register() -> torch.device:
    """Register the backend (once per process; it cannot be undone)."""
    global _registered, _library
    with _state_lock:
        if not _registered:
            from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

            _setup_privateuseone_for_python_backend(BACKEND)
            _library = torch.library.Library("aten", "IMPL")
            _library.impl("empty.memory_format", _empty_memory_format, "PrivateUse1")
            _library.impl("empty_strided", _empty_strided, "PrivateUse1")
            _library.impl("_copy_from", _copy_from, "PrivateUse1")
            _registered = True
    return torch.device(BACKEND, 0)


def pinned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """A host buffer a non-blocking copy can fill asynchronously (pinned
    memory, modelled): NaN (or -1) until the copy's event completes."""
    fill = float("nan") if dtype.is_floating_point else -1
    host = torch.full(tuple(shape), fill, dtype=dtype)
    _pinned.add(host.data_ptr())
    weakref.finalize(host, _pinned.discard, host.data_ptr())  # its memory may serve a pageable tensor later
    return host


class _Event:
    __slots__ = ("device", "stream", "at", "order", "after")

    def __init__(self, device: int, stream: int, at: float, order: int, after: list) -> None:
        self.device, self.stream, self.at, self.order, self.after = device, stream, at, order, after


class DispatchDouble(GpuLikeDouble):
    """The device adapter for ``rwdev`` tensors (`device.install` it). Same
    event and timing model as `GpuLikeDouble`, plus: events ordered per
    stream, waits between streams, and host copies that hold garbage until
    their event completed."""

    name = "dispatch-double"

    def __init__(self, **options: Any) -> None:
        super().__init__(device=0, **options)
        global _double
        register()
        self.stream_now = 0  # the current stream's number
        self._stream_orders: dict[tuple[int, int], int] = collections.defaultdict(int)
        self._waits: dict[tuple[int, int], list[_Event]] = collections.defaultdict(list)
        self._copies: list[tuple[tuple[int, int], int, torch.Tensor, torch.Tensor]] = []
        self._done: dict[tuple[int, int], int] = collections.defaultdict(int)
        _double = self

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        return tensor.device

    # streams
    @contextlib.contextmanager
    def stream(self, stream: int):
        """Make ``stream`` current (torch.cuda.stream(s))."""
        previous, self.stream_now = self.stream_now, stream
        try:
            yield
        finally:
            self.stream_now = previous

    def event_type(self) -> None:
        return None  # its streams are numbers: a test makes them wait (`wait_stream`)

    def wait_stream(self, waiter: int, on: int) -> None:
        """Work queued on ``waiter`` from now on runs after what ``on`` has
        queued so far (stream.wait_stream / an event wait: how DDP's reducer
        and FSDP2's reduce-scatter order the current stream)."""
        with self._lock:
            key = (self.device, on)
            self._stream_orders[key] += 1
            marker = _Event(self.device, on, time.perf_counter(), self._stream_orders[key], [])
            self._waits[(self.device, waiter)].append(marker)

    def event(self, device: torch.device, timing: bool = False) -> Any:
        if self._forbidden_in_capture("event record"):
            raise RuntimeError("operation not permitted when stream is capturing")
        index = self._index(device)
        key = (index, self.stream_now)
        with self._lock:
            self._stream_orders[key] += 1
            self._orders[index] += 1
            return _Event(index, self.stream_now, time.perf_counter(), self._stream_orders[key],
                          list(self._waits[key]))

    def enqueue_copy(self, dst: torch.Tensor, values: torch.Tensor) -> None:
        """A non-blocking device-to-host copy on the current stream: it lands
        when the next event recorded on this stream completes."""
        key = (self.device, self.stream_now)
        with self._lock:
            self._copies.append((key, self._stream_orders[key] + 1, dst, values))

    def _completed(self, event: _Event) -> bool:
        key = (event.device, event.stream)
        if self._done[key] >= event.order:
            return True
        lagged = self._stream_orders[key] - event.order >= self.lag
        if not (lagged or time.perf_counter() - event.at >= self.latency_s):
            return False
        if not all(self._completed(before) for before in event.after):
            return False
        self._done[key] = max(self._done[key], event.order)
        landed = [c for c in self._copies if c[0] == key and c[1] <= event.order]
        for copy in landed:
            copy[2].copy_(copy[3])
        self._copies = [c for c in self._copies if not (c[0] == key and c[1] <= event.order)]
        return True

    def ready(self, handle: Any) -> bool:
        if self._forbidden_in_capture("event query"):
            raise RuntimeError("operation not permitted when stream is capturing")
        if handle is None:
            return True
        with self._lock:
            return self._completed(handle)

    def to_host(self, tensor: torch.Tensor) -> Optional[tuple[Any, Any]]:
        if self._forbidden_in_capture("pinned copy"):
            raise RuntimeError("operation not permitted when stream is capturing")
        host = pinned_empty(tensor.shape, tensor.dtype)
        host.copy_(tensor, non_blocking=True)
        return host, self.event(tensor.device)

    def host_values(self, host: Any) -> list[float]:
        return host.tolist()  # a host buffer: garbage unless its event was seen complete

    def elapsed_s(self, start: Any, end: Any) -> Optional[float]:
        if start.device != end.device or start.stream != end.stream:
            return None
        return max(0.0, (end.at - start.at) * self.slowdown + self.extra_s)
