"""Local-gradient checks on every DDP model, before the allreduce.

A DDP communication hook sees each gradient bucket while it still holds this
rank's *local* gradients (``GradBucket.buffer()``). The hook computes one norm
per bucket on the device (no sync), then runs the user's hook, or DDP's
default allreduce. At the end of the step the norms are read: directly on the
CPU; on CUDA through a non-blocking copy into pinned memory that is read one
step later, when its event has completed. Nothing here syncs the device or
adds a collective.

When a norm is not finite, the parameters whose local gradient is not finite
are named (only then, so the common path stays cheap). Under AMP's GradScaler
an overflow step that the scaler skips is normal and is only counted.

A user hook registered with ``register_comm_hook`` is wrapped, not replaced.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from rankwatch.wire import StepRecord

from .patching import Patches, argument, binding_error
from .safety import guarded, log

if TYPE_CHECKING:
    from .runtime import Agent

MAX_NAMED = 8
PROBE_ELEMENTS = 512  # elements per bucket and step, on steps the full check is sampled out
PROBE_MIN, PROBE_MAX = 16, 8192
PROBE_ROTATIONS = 16

# Module-wide patches (one DDP class, one GradScaler class for every agent).
_PATCHES = Patches()


def fp32_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One L2 norm per tensor, accumulated and returned in float32 whatever
    the tensors' dtype. `_foreach_norm` and `vector_norm` return the input
    dtype: a finite fp16 gradient (every GradScaler-scaled one) can have an
    `inf` fp16 norm (a false non-finite), and a bf16 norm resolves only ~0.4 %
    (a replica perturbed by less is invisible). `_foreach_norm`'s `dtype`
    argument is newer than some supported torch releases: without it, one
    `vector_norm(dtype=float32)` per tensor (the same numbers)."""
    if not tensors:
        return []
    if all(t.dtype in (torch.float32, torch.float64) for t in tensors):
        return list(torch._foreach_norm(tensors))
    try:
        return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    except (TypeError, RuntimeError):
        return [torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]


def unpatch() -> None:
    _PATCHES.undo()
    _CHECKERS.clear()


def _patch_register_comm_hook() -> None:
    """Let users keep calling ``register_comm_hook``: their hook is wrapped."""
    from torch.nn.parallel import DistributedDataParallel

    def make(original):
        @functools.wraps(original)
        def register_comm_hook(*args, **kwargs):
            # Same calls as the original: (ddp, state, hook), by position or name.
            ddp = argument(original, args, kwargs, 0)
            checker = getattr(ddp, "_rankwatch_grad_checker", None)
            if checker is None or checker.registered or binding_error(original, args, kwargs):
                return original(*args, **kwargs)
            return checker.register(original, argument(original, args, kwargs, 1),
                                    argument(original, args, kwargs, 2))

        return register_comm_hook

    _PATCHES.apply(DistributedDataParallel, "register_comm_hook", make)


def _original_register_comm_hook():
    from torch.nn.parallel import DistributedDataParallel

    fn = DistributedDataParallel.register_comm_hook
    return getattr(fn, "__wrapped__", fn) if getattr(fn, "__rankwatch_wrapped__", False) else fn


