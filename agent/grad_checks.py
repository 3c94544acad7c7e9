"""Local-gradient checks on every DDP model, before the allreduce.

A DDP communication hook sees each gradient bucket while it still holds this
rank's *local* gradients (``GradBucket.buffer()``). On the steps the cost
budget samples, the hook computes one float32 norm per parameter of the
bucket (one fused ``_foreach_norm``); on the others a sparse finiteness probe
(a gather of a few hundred elements, counted per parameter). Then it runs the
user's hook, or DDP's default allreduce. The values are read on the host
through the device adapter's deferred reads (agent/device.py) with the
step's other device values: at the step's end on a CPU, a step or more later
on a GPU, never with a sync, and they travel in the step's record
(``grad_norm``, ``nonfinite_grads``). A non-finite value names its
parameters; the origin rank is the one non-finite *before* the allreduce.

The same code runs on every device: the test double (``GpuLikeDouble``)
makes CPU tests run what CUDA runs. No GPU run of it has been made here.

Under AMP's GradScaler, a step the scaler skips (an overflow) is counted
when ``GradScaler.step`` returns without the optimizer having stepped; a
backward without an optimizer step (gradient accumulation) is not an
overflow. A user hook registered with ``register_comm_hook`` is wrapped, not
replaced; under compiled autograd's Python reducer (which calls hooks per
parameter with a ``(grad, param)`` tuple) the checks step aside.

Cost: measured per bucket against DDP's built-in C++ allreduce in
``bench/grad_check_cost.py`` (see its docstring for the figures).
"""

from __future__ import annotations

import functools
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from rankwatch.wire import StepRecord

from . import device as device_mod
from .device import DeferredReads
from .patching import Patches, argument, binding_error
from .safety import guarded, is_disabled, log

if TYPE_CHECKING:
    from .runtime import Agent

MAX_NAMED = 8
PROBE_ELEMENTS = 512  # elements per bucket and step, on steps the full check is sampled out
PROBE_MIN, PROBE_MAX = 16, 8192
PROBE_ROTATIONS = 16
MAX_BUCKETS_PER_STEP = 4096  # device values kept per step, at most (a runaway never grows memory)

# Module-wide patches (one DDP class, one GradScaler class for every agent).
_PATCHES = Patches()

# The deferred read, now the device adapter's (kept under its old name for importers).
_DeferredRead = DeferredReads


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


def _compiling() -> bool:
    try:
        return bool(torch.compiler.is_compiling())
    except Exception:
        return False


def _is_grad_bucket(bucket: Any) -> bool:
    try:
        return isinstance(bucket, torch.distributed.GradBucket)
    except Exception:
        return hasattr(bucket, "buffer") and hasattr(bucket, "index")


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


def uses_python_reducer(ddp: Any) -> bool:
    """DDP built under ``torch._dynamo.config.optimize_ddp = "python_reducer"``
    (torch >= 2.4): with compiled autograd it calls comm hooks once per
    parameter with a ``(grad, param)`` tuple, and DDP's own default then is
    an in-graph functional allreduce. A hook of ours would replace that."""
    return bool(getattr(ddp, "_use_python_reducer", False))


