"""Local-gradient checks before the allreduce, on every parameter the
optimizer will update.

Each parameter gets a post-accumulate-grad hook
(``Tensor.register_post_accumulate_grad_hook``, torch >= 2.1). Autograd runs
it right after the gradient is accumulated into ``param.grad`` and *before*
the node's post hooks, among them DDP's reducer hook that copies the
gradient into its bucket and starts the allreduce: the hook sees this rank's
*local* gradient. On the steps the cost budget samples it takes the
gradient's float32 norm (one kernel), on the others a sparse finiteness
probe (a gather of a few elements); at the end of the backward (an autograd
callback) the values are stacked into one vector, read on the host through
the device adapter's deferred reads (agent/core/device.py) with the step's other
device values: at the step's end on a CPU, a step or more later on a GPU,
never with a sync. They travel in the step's record (``grad_norm``,
``nonfinite_grads``); a non-finite value names its parameter, and the
origin rank is the one non-finite *before* the allreduce.

Why these hooks and not a DDP communication hook: measured side by side on
two gloo ranks (``bench/grad_check_cost.py``), a Python comm hook replacing
DDP's C++ allreduce costs 1.09-1.11x the step of the C++ path before any
check (Python futures per bucket; DDP no longer folds the 1/world division
into its copy), the comm hook with per-parameter norms 1.13-1.17x, and DDP's
C++ allreduce with these hooks 1.05-1.11x (norms) and 1.03-1.06x (probe). The hooks keep DDP's
C++ path and the user's own comm hook untouched, and work without DDP
(FSDP1, hand-written loops: the checker takes any list of parameters).

The same code runs on every device: the test double (``GpuLikeDouble``)
makes CPU tests run what CUDA runs. No GPU run of it has been made here.

Under AMP's GradScaler, a step the scaler skips (an overflow) is counted
when ``GradScaler.step`` returns without the optimizer having stepped; a
backward without an optimizer step (gradient accumulation) is not an
overflow. Under ``no_sync()`` accumulation the checks wait for the backward
that synchronises. Under compiled autograd's Python reducer (DDP's own
post-accumulate hooks allreduce first) and during a CUDA graph capture the
checks step aside.
"""

from __future__ import annotations

import functools
import math
import time
from typing import TYPE_CHECKING, Any, Optional

import torch

from rankwatch.config import Config
from rankwatch.wire import StepRecord

from ..core import device as device_mod
from ..core.budget import next_stride
from ..watch.collectives import CollectiveTracker
from ..core.device import DeferredReads
from ..core.patching import Patches, argument, binding_error
from ..core.safety import guarded, is_disabled, log
from ..core.torch_state import compiling, in_backward
from ..core.weakrefs import deref, weak

if TYPE_CHECKING:
    from ..core.ports import Emit, StepProgress

MAX_NAMED = 8
MAX_STRIDE = 64  # the full gradient check runs at least every 64th step, however costly
PROBE_ELEMENTS = 512  # elements per model and step, on steps the full check is sampled out
PROBE_MIN, PROBE_MAX = 16, 8192
PROBE_ROTATIONS = 16

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
        # Also a float64 tensor among half ones: `dtype=float32` refuses it (a narrowing).
        return [torch.linalg.vector_norm(t).float() if t.dtype in (torch.float32, torch.float64)
                else torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]


_FLOAT32_MAX = torch.finfo(torch.float32).max


def _norm32(grad: torch.Tensor) -> torch.Tensor:
    """The gradient's L2 norm as a float32 0-d tensor. `vector_norm(dtype=
    float32)` refuses float64 input (a narrowing); a float64 norm is taken
    in float64 and a finite one beyond float32's range is clamped to its
    maximum, so only a non-finite gradient reads as non-finite."""
    if grad.dtype != torch.float64:
        return torch.linalg.vector_norm(grad, dtype=torch.float32)
    norm = torch.linalg.vector_norm(grad)
    return torch.where(torch.isfinite(norm), norm.clamp(max=_FLOAT32_MAX), norm).float()


def unpatch() -> None:
    _PATCHES.undo()
    for checker in _CHECKERS:
        checker.remove()
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
            if checker is None or binding_error(original, args, kwargs):
                return original(*args, **kwargs)
            return checker.register(original, argument(original, args, kwargs, 1),
                                    argument(original, args, kwargs, 2))

        return register_comm_hook

    _PATCHES.apply(DistributedDataParallel, "register_comm_hook", make)


