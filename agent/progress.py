"""Progress of one rank: optimizer steps, forward passes, the current phase.

Steps are counted through torch's *global* optimizer hooks, so every optimizer
is seen without touching the training script and gradient accumulation with
``no_sync()`` counts optimizer steps, not micro-batches. Forward passes are
counted by a pre-hook on each DDP module (progress during evaluation too).

Everything here runs on the training thread: plain attribute writes and a
clock read, no device sync, no collective.
"""

from __future__ import annotations

import collections
import math
import time
from typing import Any, Callable, Optional

from rankwatch.wire import CollectiveMark, StepRecord

from .safety import guarded


class Progress:
    def __init__(self, window: int = 512, mark_every: int = 5):
        now = time.time()
        self.step = 0  # optimizer steps completed
        self.forwards = 0
        self.phase = "startup"
        self.phase_since = now
        self.last_progress_at = now
        self.started_at = now
        self.mark_every = max(0, mark_every)
        # Steps and marks not yet sent to the collector, and the recent window kept for bundles.
        self.recent: collections.deque[StepRecord] = collections.deque(maxlen=window)
        self.unsent: collections.deque[StepRecord] = collections.deque(maxlen=window)
        self.marks: collections.deque[CollectiveMark] = collections.deque(maxlen=window)
        self.unsent_marks: collections.deque[CollectiveMark] = collections.deque(maxlen=window)
        self._opt_counts: dict[int, int] = {}
        self._step_started_at = now
        self._first_forward_at: Optional[float] = None
        self._backward_started_at: Optional[float] = None
        self._backward_done_at: Optional[float] = None
        self._forwards_in_step = 0
        self._loss: Any = None
        self._observed_loss: Optional[float] = None
        self.loss_history: collections.deque[float] = collections.deque(maxlen=20)
        self.typical_loss: Optional[float] = None  # median |loss| of recent steps, refreshed every 5
        # Per-step values provided by other parts (gradient checks, memory).
        self.step_extras: list[Callable[[StepRecord], None]] = []
        # pg id -> last enqueued seq, read at marked steps (set by the agent).
        self.read_collective_seqs: Optional[Callable[[], dict[str, int]]] = None
        # Memory-mapped record the supervisor reads if the rank dies silently.
        self.blackbox = None

    def _record(self) -> None:
        box = self.blackbox
        if box is not None:
            box.write(self.step, self.forwards, self.phase, self.last_progress_at)

    # -- phase ---------------------------------------------------------------
    def set_phase(self, phase: str) -> None:
        now = time.time()
        self.phase = phase
        self.phase_since = now
        self.last_progress_at = now
        self._record()

    # -- hooks (training thread) --------------------------------------------
    @guarded("progress.forward")
    def on_forward(self, module, inputs) -> None:
        now = time.time()
        self.forwards += 1
        self._forwards_in_step += 1
        if self._first_forward_at is None:
            self._first_forward_at = now
            if self.step == 0 and not self._opt_counts:
                # The first step starts at its first forward, not at process start
                # (imports, process group and model set-up are not step time).
                self._step_started_at = now
        self.phase = "forward"
        self.phase_since = now
        self.last_progress_at = now
        self._record()

    @guarded("progress.backward")
    def on_backward(self, loss) -> None:
        now = time.time()
        if self._backward_started_at is None:
            self._backward_started_at = now
        # Keep a reference only; it is read once the step is over (no sync here).
        self._loss = loss
        self.phase = "backward"
        self.phase_since = now
        self.last_progress_at = now
        self._record()

    def on_backward_done(self, at: float) -> None:
        """Called when this rank's local backward reached the last gradient
        allreduce: from here on it waits for its peers."""
        self._backward_done_at = at

    def observe_loss(self, value: float) -> None:
        self._observed_loss = value

    @guarded("progress.optimizer")
    def on_optimizer_pre(self, optimizer, args, kwargs) -> None:
        now = time.time()
        self.phase = "optimizer"
        self.phase_since = now
        self.last_progress_at = now
        self._record()

    @guarded("progress.optimizer")
    def on_optimizer_post(self, optimizer, args, kwargs) -> None:
        key = id(optimizer)
        count = self._opt_counts.get(key, 0) + 1
        self._opt_counts[key] = count
        if count <= self.step:
            return  # a second optimizer stepping in the same iteration
        self._end_step(time.time())

    def _end_step(self, now: float) -> None:
        started = self._step_started_at
        first_fwd = self._first_forward_at
        record = StepRecord(
            step=self.step,
            started_at=started,
            ended_at=now,
            forwards=self._forwards_in_step,
        )
        if first_fwd is not None:
            record.data_s = max(0.0, first_fwd - started)
            if self._backward_done_at is not None and self._backward_done_at >= first_fwd:
                record.compute_s = self._backward_done_at - started
        record.loss = self._read_loss()
        if record.loss is not None and math.isfinite(record.loss):
            self.loss_history.append(abs(record.loss))
            if len(self.loss_history) >= 5 and self.step % 5 == 0:
                ordered = sorted(self.loss_history)
                self.typical_loss = ordered[len(ordered) // 2]
        for extra in self.step_extras:
            extra(record)
        self.recent.append(record)
        self.unsent.append(record)
        if self.mark_every and self.read_collective_seqs is not None and self.step % self.mark_every == 0:
            seqs = self.read_collective_seqs()
            if seqs:
                mark = CollectiveMark(step=self.step, seqs=seqs)
                self.marks.append(mark)
                self.unsent_marks.append(mark)
        self.step += 1
        self._step_started_at = now
        self._first_forward_at = None
        self._backward_started_at = None
        self._backward_done_at = None
        self._forwards_in_step = 0
        self._loss = None
        self._observed_loss = None
        self.phase = "data"
        self.phase_since = now
        self.last_progress_at = now
        if self.blackbox is not None:
            self.blackbox.leave_collective()  # a failed call the script caught is over
        self._record()

    def _read_loss(self) -> Optional[float]:
        if self._observed_loss is not None:
            return self._observed_loss
        loss = self._loss
        if loss is None:
            return None
        try:
            if loss.numel() != 1 or loss.device.type != "cpu":
                # On an accelerator, reading the value would sync the device:
                # the gradient checker reads it a step later from a pinned copy.
                return None
            value = float(loss.detach())
        except Exception:
            return None
        return value if math.isfinite(value) else value  # keep NaN/Inf: they are the signal

    # -- heartbeat thread ------------------------------------------------------
    def take_unsent(self) -> tuple[list[StepRecord], list[CollectiveMark]]:
        steps, marks = [], []
        while self.unsent:
            steps.append(self.unsent.popleft())
        while self.unsent_marks:
            marks.append(self.unsent_marks.popleft())
        return steps, marks

    def give_back(self, steps: list[StepRecord], marks: list[CollectiveMark]) -> None:
        """Re-queue what a failed send carried (bounded: the oldest fall off)."""
        for record in reversed(steps):
            if len(self.unsent) < (self.unsent.maxlen or 0):
                self.unsent.appendleft(record)
        for mark in reversed(marks):
            if len(self.unsent_marks) < (self.unsent_marks.maxlen or 0):
                self.unsent_marks.appendleft(mark)
