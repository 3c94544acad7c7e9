"""The few things the agent's parts are given, named once.

agent/runtime.py builds every part (the checks, the trackers, the profiler,
the bundles) and hands each exactly what it uses: an event sink, the
progress tracker, the patch registry, the configuration... never the
`Agent`. These are the shared small interfaces among those; a part can be
built and tested with fakes of them (tests/test_agent_parts_narrow.py).
This module imports nothing at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

if TYPE_CHECKING:  # types only: importing this module costs nothing (no torch)
    from rankwatch.wire import StepRecord

    from .device import DeferredReads


class Emit(Protocol):
    """The event sink (`Agent.record_event`): an event of ``kind`` with its
    details, at ``step`` (this step when None). Redacted and sent by the
    runtime."""

    def __call__(self, kind: str, step: Optional[int] = None, **details: Any) -> Any: ...


# A fingerprint (parameter names and norms at a step) for the collector (`Agent.add_fingerprint`).
AddFingerprint = Callable[[dict[str, Any]], None]


class StepProgress(Protocol):
    """What the parts use of the progress tracker (agent/watch/progress.py `Progress`):
    the step count, the hooks it calls at each step end, backward and
    completed record, and its deferred device reads."""

    step: int
    typical_loss: Optional[float]
    optimizer_steps: int
    reads: DeferredReads
    # Called at each step's end, after `reads` was polled: what earlier steps
    # read from the device and is in by now has reached its consumer.
    step_extras: list[Callable[[StepRecord], None]]
    backward_extras: list[Callable[[Any], None]]
    record_complete: list[Callable[[StepRecord], None]]

    def defer(self, tensors: list[Any], consume: Callable[[Optional[list[float]]], None]) -> None: ...

    def lead_optimizer(self) -> Any: ...

    def current_loss(self) -> Optional[float]: ...

    def note_scaled(self, scaled: Any, unscaled: Any) -> None: ...

    def remove_extras(self, owner: Any) -> None: ...

    def on_forward(self, module: Any, inputs: Any) -> None: ...
