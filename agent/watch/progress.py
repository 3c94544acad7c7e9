"""Progress of one rank: optimizer steps, forward passes, the current phase.

Steps are counted through torch's *global* optimizer hooks, so every optimizer
is seen without touching the training script and gradient accumulation with
``no_sync()`` counts optimizer steps, not micro-batches. Forward passes are
counted by a pre-hook on each DDP module (progress during evaluation too).

Everything here runs on the training thread: plain attribute writes and a
clock read, no device sync, no collective.

Device values of a step (its loss, the gradient checks' norms, the device
time of its forward and backward) are read through the device adapter's
deferred reads (agent/core/device.py): at once on a CPU, a step or more later on
a GPU. A step's record is held back until they are in, then sent with them
(the record's own fields, so the node's relays sample them with the record);
at most HOLD_STEPS records or HOLD_S seconds, after which it goes without.

`compute_s` is the rank's own time up to the moment it reached the last
gradient allreduce: data time on the host, plus the *device* time from the
event recorded at the step's first forward to the one recorded at its last
gradient bucket (a slow GPU shows there; the host only queued the work),
less the compute stream's stalls on peers' collectives inside that window
(FSDP2's all-gathers: agent/watch/stream_waits.py).
"""

from __future__ import annotations

import collections
import math
import threading
import time
import weakref
from typing import Any, Callable, Optional

import torch

from rankwatch.wire import CollectiveMark, StepRecord

from ..core import device as device_mod
from ..core.safety import guarded
from ..core.torch_state import compiling, in_backward
from ..core.weakrefs import owner_of

HOLD_STEPS = 8  # step records waiting for their device values, at most
HOLD_S = 10.0  # ... and for at most this long (a stalled device: the record goes without)
# Pending device reads of the rank, all parts together (the step's own, the
# update, training-config and fingerprint checks'): four readers' 64 each before
# they shared this one, so a stalled device still costs a fixed amount.
SHARED_READS = 256


class _Held:
    """A step record waiting for device values (``waiting`` reads)."""

    __slots__ = ("record", "waiting", "since")

    def __init__(self, record: StepRecord, since: float) -> None:
        self.record, self.waiting, self.since = record, 0, since


class _LossRead:
    """The deferred read of one loss tensor: ``value`` once ``done``."""

    __slots__ = ("done", "value", "then")

    def __init__(self) -> None:
        self.done = False
        self.value: Optional[float] = None
        self.then: Optional[Callable[[Optional[float]], None]] = None

    def arrive(self, values: Optional[list[float]]) -> None:
        self.done = True
        self.value = values[0] if values else None
        then, self.then = self.then, None
        if then is not None:
            then(self.value)