class _DeferredRead:
    """Device scalars -> host floats without a sync (CUDA: pinned copy + event)."""

    def __init__(self) -> None:
        self.pending: list[tuple[Any, Any, Callable[[list[float]], None]]] = []

    def submit(self, values: list[torch.Tensor], consume: Callable[[list[float]], None]) -> None:
        """``values``: scalars and vectors (a bucket's per-parameter norms),
        read as one flat list of floats in their order."""
        if not values:
            return
        stacked = torch.cat([v.detach().float().reshape(-1) for v in values])
        if stacked.device.type == "cpu":
            consume(stacked.tolist())
            return
        host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
        host.copy_(stacked, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending.append((host, event, consume))

    def poll(self) -> None:
        still = []
        for host, event, consume in self.pending:
            if event.query():
                consume(host.tolist())
            else:
                still.append((host, event, consume))
        self.pending = still[-64:]


class GradChecker:
    def __init__(self, agent: "Agent", ddp) -> None:
        self.agent = agent
        self.ddp = ddp
        self.registered = False
        self.names = {id(p): n for n, p in ddp.module.named_parameters()}
        self.order = {n: i for i, n in enumerate(self.names.values())}
        self._norms: list[torch.Tensor] = []  # this step's local bucket norms (device)
        self._param_norms: list[tuple[list[str], torch.Tensor]] = []  # CUDA only
        self._bucket_params: dict[int, list[str]] = {}
        self._nonfinite_params: list[str] = []
        self._hooks_this_step = 0
        self._last_bucket_step = -1
        self.reader = _DeferredRead()
        self.scaler_in_use = False
        self.skipped_overflow_steps = 0
        self._lock = threading.Lock()
        # Cost control: on a CPU every check is a pass over the gradients. When
        # that exceeds the budget (a fraction of the step time), check every
        # `stride`-th step; the loss is still checked on every step.
        self.budget = agent.config.grad_check_budget
        self.stride = 1
        self._sampled = True
        self._spent = 0.0
        self._norm_buckets: list[int] = []  # bucket index of each entry of _norms
        # Every step: a sparse finiteness probe of each bucket, its size kept
        # within the same budget (halved / doubled as the measured cost asks).
        self.probe_elements = PROBE_ELEMENTS
        self._probe_spent = 0.0
        self._probe_round = 0
        self._probe_layout: dict[int, tuple[tuple[int, int], Any]] = {}  # bucket -> (key, slices)
        ddp._rankwatch_grad_checker = self
        _patch_register_comm_hook()
        ddp.register_forward_pre_hook(self._register_default_before_first_forward)
        agent.progress.step_extras.append(self._on_step_end)

    # -- registration -------------------------------------------------------------
    def _register_default_before_first_forward(self, module, inputs) -> None:
        if self.registered:
            return
        try:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            self.register(_original_register_comm_hook(), None, allreduce_hook)
        except Exception as exc:  # a built-in C++ hook is already there, or DDP refused
            self.registered = True
            log(f"local gradient checks off for this model: {type(exc).__name__}: {exc}")

    def register(self, original_register, state, user_hook):
        self.registered = True
        checker = self

        local = self.agent.collectives._local

        @functools.wraps(user_hook)
        def checked_hook(hook_state, bucket):
            checker._inspect(bucket)
            # The hook's collectives are DDP's gradient reduction: not recorded
            # as Python call sites (that is how a stray user collective stands out).
            outer = getattr(local, "depth", 0)
            local.depth = 1
            try:
                return user_hook(hook_state, bucket)
            finally:
                local.depth = outer

        return original_register(self.ddp, state, checked_hook)

    # -- inside the hook (autograd thread) --------------------------------------
    @guarded("grad_checks.hook")
    def _inspect(self, bucket) -> None:
        index = bucket.index()
        if index == 0:
            step = self.agent.progress.step
            if self._last_bucket_step == step and (self._norms or self._nonfinite_params):
                # A second backward without an optimizer step: the previous one
                # was skipped (GradScaler overflow, or the script's choice).
                self._previous_step_skipped()
            self._last_bucket_step = step
            self._sampled = step % self.stride == 0 or self._loss_is_unusual()
        if bucket.is_last():
            self.agent.progress.on_backward_done(_now())
        if not self._sampled:
            self._probe(bucket, index)
            return
        started = time.perf_counter()
        buffer = bucket.buffer()
        if buffer.device.type == "cpu":
            if buffer.dtype in (torch.float32, torch.float64):
                # BLAS dot: ~4x faster than vector_norm on a CPU (one pass, vectorised).
                norm = torch.dot(buffer, buffer).sqrt()
                if not math.isfinite(float(norm)):
                    norm = torch.linalg.vector_norm(buffer)  # overflow of the square, or a real NaN/Inf
            else:
                norm = torch.linalg.vector_norm(buffer, dtype=torch.float32)  # fp16/bf16: see fp32_norms
        else:
            # On a GPU the values are read a step later, when the local
            # gradients are gone: keep per-parameter norms (one fused kernel)
            # so a non-finite one can still be named.
            per_param = torch.stack(fp32_norms(bucket.gradients()))
            norm = torch.linalg.vector_norm(per_param)
            self._param_norms.append(([self.names.get(id(p), "?") for p in bucket.parameters()], per_param))
        self._norms.append(norm)
        self._norm_buckets.append(index)
        if norm.device.type == "cpu" and not math.isfinite(float(norm)):
            self._name_nonfinite(bucket)
        self._spent += time.perf_counter() - started

    def _probe(self, bucket, index: int) -> None:
        """On a step the budget does not sample: a sparse read of the local
        bucket. Every parameter's gradient gets at least one probed element
        and large ones more (about `probe_elements` per bucket in all, spread
        in proportion to size); each probe moves within its slice every step,
        so a slice is sampled at PROBE_ROTATIONS places over the steps. A NaN from one sample's
        backward poisons whole weight-gradient tensors (or whole rows), so
        this finds it; a lone bad element is found with probability ~ elements
        read / bucket size (bench/grad_check_cost.py measures both). A
        non-finite probe escalates to the full check of that bucket. CPU only:
        on a GPU the full check is asynchronous and rarely sampled out."""
        started = time.perf_counter()
        buffer = bucket.buffer()
        if buffer.device.type != "cpu" or not buffer.is_floating_point() or self.probe_elements <= 0:
            return
        if buffer.numel() == 0:
            return
        slices = self._probe_slices(bucket, index, buffer)
        if slices is None:
            return
        # One of a few precomputed rotations: every tensor op costs several
        # microseconds on the autograd thread, so the probe is one gather and one sum.
        positions = slices[self._probe_round % len(slices)]
        if math.isfinite(float(buffer.take(positions).sum())):
            self._probe_spent += time.perf_counter() - started
            return
        norm = torch.linalg.vector_norm(buffer, dtype=torch.float32)
        if not math.isfinite(float(norm)):  # not a mere overflow of the probe's sum
            self._norms.append(norm)
            self._norm_buckets.append(index)
            self._name_nonfinite(bucket)
        self._probe_spent += time.perf_counter() - started

    def _probe_slices(self, bucket, index: int, buffer: torch.Tensor) -> list[torch.Tensor]:
        """The positions to read, one int64 tensor per rotation; computed once
        per bucket layout and probe size."""
        n = buffer.numel()
        key = (n, self.probe_elements)
        cached = self._probe_layout.get(index)
        if cached is not None and cached[0] == key:
            return cached[1]
        size = buffer.element_size()
        base = buffer.data_ptr()
        starts: list[int] = []
        lengths: list[int] = []
        for grad in bucket.gradients():
            m = grad.numel()
            offset = (grad.data_ptr() - base) // size if m else -1
            if m == 0 or offset < 0 or offset + m > n:
                continue  # not a view of this bucket's buffer
            k = max(1, min(m, round(self.probe_elements * m / n)))
            for j in range(k):
                lo, hi = offset + (j * m) // k, offset + ((j + 1) * m) // k
                if hi > lo:
                    starts.append(lo)
                    lengths.append(hi - lo)
        if not starts:  # gradients not laid out in the buffer: spread over the whole of it
            k = max(1, min(n, self.probe_elements))
            starts = [(j * n) // k for j in range(k)]
            lengths = [max(1, ((j + 1) * n) // k - (j * n) // k) for j in range(k)]
        first = torch.tensor(starts, dtype=torch.int64)
        spans = torch.tensor(lengths, dtype=torch.int64)
        # Rotations: probe j of a slice reads element (r * 7919 + index) mod length
        # of it in round r; the slices are read through over the rounds.
        slices = [first + torch.remainder(torch.full_like(spans, r * 7919 + index), spans)
                  for r in range(PROBE_ROTATIONS)]
        self._probe_layout[index] = (key, slices)
        return slices

    def _loss_is_unusual(self) -> bool:
        """A non-finite loss, or one far above its recent values, forces the
        check on a sampled-out step: a bad batch is still caught and named
        (free on a CPU; a GPU loss is never read here)."""
        loss = self.agent.progress._loss
        try:
            if loss is None or loss.device.type != "cpu" or loss.numel() != 1:
                return False
            value = abs(float(loss.detach()))
        except Exception:
            return False
        if not math.isfinite(value):
            return True
        typical = self.agent.progress.typical_loss
        return typical is not None and value > 10 * typical + 1e-12

    def _name_nonfinite(self, bucket) -> None:
        """Only on the rare bad step: which parameters' local gradients are not finite."""
        bad = []
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            if not bool(torch.isfinite(grad).all()):
                bad.append(self.names.get(id(param), f"<param {tuple(param.shape)}>"))
        with self._lock:
            for name in bad:
                if name not in self._nonfinite_params:
                    self._nonfinite_params.append(name)

    def _previous_step_skipped(self) -> None:
        norms, self._norms = self._norms, []
        self._norm_buckets = []
        named, self._nonfinite_params = self._nonfinite_params, []
        self._param_norms = []
        values = [float(n) for n in norms if n.device.type == "cpu"]
        if not values or not all(math.isfinite(v) for v in values):
            self.skipped_overflow_steps += 1
            self.agent.record_event("overflow_skipped", scaler=self.scaler_in_use, parameters=named[:MAX_NAMED])

    # -- end of step (training thread) ------------------------------------------------
    def _adapt(self, record: StepRecord) -> None:
        spent, self._spent = self._spent, 0.0
        duration = record.ended_at - record.started_at
        if spent <= 0 or duration <= 0 or self.budget <= 0:
            return
        wanted = max(1, math.ceil(spent / (self.budget * duration)))
        # Move slowly: one expensive step (first step, a checkpoint) must not swing it.
        if wanted > self.stride:
            self.stride = min(self.stride * 2, wanted, 64)
        elif wanted < self.stride and record.step % 16 == 0:
            self.stride = max(1, self.stride // 2)

    def _adapt_probe(self, record: StepRecord) -> None:
        spent, self._probe_spent = self._probe_spent, 0.0
        self._probe_round += 1
        duration = record.ended_at - record.started_at
        if spent <= 0 or duration <= 0 or self.budget <= 0:
            return
        share = spent / (self.budget * duration)  # the probe may use half the budget
        if share > 0.5:
            self.probe_elements = max(PROBE_MIN, self.probe_elements // 2)
        elif share < 0.1 and record.step % 16 == 0:
            self.probe_elements = min(PROBE_MAX, self.probe_elements * 2)

    @guarded("grad_checks.step")
    def _on_step_end(self, record: StepRecord) -> None:
        self.reader.poll()
        if self._sampled:
            self._adapt(record)
        else:
            self._adapt_probe(record)
        record.grad_check_stride = self.stride
        buckets, self._norm_buckets = self._norm_buckets, []
        norms, self._norms = self._norms, []
        named, self._nonfinite_params = self._nonfinite_params, []
        named.sort(key=lambda n: self.order.get(n, 1 << 30))  # model order, not bucket order
        if not norms:
            return
        if norms[0].device.type == "cpu":
            values = [float(n) for n in norms]
            self._fill(record, values, named, buckets, sampled=self._sampled)
            return
        # CUDA: the record goes out now; the values follow as an event a step later.
        step = record.step
        param_norms, self._param_norms = self._param_norms, []
        names = [n for group, _ in param_norms for n in group]
        loss = self.agent.progress._loss
        tensors = list(norms) + [t for _, t in param_norms]
        sizes = [len(norms)] + [len(group) for group, _ in param_norms]
        if loss is not None and getattr(loss, "numel", lambda: 0)() == 1:
            tensors.append(loss.detach().reshape(()))

        def consume(values: list[float], step=step) -> None:
            bucket_values = values[: sizes[0]]
            flat = []
            at = sizes[0]
            for size in sizes[1:]:
                flat.extend(values[at: at + size])
                at += size
            loss_value = values[at] if len(values) > at else None
            bad = [i for i, v in enumerate(bucket_values) if not math.isfinite(v)]
            total = math.sqrt(sum(v * v for v in bucket_values)) if not bad else math.nan
            self.agent.record_event("step_values", step=step, grad_norm=total, loss=loss_value)
            if bad or (loss_value is not None and not math.isfinite(loss_value)):
                named_bad = [n for n, v in zip(names, flat) if not math.isfinite(v)]
                self.agent.record_event("nonfinite", step=step, source="local_gradients" if bad else "loss",
                                        parameters=named_bad[:MAX_NAMED], buckets=bad, loss=loss_value,
                                        scaler=self.scaler_in_use)

        self.reader.submit(tensors, consume)

    def _fill(self, record: StepRecord, values: list[float], named: list[str], buckets: list[int],
              sampled: bool = True) -> None:
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        # A probe's escalation measures only the bad bucket: no norm for the step then.
        record.grad_norm = (math.sqrt(sum(v * v for v in values)) if sampled else None) if not bad else math.nan
        record.nonfinite_grads = len(bad)
        if bad or (record.loss is not None and not math.isfinite(record.loss)):
            self.agent.record_event(
                "nonfinite",
                source="local_gradients" if bad else "loss",
                parameters=named[:MAX_NAMED],
                buckets=[buckets[i] if i < len(buckets) else i for i in bad],
                found_by="full_check" if sampled else "probe",
                loss=record.loss,
                scaler=self.scaler_in_use,
            )

    def on_command(self, command) -> None:
        if command.details.get("action") == "detect_anomaly":
            torch.autograd.set_detect_anomaly(True)
            self.agent.record_event("anomaly_mode", enabled=True, reason=command.reason)
            log("autograd anomaly detection turned on for this rank (requested by the collector)")


def _now() -> float:
    import time

    return time.time()


_CHECKERS: list[GradChecker] = []


def _patch_grad_scaler() -> None:
    """Under GradScaler, an overflow step it skips is normal: know it is there."""
    try:
        from torch.amp.grad_scaler import GradScaler
    except ImportError:
        return

    def make(original):
        @functools.wraps(original)
        def scale(*args, **kwargs):
            for checker in _CHECKERS:
                checker.scaler_in_use = True
            result = original(*args, **kwargs)
            if _CHECKERS and isinstance(result, torch.Tensor):
                unscaled = argument(original, args, kwargs, 1)
                if isinstance(unscaled, torch.Tensor):
                    _CHECKERS[-1].agent.progress.note_scaled(result, unscaled)
            return result

        return scale

    _PATCHES.apply(GradScaler, "scale", make)


def attach(agent: "Agent", ddp) -> Optional[GradChecker]:
    if not agent.config.grad_checks:
        return None
    checker = GradChecker(agent, ddp)
    _CHECKERS.append(checker)
    _patch_grad_scaler()
    return checker
