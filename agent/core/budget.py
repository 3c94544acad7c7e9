"""The sampling stride of a per-step cost kept within a share of the step."""

from __future__ import annotations

import math


def next_stride(stride: int, spent: float, budget: float, duration: float, step: int, most: int) -> int:
    """The stride (work every ``stride``-th step) after a step on which the
    work took ``spent`` seconds of a ``duration``-second step, against
    ``budget``, the share of step time it may use. Powers of two only,
    checked where ``step % stride == 0``: each rank picks its own stride,
    and with these every step a coarser rank samples is one its finer
    peers sample too, so the collector has peers to compare with (strides
    of 3 and 5 shared one step in 15). It moves slowly, one doubling a step
    and one halving every 16 steps, so one expensive step (the first, a
    checkpoint) does not swing it."""
    if spent <= 0 or duration <= 0 or budget <= 0:
        return stride
    wanted = max(1, math.ceil(spent / (budget * duration)))
    if wanted > stride:
        return min(stride * 2, most)
    if 2 * wanted <= stride and step % 16 == 0:
        return stride // 2
    return stride