class GradChecker:
    def __init__(self, agent: "Agent", ddp) -> None:
        self.agent = agent
        self.ddp = ddp
        self.registered = False
        self.names = {id(p): n for n, p in ddp.module.named_parameters()}
        self.order = {n: i for i, n in enumerate(self.names.values())}
        # This backward's device values: (bucket index, parameter names, values, kind)
        # where kind is "norms" (per-parameter float32 norms) or "probe"
        # (per-parameter count of non-finite probed elements). Emptied at
        # every step end and every new step's first bucket; bounded.
        self._buckets: list[tuple[int, tuple[str, ...], torch.Tensor, str]] = []
        self._bucket_names: dict[int, tuple[tuple[int, int], tuple[str, ...]]] = {}
        self._last_bucket_step = -1
        self.scaler_in_use = False
        self.skipped_overflow_steps = 0
        # Cost control: every check costs host time on the autograd thread (and
        # on a CPU a pass over the gradients). When that exceeds the budget (a
        # fraction of the step time), the full check runs every `stride`-th
        # step; the loss is still checked on every step.
        self.budget = agent.config.grad_check_budget
        self.stride = 1
        self._sampled = True
        self._spent = 0.0
        # Every step: a sparse finiteness probe of each bucket, its size kept
        # within the same budget (halved / doubled as the measured cost asks).
        self.probe_elements = PROBE_ELEMENTS
        self._probe_spent = 0.0
        self._probe_round = 0
        self._probe_layout: dict[int, tuple[tuple[int, int], Any]] = {}  # bucket -> (key, (slices, owners, names))
        ddp._rankwatch_grad_checker = self
        _patch_register_comm_hook()
        ddp.register_forward_pre_hook(self._register_default_before_first_forward)
        self._bad: dict[int, tuple[list[int], list[str], str]] = {}  # step -> what was not finite
        agent.progress.step_extras.append(self._on_step_end)
        agent.progress.record_complete.append(guarded("grad_checks.step")(self._on_record_complete))

    # -- registration -------------------------------------------------------------
    def _register_default_before_first_forward(self, module, inputs) -> None:
        if self.registered:
            return
        if uses_python_reducer(self.ddp):
            # DDP's default there is its in-graph allreduce: a hook would replace it.
            self.registered = True
            self.agent.record_event("grad_checks_off", reason="python_reducer")
            log("local gradient checks off for this model: DDP uses the Python reducer "
                "(torch._dynamo.config.optimize_ddp='python_reducer')")
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
            if not _is_grad_bucket(bucket) or _compiling():
                # Compiled autograd's Python reducer: (grad, param) per parameter.
                return user_hook(hook_state, bucket)
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
            if self._last_bucket_step != step or self._buckets:
                # A new step, or a second backward without an optimizer step
                # (accumulation, or a step GradScaler skipped): what the last
                # one left is superseded, never read.
                self._buckets = []
            self._last_bucket_step = step
            self._sampled = step % self.stride == 0 or self._loss_is_unusual()
        buffer = bucket.buffer()
        if bucket.is_last():
            self.agent.progress.on_backward_done(time.time(), buffer)
        if is_disabled("grad_checks.step") or len(self._buckets) >= MAX_BUCKETS_PER_STEP:
            return  # nothing would read them
        if device_mod.capturing(device_mod.device_of(buffer)):
            return  # a CUDA graph capture: nothing may run here
        if not self._sampled:
            self._probe(bucket, index, buffer)
            return
        started = time.perf_counter()
        grads = bucket.gradients()
        if grads:
            # One fused kernel; read a step later on a GPU, when the local
            # gradients are gone: per-parameter values so a non-finite one is named.
            self._buckets.append((index, self._names(bucket, index, buffer), torch.stack(fp32_norms(grads)), "norms"))
        self._spent += time.perf_counter() - started

    def _names(self, bucket, index: int, buffer: torch.Tensor) -> tuple[str, ...]:
        """The bucket's parameter names, cached per layout (DDP rebuilds its
        buckets after the first step: the buffer changes then)."""
        key = (buffer.numel(), buffer.data_ptr())
        cached = self._bucket_names.get(index)
        if cached is not None and cached[0] == key:
            return cached[1]
        names = tuple(self.names.get(id(p), f"<param {tuple(p.shape)}>") for p in bucket.parameters())
        self._bucket_names[index] = (key, names)
        return names

    def _probe(self, bucket, index: int, buffer: torch.Tensor) -> None:
        """On a step the budget does not sample: a sparse read of the local
        bucket. Every parameter's gradient gets at least one probed element
        and large ones more (about `probe_elements` per bucket in all, spread
        in proportion to size); each probe moves within its slice every step,
        so a slice is sampled at PROBE_ROTATIONS places over the steps. A NaN
        from one sample's backward poisons whole weight-gradient tensors (or
        whole rows), so this finds it; a lone bad element is found with
        probability ~ elements read / bucket size (bench/grad_check_cost.py
        measures both). The non-finite probed elements are counted per
        parameter (one gather, one index_add): a count read later names the
        parameter."""
        started = time.perf_counter()
        if not buffer.is_floating_point() or self.probe_elements <= 0 or buffer.numel() == 0:
            return
        layout = self._probe_slices(bucket, index, buffer)
        if layout is None:
            return
        slices, owners, names = layout
        positions = slices[self._probe_round % len(slices)]
        bad = torch.isfinite(buffer.take(positions)).logical_not_().to(torch.float32)
        counts = torch.zeros(len(names), dtype=torch.float32, device=buffer.device).index_add_(0, owners, bad)
        self._buckets.append((index, names, counts, "probe"))
        self._probe_spent += time.perf_counter() - started

    def _probe_slices(self, bucket, index: int, buffer: torch.Tensor):
        """(positions per rotation, owner of each position, owner names),
        computed once per bucket layout and probe size."""
        n = buffer.numel()
        key = (n, self.probe_elements, buffer.data_ptr())
        cached = self._probe_layout.get(index)
        if cached is not None and cached[0] == key:
            return cached[1]
        size = buffer.element_size()
        base = buffer.data_ptr()
        starts: list[int] = []
        lengths: list[int] = []
        owner_of: list[int] = []
        names: list[str] = []
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            m = grad.numel()
            offset = (grad.data_ptr() - base) // size if m else -1
            if m == 0 or offset < 0 or offset + m > n:
                continue  # not a view of this bucket's buffer
            owner = len(names)
            names.append(self.names.get(id(param), f"<param {tuple(param.shape)}>"))
            k = max(1, min(m, round(self.probe_elements * m / n)))
            for j in range(k):
                lo, hi = offset + (j * m) // k, offset + ((j + 1) * m) // k
                if hi > lo:
                    starts.append(lo)
                    lengths.append(hi - lo)
                    owner_of.append(owner)
        if not starts:  # gradients not laid out in the buffer: spread over the whole of it
            k = max(1, min(n, self.probe_elements))
            starts = [(j * n) // k for j in range(k)]
            lengths = [max(1, ((j + 1) * n) // k - (j * n) // k) for j in range(k)]
            owner_of = [0] * k
            names = [f"<bucket {index}>"]
        device = buffer.device
        first = torch.tensor(starts, dtype=torch.int64, device=device)
        spans = torch.tensor(lengths, dtype=torch.int64, device=device)
        owners = torch.tensor(owner_of, dtype=torch.int64, device=device)
        # Rotations: probe j of a slice reads element (r * 7919 + index) mod length
        # of it in round r; the slices are read through over the rounds.
        slices = [first + torch.remainder(torch.full_like(spans, r * 7919 + index), spans)
                  for r in range(PROBE_ROTATIONS)]
        layout = (slices, owners, tuple(names))
        self._probe_layout[index] = (key, layout)
        return layout

    def _loss_is_unusual(self) -> bool:
        """A non-finite loss, or one far above its recent values, forces the
        full check on a sampled-out step: a bad batch is still caught and
        named. The loss is known here only when its deferred read is already
        in (at once on a CPU; on a GPU it is read after the step)."""
        value = self.agent.progress.current_loss()
        if value is None:
            return False
        if not math.isfinite(value):
            return True
        typical = self.agent.progress.typical_loss
        return typical is not None and abs(value) > 10 * typical + 1e-12

    @guarded("grad_checks.step")
    def on_skipped_step(self) -> None:
        """GradScaler.step returned without the optimizer stepping: an
        overflow it skipped (normal now and then; many in a row are not).
        The parameters whose values were not finite follow when read."""
        buckets, self._buckets = self._buckets, []
        self.skipped_overflow_steps += 1
        step = self.agent.progress.step
        details = {"scaler": True}

        def consume(values: Optional[list[float]], buckets=buckets, step=step) -> None:
            named: list[str] = []
            if values is not None:
                _, _, bad_names = self._evaluate(buckets, values)
                named = bad_names
            self.agent.record_event("overflow_skipped", step=step, parameters=named[:MAX_NAMED], **details)

        if buckets:
            self.agent.progress.reads.submit([v for _, _, v, _ in buckets], consume)
        else:
            consume(None)

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
        sampled = self._sampled
        if sampled:
            self._adapt(record)
        else:
            self._adapt_probe(record)
        record.grad_check_stride = self.stride
        buckets, self._buckets = self._buckets, []
        if not buckets:
            return
        self.agent.progress.defer([v for _, _, v, _ in buckets],
                                  lambda values: self._consume(record, buckets, values, sampled))

    def _evaluate(self, buckets: list, values: list[float]) -> tuple[float, list[int], list[str]]:
        """(sum of squared norms, bad bucket indices, bad parameter names in
        model order) from the flat floats of ``buckets``."""
        at = 0
        total = 0.0
        bad_buckets: list[int] = []
        bad_names: list[str] = []
        for index, names, tensor, kind in buckets:
            size = int(tensor.numel())
            part = values[at: at + size]
            at += size
            if kind == "norms":
                bad = [n for n, v in zip(names, part) if not math.isfinite(v)]
                total += sum(v * v for v in part if math.isfinite(v))
            else:
                bad = [n for n, v in zip(names, part) if v != 0.0]
            if bad:
                bad_buckets.append(index)
                bad_names.extend(b for b in bad if b not in bad_names)
        bad_names.sort(key=lambda n: self.order.get(n, 1 << 30))  # model order, not bucket order
        return total, bad_buckets, bad_names

    def _consume(self, record: StepRecord, buckets: list, values: Optional[list[float]], sampled: bool) -> None:
        if values is None:  # not readable (a capture, a stalled device): nothing is claimed
            return
        total, bad_buckets, bad_names = self._evaluate(buckets, values)
        full = sampled and all(kind == "norms" for _, _, _, kind in buckets)
        if bad_buckets:
            record.grad_norm = math.nan
        elif full:
            # Squares summed in Python floats (double): no fp32 overflow of the total.
            record.grad_norm = math.sqrt(total)
        record.nonfinite_grads = len(bad_buckets)
        if bad_buckets:
            self._bad[record.step] = (bad_buckets, bad_names, "full_check" if full else "probe")
            while len(self._bad) > 16:
                self._bad.pop(next(iter(self._bad)))

    def _on_record_complete(self, record: StepRecord) -> None:
        """The step's record has its device values (loss, norms): a
        non-finite one is an event naming the parameters."""
        bad_buckets, bad_names, found_by = self._bad.pop(record.step, ([], [], "full_check"))
        if not bad_buckets and (record.loss is None or math.isfinite(record.loss)):
            return
        self.agent.record_event(
            "nonfinite",
            step=record.step,
            source="local_gradients" if bad_buckets else "loss",
            parameters=bad_names[:MAX_NAMED],
            buckets=bad_buckets,
            found_by=found_by if bad_buckets else "loss",
            loss=record.loss,
            scaler=self.scaler_in_use,
        )

    def on_command(self, command) -> None:
        if command.details.get("action") == "detect_anomaly":
            torch.autograd.set_detect_anomaly(True)
            self.agent.record_event("anomaly_mode", enabled=True, reason=command.reason)
            log("autograd anomaly detection turned on for this rank (requested by the collector)")


_CHECKERS: list[GradChecker] = []


def _patch_grad_scaler() -> None:
    """Under GradScaler, an overflow step it skips is normal: know it is
    there (``scale``), and know a skip when it happens (``step`` returned
    and no optimizer stepped)."""
    try:
        from torch.amp.grad_scaler import GradScaler
    except ImportError:
        return

    def make_scale(original):
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

    def make_step(original):
        @functools.wraps(original)
        def step(*args, **kwargs):
            if not _CHECKERS or _compiling():
                return original(*args, **kwargs)
            progress = _CHECKERS[-1].agent.progress
            before = progress.optimizer_steps
            result = original(*args, **kwargs)
            enabled = getattr(args[0], "_enabled", True) if args else True
            if enabled and progress.optimizer_steps == before:
                for checker in _CHECKERS:
                    checker.on_skipped_step()
            return result

        return step

    _PATCHES.apply(GradScaler, "scale", make_scale)
    _PATCHES.apply(GradScaler, "step", make_step)


def attach(agent: "Agent", ddp) -> Optional[GradChecker]:
    if not agent.config.grad_checks:
        return None
    checker = GradChecker(agent, ddp)
    _CHECKERS.append(checker)
    _patch_grad_scaler()
    return checker