def uses_python_reducer(ddp: Any) -> bool:
    """DDP built under ``torch._dynamo.config.optimize_ddp = "python_reducer"``
    (torch >= 2.4): with compiled autograd it calls comm hooks once per
    parameter with a ``(grad, param)`` tuple, and DDP's own default then is
    an in-graph functional allreduce. A hook of ours would replace that."""
    return bool(getattr(ddp, "_use_python_reducer", False))


MAX_PARAMETERS = 65536  # parameters checked per model, at most


class GradChecker:
    """``named_parameters``: (name, parameter) of the model being trained;
    ``ddp``: its DistributedDataParallel wrapper, if any; ``collectives``:
    the rank's collective tracker (a user's comm hook is not recorded as
    Python call sites)."""

    @property
    def ddp(self) -> Any:
        """The DDP wrapper, while the script keeps it."""
        return deref(self._ddp)

    def __init__(self, named_parameters, ddp=None, *, config: Config, emit: "Emit", progress: "StepProgress",
                 collectives: CollectiveTracker) -> None:
        self.emit = emit
        self.progress = progress
        self.collectives = collectives
        self._ddp = weak(ddp)  # a hook on the DDP keeps this alive: no cycle (agent/core/weakrefs.py)
        self.registered = True  # the user's comm hooks are only wrapped, never replaced
        seen: set[int] = set()
        params = []
        for name, p in named_parameters:
            if p.requires_grad and id(p) not in seen and len(params) < MAX_PARAMETERS:
                seen.add(id(p))
                params.append((name, p))
        self.params = params
        self.names = {id(p): n for n, p in params}
        self.order = {n: i for i, (n, _) in enumerate(params)}
        # This backward's values (one 0-d tensor per parameter, in hook order),
        # and the step's: one vector per backward that synchronised, the last one kept.
        self._names: list[str] = []
        self._values: list[torch.Tensor] = []
        self._in_backward = False
        self._skip_backward = False
        self._last_grad: Optional[torch.Tensor] = None
        self._step_values: Optional[tuple[tuple[str, ...], torch.Tensor, str]] = None
        self._last_backward_step = -1
        self.scaler_in_use = False
        self.skipped_overflow_steps = 0
        # Cost control: every check costs host time on the autograd thread (and
        # on a CPU a pass over the gradients). When that exceeds the budget (a
        # fraction of the step time), the full check runs every `stride`-th
        # step; the loss is still checked on every step.
        self.budget = config.grad_check_budget
        self.stride = 1
        self._sampled = True
        self._spent = 0.0
        # Every step: a sparse finiteness probe of each gradient, its size kept
        # within the same budget (halved / doubled as the measured cost asks).
        self.probe_elements = PROBE_ELEMENTS
        self._probe_spent = 0.0
        self._probe_round = 0
        self._total_elements = max(1, sum(p.numel() for _, p in params))
        self._probe_layout: dict[int, tuple[tuple[int, int], list[torch.Tensor]]] = {}
        self._owners: Optional[tuple[tuple, torch.Tensor]] = None  # see _probe_owners
        self._bad: dict[int, tuple[list[str], str]] = {}  # step -> what was not finite
        self._handles = []
        self.python_reducer = ddp is not None and uses_python_reducer(ddp)
        if self.python_reducer:
            # DDP's own post-accumulate hooks allreduce first: ours would see averages.
            emit("grad_checks_off", reason="python_reducer")
            log("local gradient checks off for this model: DDP uses the Python reducer "
                "(torch._dynamo.config.optimize_ddp='python_reducer')")
        else:
            for _, p in params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        if ddp is not None:
            ddp._rankwatch_grad_checker = self
            _patch_register_comm_hook()
        progress.step_extras.append(self._on_step_end)
        progress.backward_extras.append(self._on_backward_call)
        progress.record_complete.append(guarded("grad_checks.step")(self._on_record_complete))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def retire(self) -> None:
        """Its model was freed (agent/core/weakrefs.py): unhook and let go of
        the model's tensors, so their memory is freed as under plain torch."""
        self.remove()
        self.progress.remove_extras(self)
        if self in _CHECKERS:
            _CHECKERS.remove(self)
        self.params, self.names, self.order = [], {}, {}
        self._values, self._names, self._last_grad, self._step_values = [], [], None, None
        self._probe_layout, self._owners = {}, None

    # -- a user's comm hook: its collectives are the gradient reduction -------------
    def register(self, original_register, state, user_hook):
        local = self.collectives._local

        @functools.wraps(user_hook)
        def reducing_hook(hook_state, bucket):
            # Not recorded as Python call sites (that is how a stray user
            # collective stands out from the gradient allreduce).
            outer = getattr(local, "depth", 0)
            local.depth = 1
            try:
                return user_hook(hook_state, bucket)
            finally:
                local.depth = outer

        return original_register(self.ddp, state, reducing_hook)

    # -- a backward that raised (issue 25, finding 7) -------------------------------
    @guarded("grad_checks.step")
    def _on_backward_call(self, loss) -> None:
        """``Tensor.backward`` was called outside any running backward: a
        backward still marked as running raised (an OOM a batch-size finder
        caught) and autograd never ran its end callback. Without this reset
        the next backwards would never start (one 0-d tensor per parameter
        accumulating for ever, the checks silently off)."""
        if self._in_backward and not in_backward():
            self._abandon_backward()

    def _abandon_backward(self) -> None:
        self._in_backward = False
        self._names, self._values, self._last_grad = [], [], None

    # -- inside the backward (autograd thread) -----------------------------------
    def _on_grad(self, param) -> None:
        if compiling():  # compiled autograd traces hooks: nothing of ours in the graph
            return
        self._inspect(param)

    @guarded("grad_checks.hook")
    def _inspect(self, param) -> None:
        if not self._in_backward:
            self._start_backward(param)
        if self._skip_backward:
            return
        grad = param.grad
        if grad is None or not grad.is_floating_point() or grad.is_sparse:
            return
        self._last_grad = grad
        started = time.perf_counter()
        if self._sampled:
            self._values.append(_norm32(grad.detach()))
            self._names.append(self.names.get(id(param), "?"))
            self._spent += time.perf_counter() - started
            return
        positions = self._probe_positions(param, grad)
        if positions is None:
            return
        # A few elements, gathered now (before DDP's hook copies the gradient
        # into its bucket): one kernel here, in the middle of the backward.
        # They are judged together at its end (`_probe_counts`): the gather,
        # finiteness test and count per parameter were four launches each.
        # (take indexes the tensor as if flattened: no reshape, which would
        # copy a non-contiguous gradient such as a channels_last one.)
        self._values.append(torch.take(grad.detach(), positions))
        self._names.append(self.names.get(id(param), "?"))
        self._probe_spent += time.perf_counter() - started

    def _start_backward(self, param) -> None:
        """The first gradient of a backward: decide what this backward does,
        and ask autograd to tell us when it is over."""
        self._in_backward = True
        self._names, self._values, self._last_grad = [], [], None
        step = self.progress.step
        if self._last_backward_step != step:
            self._step_values = None  # a new step
        self._last_backward_step = step
        ddp = self.ddp
        syncing = ddp is None or bool(getattr(ddp, "require_backward_grad_sync", True))
        grad = param.grad
        self._skip_backward = (not syncing or is_disabled("grad_checks.step")
                               or (grad is not None and device_mod.capturing(device_mod.device_of(grad))))
        self._sampled = step % self.stride == 0 or self._loss_is_unusual()
        if not self._sampled and self.probe_elements <= 0:
            self._skip_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    @guarded("grad_checks.hook")
    def _end_backward(self) -> None:
        """Autograd's callback at the end of the backward (before DDP's own,
        which waits for the allreduce): the local backward is done."""
        self._in_backward = False
        try:
            # (The step's timing is marked by progress itself: issue 25, finding 6.)
            if self._values and not self._skip_backward:
                # One vector per backward; a later backward of the same step
                # (accumulation, a step GradScaler skipped) supersedes it.
                if self._sampled:
                    self._step_values = (tuple(self._names), torch.stack(self._values), "norms")
                else:
                    started = time.perf_counter()
                    self._step_values = (tuple(self._names), self._probe_counts(self._values), "probe")
                    self._probe_spent += time.perf_counter() - started
        finally:
            self._names, self._values, self._last_grad = [], [], None

    def _probe_counts(self, gathered: list[torch.Tensor]) -> torch.Tensor:
        """Non-finite elements per parameter (float32, in hook order) of this
        backward's gathered probe values: a fixed number of launches per
        backward whatever the number of parameters (cat, test, one indexed
        sum over each element's parameter number). Run under the device
        doubles only: never on a GPU yet (index_add_ on CUDA adds by atomics;
        counts of 0/1 in float32 are exact in any order)."""
        flat = torch.cat(gathered)
        bad = torch.isfinite(flat).logical_not_().to(torch.float32)
        owners = self._probe_owners(gathered, flat.device)
        return torch.zeros(len(gathered), dtype=torch.float32, device=flat.device).index_add_(0, owners, bad)

    def _probe_owners(self, gathered: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Each gathered element's parameter number, kept while the sizes in
        hook order stay the same (a model's backward runs its parameters in
        the same order step after step). Made on the device by fills: a
        host-built index copied over would be a blocking copy (issue 25,
        finding 1)."""
        key = (tuple(t.numel() for t in gathered), device)
        if self._owners is None or self._owners[0] != key:
            self._owners = (key, torch.cat([torch.full((t.numel(),), i, dtype=torch.int64, device=device)
                                             for i, t in enumerate(gathered)]))
        return self._owners[1]

    def _probe_positions(self, param, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """This step's probe positions in the gradient: about
        `probe_elements` over the whole model, spread in proportion to size,
        at least one per parameter; each moves within its slice every step,
        so a slice is sampled at PROBE_ROTATIONS places over the steps. A NaN
        from one sample's backward poisons whole weight-gradient tensors (or
        whole rows), so this finds it; a lone bad element is found with
        probability ~ elements read / gradient size (bench/grad_check_cost.py
        measures both)."""
        m = grad.numel()
        if m == 0:
            return None
        key = (m, self.probe_elements)
        cached = self._probe_layout.get(id(param))
        if cached is None or cached[0] != key:
            k = max(1, min(m, round(self.probe_elements * m / self._total_elements)))
            # Built on the gradient's device: a host-built layout copied with
            # .to(device) was a blocking copy per rotation per parameter, in
            # the middle of the backward, whenever probe_elements changed
            # (issue 25, finding 3).
            j = torch.arange(k, dtype=torch.int64, device=grad.device)
            starts = (j * m) // k
            spans = torch.clamp_min(((j + 1) * m) // k - starts, 1)
            rotations = [starts + torch.remainder(torch.full_like(spans, r * 7919 + len(self._probe_layout)), spans)
                         for r in range(PROBE_ROTATIONS)]
            cached = (key, rotations)
            if len(self._probe_layout) < MAX_PARAMETERS:
                self._probe_layout[id(param)] = cached
        rotations = cached[1]
        return rotations[self._probe_round % len(rotations)]

    def _loss_is_unusual(self) -> bool:
        """A non-finite loss, or one far above its recent values, forces the
        full check on a sampled-out step: a bad batch is still caught and
        named. The loss is known here only when its deferred read is already
        in (at once on a CPU; on a GPU it is read after the step)."""
        value = self.progress.current_loss()
        if value is None:
            return False
        if not math.isfinite(value):
            return True
        typical = self.progress.typical_loss
        return typical is not None and abs(value) > 10 * typical + 1e-12

    @guarded("grad_checks.step")
    def on_skipped_step(self) -> None:
        """GradScaler.step returned without the optimizer stepping: an
        overflow it skipped (normal now and then; many in a row are not).
        The parameters whose values were not finite follow when read."""
        values, self._step_values = self._step_values, None
        self.skipped_overflow_steps += 1
        step = self.progress.step

        def consume(read: Optional[list[float]], values=values, step=step) -> None:
            named: list[str] = []
            if read is not None and values is not None:
                named = self._evaluate(values, read)[1]
            self.emit("overflow_skipped", step=step, parameters=named[:MAX_NAMED], scaler=True)

        if values is not None:
            self.progress.reads.submit([values[1]], consume)
        else:
            consume(None)

    # -- end of step (training thread) ------------------------------------------------
    def _adapt(self, record: StepRecord) -> None:
        spent, self._spent = self._spent, 0.0
        self.stride = next_stride(self.stride, spent, self.budget, record.ended_at - record.started_at,
                                  record.step, MAX_STRIDE)

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
        if self._in_backward and not in_backward():
            self._abandon_backward()  # a backward that raised, then a step without another backward
        sampled = self._sampled
        if sampled:
            self._adapt(record)
        else:
            self._adapt_probe(record)
        record.grad_check_stride = self.stride
        values, self._step_values = self._step_values, None
        self._last_backward_step = -1
        if values is None:
            return
        self.progress.defer([values[1]], lambda read: self._consume(record, values, read))

    def _evaluate(self, values: tuple[tuple[str, ...], torch.Tensor, str],
                  read: list[float]) -> tuple[float, list[str]]:
        """(sum of squared norms, non-finite parameters in model order)."""
        names, _, kind = values
        if kind == "norms":
            bad = [n for n, v in zip(names, read) if not math.isfinite(v)]
            total = sum(v * v for v in read if math.isfinite(v))
        else:
            bad = [n for n, v in zip(names, read) if v != 0.0]
            total = 0.0
        bad = list(dict.fromkeys(bad))
        bad.sort(key=lambda n: self.order.get(n, 1 << 30))  # model order, not backward order
        return total, bad

    def _consume(self, record: StepRecord, values, read: Optional[list[float]]) -> None:
        if read is None:  # not readable (a capture, a stalled device): nothing is claimed
            return
        total, bad = self._evaluate(values, read)
        full = values[2] == "norms"
        if bad:
            record.grad_norm = math.nan
        elif full:
            # Squares summed in Python floats (double): no float32 overflow of the total.
            record.grad_norm = math.sqrt(total)
        record.nonfinite_grads = len(bad)
        if bad:
            self._bad[record.step] = (bad, "full_check" if full else "probe")
            while len(self._bad) > 16:
                self._bad.pop(next(iter(self._bad)))

    def _on_record_complete(self, record: StepRecord) -> None:
        """The step's record has its device values (loss, norms): a
        non-finite one is an event naming the parameters."""
        bad, found_by = self._bad.pop(record.step, ([], "full_check"))
        if not bad and (record.loss is None or math.isfinite(record.loss)):
            return
        self.emit(
            "nonfinite",
            step=record.step,
            source="local_gradients" if bad else "loss",
            parameters=bad[:MAX_NAMED],
            found_by=found_by if bad else "loss",
            loss=record.loss,
            scaler=self.scaler_in_use,
        )

    def on_command(self, command) -> None:
        if command.details.get("action") == "detect_anomaly":
            torch.autograd.set_detect_anomaly(True)
            self.emit("anomaly_mode", enabled=True, reason=command.reason)
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
                    _CHECKERS[-1].progress.note_scaled(result, unscaled)
            return result

        return scale

    def make_step(original):
        @functools.wraps(original)
        def step(*args, **kwargs):
            if not _CHECKERS or compiling():
                return original(*args, **kwargs)
            progress = _CHECKERS[-1].progress
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


def attach(ddp, *, config: Config, emit: "Emit", progress: "StepProgress",
           collectives: CollectiveTracker) -> Optional[GradChecker]:
    """The checks for a DDP model."""
    if not config.grad_checks:
        return None
    ignored = set(getattr(ddp, "parameters_to_ignore", None) or ())
    named = [(n, p) for n, p in ddp.module.named_parameters() if n not in ignored]
    return attach_parameters(named, ddp=ddp, config=config, emit=emit, progress=progress, collectives=collectives)


def attach_parameters(named_parameters, ddp=None, *, config: Config, emit: "Emit", progress: "StepProgress",
                      collectives: CollectiveTracker) -> Optional[GradChecker]:
    """The checks for any trained parameters: ``named_parameters`` is a
    list of (name, parameter) (a model without DDP: FSDP1, a hand-written
    data-parallel loop; see runtime.on_model_found)."""
    if not config.grad_checks:
        return None
    checker = GradChecker(named_parameters, ddp, config=config, emit=emit, progress=progress, collectives=collectives)
    _CHECKERS.append(checker)
    _patch_grad_scaler()
    return checker