def _weak(obj: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(obj)
    except TypeError:  # an optimizer-like object without weak references: keep it
        return lambda: obj


def _queue_callback(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


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
        self._loss_read: Optional[_LossRead] = None
        self._observed_loss: Optional[float] = None
        self._scaled: Optional[tuple[Any, Any]] = None
        self._forward_since_backward = False
        self.loss_history: collections.deque[float] = collections.deque(maxlen=20)
        self.typical_loss: Optional[float] = None  # median |loss| of recent steps, refreshed every 5
        # Per-step values provided by other parts (gradient checks, memory).
        self.step_extras: list[Callable[[StepRecord], None]] = []
        # Called with the loss at every backward (silent-error checks: micro-batches, modes).
        self.backward_extras: list[Callable[[Any], None]] = []
        # Told of each record once its device values are in (or given up), before it is sent.
        self.record_complete: list[Callable[[StepRecord], None]] = []
        self.optimizer_steps = 0  # every optimizer's steps (GradScaler: did this step() step?)
        self.compiled_steps = CompiledSteps()
        # pg id -> last enqueued seq, read at marked steps (set by the agent).
        self.read_collective_seqs: Optional[Callable[[], dict[str, int]]] = None
        # Memory-mapped record the supervisor reads if the rank dies silently.
        self.blackbox = None
        # Deferred device reads of this rank (agent/core/device.py), one poller
        # for every part (the checks submit theirs here too), and the step
        # records waiting for theirs.
        self.reads = device_mod.DeferredReads(limit=SHARED_READS)
        self._held: collections.deque[_Held] = collections.deque()
        self._held_lock = threading.Lock()
        self._batch: list[tuple[list[Any], Callable[[Optional[list[float]]], None]]] = []
        # Device time of the step: events at its first forward and its last gradient bucket.
        self._model_devices: dict[int, Any] = {}
        self._start_event: Any = None
        self._end_event: Any = None
        self._event_adapter: Any = None
        self.device: Any = None  # the device of the last model seen in a forward
        # The compute stream's waits inside the step (agent/watch/stream_waits.py; set by the agent).
        self.waits: Any = None

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
    def forward_pre_hook(self, module, inputs) -> None:
        """The DDP module's forward pre-hook. Under ``torch.compile`` of the
        model Dynamo traces it into the user's compiled region: the first
        thing it asks is whether it is tracing, and then it only marks the
        forward (a store Dynamo replays after the compiled code: no graph
        break, no guard on a value, see CompiledSteps). The next eager hook
        counts the forward; nothing of the recording (clocks, events) is ever
        traced."""
        if compiling():
            self.compiled_steps.forward = True
            return None
        self.on_forward(module, inputs)
        return None

    @guarded("progress.forward")
    def on_forward(self, module, inputs) -> None:
        compiled = self.compiled_steps
        if compiled.pending:
            self._compiled_step_seen()
        if compiled.forward:
            self._compiled_forward_seen()
        self._forward_at(time.time(), module)

    def _compiled_forward_seen(self) -> None:
        """A forward ran inside a compiled region (forward_pre_hook): it is
        counted when seen, on the device of the last model seen."""
        self.compiled_steps.forward = False
        self._forward_at(time.time(), None)

    def _forward_at(self, now: float, module: Any) -> None:
        self.forwards += 1
        self._forwards_in_step += 1
        self._forward_since_backward = True
        if self._first_forward_at is None:
            self._first_forward_at = now
            if self.step == 0 and self._lead is None:
                # The first step starts at its first forward, not at process start
                # (imports, process group and model set-up are not step time).
                self._step_started_at = now
            if module is not None:
                self._start_event = self._device_event(module)
            elif self.device is not None:
                self._start_event = self._event_on(self.device)
            if self._start_event is not None and self.waits is not None:
                self.waits.open(self._event_adapter, self.device, self.step)
        self.phase = "forward"
        self.phase_since = now
        self.last_progress_at = now
        self._record()

    @guarded("progress.backward")
    def on_backward(self, loss) -> None:
        if self.compiled_steps.pending:
            self._compiled_step_seen()
        if self.compiled_steps.forward:
            self._compiled_forward_seen()
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
            # A deferred read (no sync): there at once on a CPU, after the step on a GPU.
            self._loss = loss
            self._read_loss_later(loss)
        self._forward_since_backward = False
        self.phase = "backward"
        self.phase_since = now
        self.last_progress_at = now
        self._record()
        self._watch_backward_end(loss)
        for extra in self.backward_extras:
            extra(loss)  # each guarded on its own

    def remove_extras(self, owner: Any) -> None:
        """A part retired (its model was freed, agent/core/weakrefs.py): drop
        its callbacks. Each list is replaced, not changed in place: a
        retirement can come from a cyclic collection in the middle of a loop
        over one, which then goes on over the old list (a retired part's
        callbacks do nothing harmful)."""
        for name in ("step_extras", "backward_extras", "record_complete"):
            kept = [fn for fn in getattr(self, name) if owner_of(fn) is not owner]
            setattr(self, name, kept)

    def note_scaled(self, scaled: Any, unscaled: Any) -> None:
        """GradScaler.scale(loss) returned ``scaled``; its backward is the loss's."""
        try:
            self._scaled = (weakref.ref(scaled), unscaled)
        except TypeError:
            self._scaled = None

    # -- the end of the local backward, on its own (issue 25, finding 6) -----------------
    def _watch_backward_end(self, loss: Any) -> None:
        """Mark the end of this backward's local work without depending on
        any checker (with grad_checks off, FSDP1, DeepSpeed, the Python
        reducer, or a gradient hook that failed, `compute_s` used to be
        missing and the straggler check blind). A one-shot pre-hook on the
        loss's grad_fn (the first node the engine runs) queues an autograd
        callback: callbacks run in the order queued, so it runs before
        DDP's finalize (queued at the last bucket, which waits for the
        allreduce) and FSDP2's root callback (queued in its pre-backward,
        later than this hook). A backward inside a backward (reentrant) is
        left to the outer one; a backward that raises never runs it (no
        compute_s for that step, never a wrong one)."""
        if in_backward():
            return
        grad_fn = getattr(loss, "grad_fn", None)
        if grad_fn is None:
            return
        handles: list[Any] = []

        def started(grad_outputs: Any) -> None:
            for handle in handles:
                handle.remove()
            if not compiling():
                _queue_callback(self._backward_ended)
            return None

        handles.append(grad_fn.register_prehook(started))

    @guarded("progress.backward")
    def _backward_ended(self) -> None:
        self._backward_done_at = time.time()
        if self._start_event is not None and self.device is not None:
            self._end_event = self._event_on(self.device)
        if self.waits is not None:
            self.waits.close()

    def on_backward_done(self, at: float, tensor: Any = None) -> None:
        """Called when this rank's local backward reached the last gradient
        allreduce: from here on it waits for its peers. ``tensor`` (the last
        bucket's gradients) says on which device to mark the moment."""
        self._backward_done_at = at
        if tensor is not None and self._start_event is not None:
            self._end_event = self._event_on(device_mod.device_of(tensor))
        if self.waits is not None:
            self.waits.close()

    def _device_event(self, module: Any) -> Any:
        """A timing event on the current stream of the module's device (the
        device its parameters are on, not the current device)."""
        key = id(module)
        device = self._model_devices.get(key)
        if device is None:
            if len(self._model_devices) > 64:
                self._model_devices.clear()
            device = self._model_devices[key] = device_mod.model_device(module.parameters()) or "none"
        if device == "none":
            return None
        self.device = device
        return self._event_on(device)

    def _event_on(self, device: Any) -> Any:
        adapter = device_mod.for_device(device)
        if adapter.capturing(device):
            return None  # inside a graph capture nothing is recorded
        self._event_adapter = adapter
        return adapter.event(device, timing=True)

    def lead_optimizer(self) -> Any:
        """The optimizer whose step ends a training step (None before the first step, or once it is gone)."""
        return self._lead() if self._lead is not None else None

    def current_loss(self) -> Optional[float]:
        """This step's loss if its deferred read is already in (at once on a
        CPU; on a GPU usually only after the step), else None."""
        read = self._loss_read
        return read.value if read is not None and read.done else None

    def _read_loss_later(self, loss: Any) -> None:
        try:
            if loss.numel() != 1:
                return
        except Exception:
            return
        read = _LossRead()
        self._loss_read = read
        self.reads.submit([loss.detach()], read.arrive)

    def observe_loss_tensor(self, loss: Any) -> None:
        """rw.observe(loss=tensor): the step's loss, read without a sync."""
        self._observed_loss = None
        self._loss = loss
        self._read_loss_later(loss)

    def defer(self, tensors: list[Any], consume: Callable[[Optional[list[float]]], None]) -> None:
        """From a step-end extra: read ``tensors`` (scalars and vectors, as
        one flat list) with this step's other device values; ``consume``
        gets the floats (None if they could not be read), after which the
        step's record goes out."""
        self._batch.append((tensors, consume))

    def observe_loss(self, value: float) -> None:
        self._observed_loss = value

    @guarded("progress.optimizer")
    def on_optimizer_pre(self, optimizer, args, kwargs) -> None:
        if self.compiled_steps.forward:
            self._compiled_forward_seen()
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
        self.optimizer_steps += 1
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

    def shadow_step(self) -> None:
        """An iteration this rank took part in only by shadowing its peers'
        collectives (DDP Join, its inputs used up: agent/watch/join.py): a step of
        the job with no forward, so step N stays the same iteration on every
        rank. The parts' per-step work (``step_extras``: gradient, update,
        configuration and weight checks) is left out: nothing was trained,
        and this rank's weights are a step behind its peers' until Join ends
        (`_sync_final_model`)."""
        self._end_step(time.time(), shadow=True)

    def _compiled_step_seen(self) -> None:
        """An optimizer step ran inside a torch.compile'd region (see
        CompiledSteps): it ends the step now."""
        self.compiled_steps.pending = False
        self.optimizer_steps += 1
        self._end_step(time.time())

    def _end_step(self, now: float, shadow: bool = False) -> None:
        if device_mod.capturing(self.device):
            self._end_step_in_capture(now)
            return
        self.reads.poll()  # earlier steps' device values that are in by now
        started = self._step_started_at
        first_fwd = self._first_forward_at
        record = StepRecord(
            step=self.step,
            started_at=started,
            ended_at=now,
            forwards=self._forwards_in_step,
        )
        held = _Held(record, now)
        held.waiting = 1  # this function's own share, released at its end
        stalls, untimed = self.waits.take(now - started, self.step) if self.waits is not None else ([], 0)
        wait_in_compute = 0.0
        if first_fwd is not None:
            record.data_s = max(0.0, first_fwd - started - self._wait_before_forward)
            if self._backward_done_at is not None and self._backward_done_at >= first_fwd:
                wait_in_compute = max(0.0, self._wait_before_backward_done - self._wait_before_forward)
                start, end = self._start_event, self._end_event
                if start is not None and end is not None:
                    if not untimed:  # else its span holds stalls behind peers that were not timed: no compute_s
                        # Where the device's own waits were timed they are the waits: a host
                        # blocked in a (gloo) collective meanwhile may have left a device
                        # that runs behind it busy, and taking its time off too counted twice.
                        # (A host wait that left the device idle then counts as compute: a
                        # CPU collective inside a GPU step's forward/backward is rare.)
                        host_waits = 0.0 if stalls else wait_in_compute
                        self._read_device_time(record, held, [(start, end)] + stalls, host_waits)
                else:  # no device events (a capture): host time
                    record.compute_s = max(0.0, self._backward_done_at - started - self._wait_before_backward_done)
        self._take_loss(record, held)
        if not shadow:
            for extra in self.step_extras:
                extra(record)
        batch, self._batch = self._batch, []
        if batch:
            held.waiting += 1
            tensors = [t for part, _ in batch for t in part]
            done = lambda values, held=held, batch=batch: self._dispatch(held, batch, values)  # noqa: E731
            if tensors:
                self.reads.submit(tensors, done)
            else:
                done([])
        self.reads.flush()  # the step's staged device reads, as one copy to the host
        self.recent.append(record)
        with self._held_lock:
            self._held.append(held)
        self._filled(held)
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
        self._start_event = self._end_event = None
        self._wait_before_forward = self._wait_before_backward_done = 0.0
        self._training_thread = threading.get_ident()  # the thread that steps the optimizer
        self._forwards_in_step = 0
        self._loss = None
        self._loss_read = None
        self._observed_loss = None
        self._scaled = None
        self.phase = "data"
        self.phase_since = now
        self.last_progress_at = now
        if self.blackbox is not None:
            self.blackbox.leave_collective()  # a failed call the script caught is over
        self._record()

    def _end_step_in_capture(self, now: float) -> None:
        """The step ends while a CUDA graph is being captured (a whole-step
        graph): nothing may record, query or copy now, so the record goes
        with host times only and the step's extras are skipped. (A replayed
        graph runs no Python: its steps are not seen at all.)"""
        record = StepRecord(step=self.step, started_at=self._step_started_at, ended_at=now,
                            forwards=self._forwards_in_step)
        self._batch = []
        self.recent.append(record)
        with self._held_lock:
            held = _Held(record, now)
            self._held.append(held)
            released = self._release()
        self._complete(released)
        self.step += 1
        self._step_started_at = now
        self._first_forward_at = self._backward_started_at = self._backward_done_at = None
        self._start_event = self._end_event = None
        if self.waits is not None:
            self.waits.take(0.0, self.step)  # a window opened before the capture: nothing to time
        self._wait_before_forward = self._wait_before_backward_done = 0.0
        self._forwards_in_step = 0
        self._loss = self._loss_read = self._observed_loss = self._scaled = None
        self.phase, self.phase_since, self.last_progress_at = "data", now, now
        self._record()

    def _take_loss(self, record: StepRecord, held: _Held) -> None:
        """The step's loss: the observed float, or the deferred read of the
        loss tensor (there now on a CPU; filled in when it comes on a GPU)."""
        if self._observed_loss is not None:
            self._note_loss(record, self._observed_loss)
            return
        read = self._loss_read
        if read is None:
            return
        if read.done:
            self._note_loss(record, read.value)
            return
        held.waiting += 1

        def arrived(value: Optional[float], record=record, held=held) -> None:
            self._note_loss(record, value)
            self._filled(held)

        read.then = arrived

    def _note_loss(self, record: StepRecord, value: Optional[float]) -> None:
        if value is None or record.loss is not None:
            return
        record.loss = value  # NaN/Inf kept: they are the signal
        if math.isfinite(value):
            self.loss_history.append(abs(value))
            if len(self.loss_history) >= 5 and record.step % 5 == 0:
                ordered = sorted(self.loss_history)
                self.typical_loss = ordered[len(ordered) // 2]

    def _read_device_time(self, record: StepRecord, held: _Held, spans: list[tuple[Any, Any]],
                          waited: float) -> None:
        """compute_s = data time + the window's device time (its first span)
        less the compute stream's stalls behind peers (the others:
        agent/watch/stream_waits.py) and the host's waits inside Python
        collectives."""
        data_s = record.data_s
        held.waiting += 1

        def device_time(seconds: Optional[list[Optional[float]]]) -> None:
            if seconds is not None and None not in seconds:
                record.compute_s = max(0.0, data_s + seconds[0] - sum(seconds[1:]) - waited)
            self._filled(held)

        self.reads.submit_spans(self._event_adapter, spans, device_time)

    def _dispatch(self, held: _Held, batch: list, values: Optional[list[float]]) -> None:
        at = 0
        for tensors, consume in batch:
            if values is None:
                part = None
            else:
                size = sum(int(t.numel()) for t in tensors)
                part, at = values[at: at + size], at + size
            try:
                consume(part)
            except Exception as exc:  # one consumer's failure never holds the record
                from ..core.safety import log_once

                log_once(f"deferred.{getattr(consume, '__qualname__', 'consume')}",
                         f"a deferred read consumer failed: {type(exc).__name__}: {exc}")
        self._filled(held)

    def _filled(self, held: _Held) -> None:
        """One of a held record's reads is in: send every record at the head
        of the queue that has all of its values (in step order)."""
        with self._held_lock:
            held.waiting -= 1
            released = self._release(force=len(self._held) > HOLD_STEPS)
        self._complete(released)

    def _release(self, force: bool = False, older_than: Optional[float] = None) -> list[StepRecord]:
        released = []
        while self._held:
            head = self._held[0]
            if head.waiting > 0 and not force and (older_than is None or head.since > older_than):
                break
            self._held.popleft()
            released.append(head.record)
            force = len(self._held) > HOLD_STEPS
        return released

    def _complete(self, records: list[StepRecord]) -> None:
        for record in records:
            for hook in self.record_complete:
                hook(record)
            self.unsent.append(record)

    def release_stale(self, now: float) -> None:
        """Heartbeat thread: records held longer than HOLD_S go without their
        values (a stalled device; this thread never touches the device)."""
        with self._held_lock:
            released = self._release(older_than=now - HOLD_S)
        self._complete(released)

    def finish(self, grace_s: float = 1.0) -> None:
        """At exit (the training is over): the last steps' device values get
        ``grace_s`` to come in (a GPU's queue drains in milliseconds); what
        has not come by then is not waited for."""
        if self.compiled_steps.forward:
            self._compiled_forward_seen()
        if self.compiled_steps.pending:
            self._compiled_step_seen()
        deadline = time.monotonic() + grace_s
        try:
            self.reads.flush()
            while self.reads.pending and time.monotonic() < deadline:
                self.reads.poll()
                if self.reads.pending:
                    time.sleep(0.01)
        except Exception:
            pass
        self.reads.give_up()
        with self._held_lock:
            released = self._release(older_than=float("inf"))
        self._complete(released)

    # -- heartbeat thread ------------------------------------------------------
    def take_unsent(self, limit: int = 0) -> tuple[list[StepRecord], list[CollectiveMark], int]:
        """What the next heartbeat carries: (steps, marks, records left out).

        With ``limit``, at most about that many step records (and marks) go in
        one beat: at high step rates every 2^k-th step is kept (and always the
        newest). Powers of two make the choice the same on every rank (a
        coarser choice is a subset of a finer one), so the collector still
        compares ranks at the same steps.
        """
        self.release_stale(time.time())
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


# -- torch.compile -------------------------------------------------------------------


class CompiledSteps:
    """Optimizer steps that ran inside a ``torch.compile``'d region. Dynamo
    traces the optimizer hooks there; the post-hook then only sets
    ``pending`` (a store Dynamo replays after the compiled code, with no
    guard on the value and no graph break, so ``fullgraph=True`` keeps
    working), and the next forward or backward ends the step eagerly. Such a
    step's end is dated when it is seen (before the next step's data time,
    which then counts as the finished step's)."""

    pending = False
    forward = False  # a forward of a watched model ran in a compiled region (Progress.forward_pre_hook)




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
