"""Device time the compute stream spends waiting on peers, taken out of a
step's own time (issue 25, finding 5).

On a GPU a collective returns to the host at once; the wait is on the
device. FSDP2 makes the compute stream wait on every layer's all-gather (in
the forward and again in the backward) and, from torch 2.13, on an older
reduce-scatter in each post-backward: ``device_handle.current_stream()
.wait_event(event)``. The device span from a step's first forward to the
end of its backward therefore holds the fast ranks' stalls behind a slow
one, and every rank's ``compute_s`` came out equal: no straggler could be
named on a GPU. (DDP's waits on its allreduce come after the backward's end
event, in its finalize; on a CPU a wait blocks the host inside the
collective's call, which the collective tracker already takes out.)

This wraps the device module's ``Event.wait`` (torch.cuda.Event, Python),
which every wait of a stream on an event goes through: ``Stream.wait_event``
(``event.wait(self)``), ``wait_stream``, and what torch.compile makes of
them (``torch.ops.streams.wait_event``). Inside a step's compute window
(its first forward's event to its last backward's end event: with gradient
accumulation, every micro-batch's waits), a wait *of the stream that
window's events are on* gets a timing event before and after it on that
stream; their spans are the stalls, and progress subtracts their sum from
the window's device time. Waits of other streams (FSDP's all-gather stream
waiting on its copy-in) stall no compute and are left alone. It is not
FSDP-specific: DeepSpeed's and a script's own waits of the compute stream
inside the window count the same way.

Cost: two event records per wait, about three waits per FSDP layer and
micro-batch. They are taken on sampled steps only (``step % stride ==
0``; the stride is a power of two, adapted to the budget as the gradient
checks' is, so a coarser rank's timed steps are also its peers'). A step
whose waits were not all timed reports no ``compute_s`` (its span holds
stalls); the straggler check counts only steps every rank timed.

Not seen, so their stalls stay in ``compute_s``: waits through torch.Event
or torch.Stream (C++ types: FSDP2's ``finalize_backward`` uses
``torch.accelerator.current_stream()``, after the backward's end event
anyway), and the device-side waits of NCCL work (``Work.wait()`` of an
async collective, such as an explicit ``unshard(async_op=True)``; a
functional collective's ``wait_tensor``; tensor-parallel collectives in
the forward). Tested on CPU through the GPU-like double, whose streams
stall on a modelled slower peer and which FSDP2's own code uses in those
tests (``GpuLikeDouble.serve_streams``). On a GPU it ran on one H200
(torch 2.11.0+cu130, 2026-11-27; bench/gpu_stream_stall.py): a 20-ms
side-stream stall per step left ``compute_s`` at 2.97 ms against 2.94 ms
without it (device step 19.1 against 3.6 ms), while 20 ms of the stream's
own work raised it to 21.1 ms; no sync added. NEVER RAN ACROSS GPUs:
FSDP2's own waits behind a slower peer (two or more GPUs) were not seen.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Optional

from ..core.budget import next_stride
from ..core.patching import Patches
from ..core.torch_state import compiling

MAX_STRIDE = 64  # the waits are timed at least every 64th step
# Waits timed per step, at most (8 micro-batches of a 128-layer FSDP2 model
# make ~3,000); more: the step goes without compute_s.
MAX_WAITS = 4096
BUDGET_SHARE = 0.5  # of the gradient-check budget (the share of step time rankwatch may use)


class StreamWaits:
    """The compute-stream waits of the current step's compute window."""

    def __init__(self, *, patches: Patches, budget: float) -> None:
        self.patches = patches
        self.budget = budget * BUDGET_SHARE
        self.stride = 1
        self._patched: set[type] = set()
        self._adapter: Any = None
        self._device: Any = None
        self._stream: Any = None  # the window's stream while the window is open
        self._timing = False
        self.spans: list[tuple[Any, Any]] = []  # (before, after) events of each timed wait
        self.untimed = 0  # waits of the window's stream that were not timed
        self._upto: Optional[tuple[int, int]] = None  # (spans, untimed) at the last backward's end
        self._spent = 0.0  # host seconds of this part on the current step

    def open(self, adapter: Any, device: Any, step: int) -> None:
        """The step's first forward recorded its start event on ``device``.
        Never raises (it runs inside the forward's hook): a failure leaves
        the window closed and the step untimed."""
        self.spans, self.untimed, self._upto = [], 0, None
        self._stream = None
        try:
            event_type = adapter.event_type()
            if event_type is None:
                return  # no streams (a CPU): nothing waits on the device
            if event_type not in self._patched:
                self._patched.add(event_type)
                self.patches.apply(event_type, "wait", self._wrap)
            self._adapter, self._device = adapter, device
            self._timing = step % self.stride == 0
            self._stream = adapter.current_stream(device)
        except Exception:
            self._stream = None
            self.untimed += 1

    def close(self) -> None:
        """A backward's end event was recorded: the window's span ends here
        unless a later backward of the step (gradient accumulation) moves
        its end again, so the waits up to here are the span's; the window
        stays open for the next micro-batch's."""
        if self._stream is not None or self.untimed:
            self._upto = (len(self.spans), self.untimed)

    def take(self, step_duration: float, step: int) -> tuple[list[tuple[Any, Any]], int]:
        """The ended step's timed waits up to its last backward's end and the
        count of untimed ones; the stride adapts to what the timing cost."""
        timed, untimed = self._upto if self._upto is not None else (0, 0)
        spans = self.spans[:timed]
        self.spans, self.untimed, self._upto, self._stream = [], 0, None, None
        spent, self._spent = self._spent, 0.0
        self.stride = next_stride(self.stride, spent, self.budget, step_duration, step, MAX_STRIDE)
        return spans, untimed

    def _wrap(self, original: Callable) -> Callable:
        waits = self

        @functools.wraps(original)
        def wait(*args, **kwargs):  # Event.wait(self, stream=None)
            if compiling() or waits._stream is None:
                return original(*args, **kwargs)
            before = waits._before(args[1] if len(args) > 1 else kwargs.get("stream"))
            result = original(*args, **kwargs)
            if before is not None:
                waits._after(before)
            return result

        return wait

    def _before(self, stream: Any) -> Optional[tuple[Any, Any]]:
        """Called before a wait inside the window (on whatever thread: a GPU
        model's backward runs on autograd's device thread, where the engine
        makes the forward's stream current). Never raises."""
        try:
            started = time.perf_counter()
            mine = self._stream
            if mine is None:
                return None
            if stream is None:  # Event.wait(): the current device's current stream
                stream = self._adapter.current_stream(None)
            if not (stream is mine or stream == mine):
                return None
            if not self._timing or len(self.spans) >= MAX_WAITS or self._adapter.capturing(self._device):
                self.untimed += 1
                return None
            event = self._adapter.stream_event(stream)
            self._spent += time.perf_counter() - started
            return stream, event
        except Exception:
            self.untimed += 1  # not timed: the step goes without compute_s
            return None

    def _after(self, before: tuple[Any, Any]) -> None:
        stream, event = before
        try:
            started = time.perf_counter()
            self.spans.append((event, self._adapter.stream_event(stream)))
            self._spent += time.perf_counter() - started
        except Exception:
            self.untimed += 1  # a wait not timed: the step goes without compute_s
