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
import threading
import time
import weakref
from typing import Any, Callable, Optional

from rankwatch.wire import CollectiveMark, StepRecord

from .safety import guarded


def _weak(obj: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(obj)
    except TypeError:  # an optimizer-like object without weak references: keep it
        return lambda: obj


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
        self._lead: Optional[Callable[[], Any]] = None  # weak reference to the lead optimizer
        self._others: set[int] = set()  # other optimizers that stepped since the lead did
        self._step_started_at = now
        self._first_forward_at: Optional[float] = None
        self._backward_started_at: Optional[float] = None
        self._backward_done_at: Optional[float] = None
        # Time the training thread spent inside Python-API collectives this
        # step (waiting for its peers there is not its own data or compute
        # time: a rank that waits for a slow peer in a per-step broadcast
        # before its forward would look slow "in data loading").
        self._training_thread: Optional[int] = None
        self._wait_before_forward = 0.0
        self._wait_before_backward_done = 0.0
        self._forwards_in_step = 0
        self._loss: Any = None
        self._observed_loss: Optional[float] = None
        self._scaled: Optional[tuple[Any, Any]] = None
        self._forward_since_backward = False
        self.loss_history: collections.deque[float] = collections.deque(maxlen=20)
        self.typical_loss: Optional[float] = None  # median |loss| of recent steps, refreshed every 5
        # Per-step values provided by other parts (gradient checks, memory).
        self.step_extras: list[Callable[[StepRecord], None]] = []
        # Called with the loss at every backward (silent-error checks: micro-batches, modes).
        self.backward_extras: list[Callable[[Any], None]] = []
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
        self._forward_since_backward = True
        if self._first_forward_at is None:
            self._first_forward_at = now
            if self.step == 0 and self._lead is None:
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
        scaled = self._scaled
        if scaled is not None and scaled[0]() is loss:
            loss = scaled[1]  # GradScaler: the loss before scaling (the scale is not the model's)
        # The step's loss is the backward that follows a forward of a watched
        # (DDP) model: a backward of some other model in between (a rank-0-only
        # test episode, an auxiliary network) is not the training loss.
        # Without any DDP model every backward counts.
        if self._forward_since_backward or self.forwards == 0 or self._loss is None:
            # Keep a reference only; it is read once the step is over (no sync here).
            self._loss = loss
        self._forward_since_backward = False
        self.phase = "backward"
        self.phase_since = now
        self.last_progress_at = now
        self._record()
        for extra in self.backward_extras:
            extra(loss)  # each guarded on its own

    def note_scaled(self, scaled: Any, unscaled: Any) -> None:
        """GradScaler.scale(loss) returned ``scaled``; its backward is the loss's."""
        try:
            self._scaled = (weakref.ref(scaled), unscaled)
        except TypeError:
            self._scaled = None

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
        # One step per training iteration, whatever the number of optimizers:
        # the step ends when the *lead* optimizer steps (the first one seen).
        # Others stepping in between (a GAN's generator, an actor and a critic,
        # a wrapper and the optimizer it wraps) belong to the same step. An
        # optimizer that steps twice while the lead did not takes the lead: the
        # old one was replaced (a re-created optimizer, a new training phase) or
        # steps less often than it.
        key = id(optimizer)
        lead = self._lead() if self._lead is not None else None
        if lead is None or key == id(lead):
            if lead is None:
                self._lead = _weak(optimizer)
            self._others.clear()
            self._end_step(time.time())
            return
        if key in self._others:
            self._lead = _weak(optimizer)
            self._others.clear()
            self._end_step(time.time())
            return
        self._others.add(key)

    def note_collective_wait(self, started: float, ended: float) -> None:
        """A Python-API collective the training thread was inside, from
        ``started`` to ``ended`` (the collective tracker's call window)."""
        if self._training_thread is None or threading.get_ident() != self._training_thread:
            return
        waited = ended - max(started, self._step_started_at)
        if waited <= 0:
            return
        if self._first_forward_at is None:
            self._wait_before_forward += waited
        if self._backward_done_at is None:
            self._wait_before_backward_done += waited

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
            record.data_s = max(0.0, first_fwd - started - self._wait_before_forward)
            if self._backward_done_at is not None and self._backward_done_at >= first_fwd:
                record.compute_s = max(0.0, self._backward_done_at - started - self._wait_before_backward_done)
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
        self._wait_before_forward = self._wait_before_backward_done = 0.0
        self._training_thread = threading.get_ident()  # the thread that steps the optimizer
        self._forwards_in_step = 0
        self._loss = None
        self._observed_loss = None
        self._scaled = None
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
    def take_unsent(self, limit: int = 0) -> tuple[list[StepRecord], list[CollectiveMark], int]:
        """What the next heartbeat carries: (steps, marks, records left out).

        With ``limit``, at most about that many step records (and marks) go in
        one beat: at high step rates every 2^k-th step is kept (and always the
        newest). Powers of two make the choice the same on every rank (a
        coarser choice is a subset of a finer one), so the collector still
        compares ranks at the same steps.
        """
        steps, marks = [], []
        while self.unsent:
            steps.append(self.unsent.popleft())
        while self.unsent_marks:
            marks.append(self.unsent_marks.popleft())
        skipped = 0
        if limit and len(steps) > limit:
            before = len(steps)
            steps = _thin(steps, lambda r: r.step, limit)
            skipped = before - len(steps)
        if limit and len(marks) > limit:
            every = max(1, self.mark_every)
            marks = _thin(marks, lambda m: m.step // every, limit)
        return steps, marks, skipped

    def give_back(self, steps: list[StepRecord], marks: list[CollectiveMark]) -> None:
        """Re-queue what a failed send carried (bounded: the oldest fall off)."""
        for record in reversed(steps):
            if len(self.unsent) < (self.unsent.maxlen or 0):
                self.unsent.appendleft(record)
        for mark in reversed(marks):
            if len(self.unsent_marks) < (self.unsent_marks.maxlen or 0):
                self.unsent_marks.appendleft(mark)


def _thin(items: list, key: Callable[[Any], int], limit: int) -> list:
    """Items whose key is a multiple of the smallest power of two that keeps
    at most ``limit`` of them, plus the newest."""
    span = max(1, key(items[-1]) - key(items[0]) + 1)
    stride = 1
    while span > limit * stride:
        stride *= 2
    while True:
        kept = [item for item in items if key(item) % stride == 0]
        if len(kept) <= limit:
            break
        stride *= 2
    if not kept or kept[-1] is not items[-1]:
        kept.append(items[-1])
    return kept
