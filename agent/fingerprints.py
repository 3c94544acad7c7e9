"""Parameter fingerprints: replicas that must hold identical weights, checked
out of band.

Every N optimizer steps, one fused kernel (``torch._foreach_norm``) gives a
norm per parameter and buffer; the vector goes to the collector in the next
heartbeat (on CUDA through a pinned, non-blocking copy read a step later).
The collector compares replicas; no collective is added to the training.
A norm changes with any perturbation of a tensor except an exact
permutation or sign flip of its elements, which no real fault produces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from rankwatch.wire import StepRecord

from .grad_checks import _DeferredRead
from .safety import guarded

if TYPE_CHECKING:
    from .runtime import Agent

MAX_TENSORS = 8192


class Fingerprinter:
    def __init__(self, agent: "Agent", ddp, every: int) -> None:
        self.agent = agent
        self.every = every
        named = [(f"param:{n}", p) for n, p in ddp.module.named_parameters()]
        named += [(f"buffer:{n}", b) for n, b in ddp.module.named_buffers()
                  if b.is_floating_point() and b.numel() > 0]
        self.names = [n for n, _ in named][:MAX_TENSORS]
        self.tensors = [t for _, t in named][:MAX_TENSORS]
        self.reader = _DeferredRead()
        agent.progress.step_extras.append(self._on_step_end)

    @guarded("fingerprints")
    def _on_step_end(self, record: StepRecord) -> None:
        self.reader.poll()
        # record.step just completed: fingerprint the weights it produced.
        if (record.step + 1) % self.every:
            return
        with torch.no_grad():
            norms = torch._foreach_norm([t.detach() for t in self.tensors])
        step = record.step
        self.reader.submit(list(norms), lambda values, step=step: self.agent.add_fingerprint(
            {"step": step, "names": self.names, "norms": values}))


def attach(agent: "Agent", ddp) -> Optional[Fingerprinter]:
    every = agent.config.fingerprint_every
    if every <= 0:
        return None
    return Fingerprinter(agent, ddp, every)
