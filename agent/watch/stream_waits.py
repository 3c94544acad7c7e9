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

This wraps the device module's ``Stream.wait_event`` (torch.cuda.Stream:
``event.wait(self)``, Python; ``wait_stream`` goes through it). Inside a
step's compute window (its first forward's event to its backward's end
event), a wait *of the stream that window's events are on* gets a timing
event before and after it on that stream; their spans are the stalls, and
progress subtracts their sum from the window's device time. Waits of other
streams (FSDP's all-gather stream waiting on its copy-in) stall no compute
and are left alone. It is not FSDP-specific: DeepSpeed's and a script's
own waits of the compute stream inside the window count the same way.

Cost: two event records per wait, about three waits per FSDP layer and
step. They are taken on sampled steps only (``step % stride == 0``; the
stride is a power of two, adapted to the budget as the gradient checks'
is, so a coarser rank's timed steps are also its peers'). A step whose
waits were not timed reports no ``compute_s`` (its span holds stalls),
never a wrong one; the straggler check counts only steps every rank timed.

Not seen: waits through ``torch.Stream`` (a C++ type: FSDP2's
``finalize_backward`` uses ``torch.accelerator.current_stream()``, after
the backward's end event anyway) and an async collective's
``Work.wait()`` (an explicit ``unshard(async_op=True)``). NEVER RAN ON A
GPU: tested on CPU through the GPU-like double, whose streams stall on a
modelled late peer and which FSDP2's own code uses in those tests
(``GpuLikeDouble.serve_streams``).
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Callable, Optional

from ..core.patching import Patches
from ..core.torch_state import compiling

MAX_STRIDE = 64  # the waits are timed at least every 64th step
MAX_WAITS = 1024  # timed per step, at most (~340 FSDP layers; more: the step goes without compute_s)
BUDGET_SHARE = 0.5  # of the gradient-check budget (the share of step time rankwatch may use)


class StreamWaits:
    """The compute-stream waits of the current step's compute window."""

    def __init__(self, *, patches: Patches, budget: float) -> None:
        self.patches = patches
        self.budget = budget * BUDGET_SHARE
        self.stride = 1
        self._patched: set[type] = set()
        self._adapter: Any = None
        self._stream: Any = None  # the window's stream while the window is open
        self._timing = False
        self.spans: list[tuple[Any, Any]] = []  # (before, after) events of each timed wait
        self.untimed = 0  # waits of the window's stream that were not timed
        self._spent = 0.0  # host seconds of this part on the current step

    def open(self, adapter: Any, device: Any, step: int) -> None:
        """The step's first forward recorded its start event on ``device``."""
        self.spans, self.untimed = [], 0
        self._stream = None
        stream_type = adapter.stream_type()
        if stream_type is None:
            return  # no streams (a CPU): nothing waits on the device
        if stream_type not in self._patched:
            self._patched.add(stream_type)
            self.patches.apply(stream_type, "wait_event", self._wrap)
        self._adapter = adapter
        self._timing = step % self.stride == 0
        self._stream = adapter.current_stream(device)

    def close(self) -> None:
        """The backward's end event was recorded: later waits (DDP's and
        FSDP's finalize) are not in the window."""
        self._stream = None

    def take(self, step_duration: float, step: int) -> tuple[list[tuple[Any, Any]], int]:
        """The ended step's timed waits and the count of untimed ones; the
        stride adapts to what the timing cost."""
        spans, untimed = self.spans, self.untimed
        self.spans, self.untimed, self._stream = [], 0, None
        spent, self._spent = self._spent, 0.0
        if spent > 0 and step_duration > 0 and self.budget > 0:
            wanted = max(1, math.ceil(spent / (self.budget * step_duration)))
            # As the gradient checks do: powers of two, slowly, so that one
            # costly step does not swing it and peers share their timed steps.
            if wanted > self.stride:
                self.stride = min(self.stride * 2, MAX_STRIDE)
            elif 2 * wanted <= self.stride and step % 16 == 0:
                self.stride //= 2
        return spans, untimed

    def _wrap(self, original: Callable) -> Callable:
        waits = self

        @functools.wraps(original)
        def wait_event(*args, **kwargs):
            if waits._stream is None or compiling():
                return original(*args, **kwargs)
            before = waits._before(args[0] if args else kwargs.get("self"))
            result = original(*args, **kwargs)
            if before is not None:
                waits._after(before)
            return result

        return wait_event

    def _before(self, stream: Any) -> Optional[tuple[Any, Any]]:
        """Called before a wait inside the window (on whatever thread: a GPU
        model's backward runs on autograd's device thread, where the engine
        makes the forward's stream current). Never raises."""
        try:
            started = time.perf_counter()
            mine = self._stream
            if mine is None or not (stream is mine or stream == mine):
                return None
            if not self._timing or len(self.spans) >= MAX_WAITS:
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
