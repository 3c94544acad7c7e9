"""Broken gradient flow: parameters that never receive a gradient (the cause
of DDP's "Expected to have finished reduction in the prior iteration" error,
which names no parameter) and parameters whose gradient is always exactly
zero, named by their module path.

Per-parameter hooks are costly, so they run only for the first few optimizer
steps; the always-zero check rides on the fingerprint steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from rankwatch.config import Config
from rankwatch.wire import StepRecord

from ..core.safety import guarded

if TYPE_CHECKING:
    from ..core.ports import Emit, StepProgress

WATCH_STEPS = 3
ZERO_SAMPLES = 3
MAX_NAMES = 32


class GradientFlow:
    def __init__(self, ddp, *, config: Config, emit: "Emit", progress: "StepProgress") -> None:
        self.emit = emit
        self.progress = progress
        self.params = [(n, p) for n, p in ddp.module.named_parameters() if p.requires_grad]
        self.seen: set[str] = set()
        self.handles = []
        for name, param in self.params:
            if hasattr(param, "register_post_accumulate_grad_hook"):
                self.handles.append(param.register_post_accumulate_grad_hook(self._marker(name)))
        self.zero_counts: dict[str, int] = {}
        self.samples = 0
        self.reported_zero = False
        self.reader = progress.reads  # deferred device reads (agent/core/device.py)
        self.every = max(1, config.fingerprint_every or 10)
        progress.step_extras.append(self._on_step_end)

    def retire(self) -> None:
        """Its model was freed (agent/core/weakrefs.py): unhook, let go of its tensors."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.params = []
        self.progress.remove_extras(self)

    def _marker(self, name: str):
        seen = self.seen

        def mark(param) -> None:
            seen.add(name)

        return mark

    def never_received(self) -> list[str]:
        return [n for n, _ in self.params if n not in self.seen][:MAX_NAMES]

    @guarded("gradient_flow")
    def _on_step_end(self, record: StepRecord) -> None:
        if self.handles and record.step + 1 >= WATCH_STEPS:
            for handle in self.handles:
                handle.remove()
            self.handles = []
            missing = self.never_received()
            if missing:
                self.emit("unused_parameters", parameters=missing,
                          hint="these parameters received no gradient in the first steps "
                               "(unused in forward, or detached); DDP needs "
                               "find_unused_parameters=True for them")
        if self.reported_zero or (record.step + 1) % self.every:
            return
        names = [n for n, p in self.params if p.grad is not None]
        grads = [p.grad for _, p in self.params if p.grad is not None]
        if not grads:
            return
        with torch.no_grad():
            norms = torch._foreach_norm(grads)
        self.reader.submit(list(norms), lambda values, names=names: self._count_zero(names, values))

    def _count_zero(self, names: list[str], values: Optional[list[float]]) -> None:
        if values is None:  # not readable (a graph capture, a stalled device)
            return
        self.samples += 1
        for name, value in zip(names, values):
            if value == 0.0:
                self.zero_counts[name] = self.zero_counts.get(name, 0) + 1
        if self.samples >= ZERO_SAMPLES and not self.reported_zero:
            always = [n for n, c in self.zero_counts.items() if c >= self.samples][:MAX_NAMES]
            self.reported_zero = True
            if always:
                self.emit("zero_gradients", parameters=always, samples=self.samples)


def attach(ddp, *, config: Config, emit: "Emit", progress: "StepProgress") -> Optional[GradientFlow]:
    return GradientFlow(ddp, config=config, emit=emit, progress=progress)
