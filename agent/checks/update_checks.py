"""Does the optimizer step do what training needs? Four checks, each on a
few steps only (the first ones, after the model or its optimizers change,
then every CHECK_EVERY steps), each reported once as an event:

- `not_in_optimizer`: parameters of a trained model with ``requires_grad``
  that hold a gradient at the step's end but are in no optimizer (a head
  replaced after the optimizer was built, a parameter list that misses
  some). Frozen parameters (``requires_grad=False``), EMA or teacher copies
  (no gradient) are not flagged. Two checks in a row.
- `not_updated`: parameters of an optimizer's group with a learning rate
  above 0 and a non-zero gradient whose values are bit for bit the same
  after the optimizer stepped (a float64 norm before and after: any update
  of any element shows), on two checked steps in a row. A GradScaler step
  skipped for an overflow never calls the optimizer, so it is never seen.
  Unchanged is evidence only where the optimizer's own update would have
  changed the tensor: the expected update of each element (`_update_in_ulps`, on up to
  UPDATE_SAMPLE elements evenly spread over the tensor:
  from the optimizer's state after the step — Adam's lr·m̂/(√v̂+eps), SGD's
  lr·momentum buffer, or lr·grad) must be at least UPDATE_EVIDENCE times the
  element's float resolution (ulp) somewhere in the tensor. A smaller update
  rounds away in a healthy step (a conv bias before BatchNorm: its gradient
  is ~1e-8), so such a tensor is not judged; it is listed in an
  `update_unjudged` event (the report's notes), once.
- `grads_not_cleared`: the gradient a parameter held when the optimizer
  stepped is still there, unchanged, when the next step's first backward
  adds to it, and no ``zero_grad`` ran before that step (accumulation
  within a step is normal). Read through a tensor hook on two parameters,
  before the gradient is accumulated; for a sharded parameter (FSDP2's
  DTensor, whose gradient no tensor hook sees) at the next backward's call.
- `unreduced_backward`: the optimizer steps on gradients whose last backward
  DDP did not reduce: a forward through ``ddp.module`` (or inside
  ``no_sync()``) not followed by one through DDP itself. Every step.

Device values are read through the deferred device read (no sync);
sharded parameters (DTensor) are read through their local shard (no
collective). The device path was never run on a GPU here (the tests use a
GPU-like double of the read).
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from rankwatch.wire import StepRecord

from .grad_checks import fp32_norms
from ..watch import models as models_mod
from ..watch.models import Forward, TrainedModels
from ..core.patching import Patches
from ..core.safety import guarded

if TYPE_CHECKING:
    from ..core.ports import Emit, StepProgress

CHECK_STEPS = (0, 1, 2, 3)
CHECK_EVERY = 64
MAX_NAMES = 16
SAMPLE_PARAMS = 2
SAMPLE_ELEMENTS = 8
# An element whose expected update is at least this many ulps must change: round
# to nearest keeps a value only for an update below half an ulp, and the estimate
# (the optimizer's state after the step) is exact for SGD and Adam-like optimizers
# up to their variants' small terms (nesterov, amsgrad, weight decay).
UPDATE_EVIDENCE = 4.0
# Elements per tensor the estimate reads (evenly spread): bounded memory and work on any
# model (the whole tensor would need a few temporaries of its size). A sample can only
# miss a moving element, which leaves the tensor unjudged, never wrongly judged.
UPDATE_SAMPLE = 4096


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (reading it needs no collective); any other tensor as is."""
    if type(tensor).__name__ == "DTensor":
        to_local = getattr(tensor, "to_local", None)
        if to_local is not None:
            return to_local()
    return tensor


def _lr_positive(group: dict) -> bool:
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor):
        return lr.device.type != "cpu" or float(lr) > 0
    try:
        return float(lr) > 0
    except (TypeError, ValueError):
        return True


class UpdateChecks:
    def __init__(self, models: TrainedModels, *, emit: "Emit", progress: "StepProgress", patches: Patches) -> None:
        self.emit = emit
        self.progress = progress
        self.patches = patches
        self.models = models
        self.reader = progress.reads  # the rank's one poller of deferred device reads (Progress)
        self.reported: set[str] = set()
        self._checked_version = -1
        self._recheck_until = -1
        # not_in_optimizer: names seen without an optimizer at the previous check
        self._orphans_before: Optional[tuple[int, frozenset]] = None
        # not_updated: per optimizer, (step, names, grad norms, norms before) waiting for the post hook
        self._before: dict[int, tuple[int, list[str], list[torch.Tensor], list[torch.Tensor], list[Any]]] = {}
        self._unchanged: dict[int, tuple[int, frozenset]] = {}  # id(optimizer) -> (step, unchanged names)
        # (name, id(param)) of every parameter seen moving at a check: one that moved once is
        # updated by its optimizer. Late in a healthy run a converged parameter's update can
        # round away (fp32: below its resolution); the faults (a tensor in no optimizer, an
        # optimizer holding replaced tensors) never move from their first check.
        self._moved: set[tuple[str, int]] = set()
        # grads_not_cleared
        self._watch: list[dict[str, Any]] = []
        self._picks: Optional[tuple[tuple, list[tuple[str, Any]]]] = None  # see _stale_picks
        self._indices: dict[tuple, torch.Tensor] = {}  # see _index_for
        self._closed: list[dict[str, Any]] = []  # watches waiting for their device values
        self._zeroed = False
        # unreduced_backward
        self._unreduced: Optional[Forward] = None
        self._unreduced_reported = False

    def install(self) -> None:
        models = self.models
        models.on_training_backward.append(self._on_backward)
        models.on_optimizer_pre.append(self._on_optimizer_pre)
        models.on_optimizer_post.append(self._on_optimizer_post)
        self.progress.step_extras.append(self._on_step_end)
        checks = self

        def make_zero_grad(original):
            @functools.wraps(original)
            def zero_grad(*args, **kwargs):
                checks._zeroed = True
                return original(*args, **kwargs)

            return zero_grad

        self.patches.apply(torch.optim.Optimizer, "zero_grad", make_zero_grad)
        self.patches.apply(torch.nn.Module, "zero_grad", make_zero_grad)

    def _checking(self, step: int) -> bool:
        return step in CHECK_STEPS or step % CHECK_EVERY == 0 or step <= self._recheck_until

    def _report(self, check: str, step: int, **details: Any) -> None:
        if check in self.reported:
            return
        self.reported.add(check)
        self.emit("broken_update", step=step, check=check, **details)

    # -- unreduced backward (every step: flags only) -------------------------------------------------
    @guarded("update_checks.backward")
    def _on_backward(self, forwards: list[Forward]) -> None:
        for watch in self._watch:
            if watch.get("at_backward_call") and not watch["fired"]:
                self._on_first_grad(watch)
        if any(f.via == "ddp" for f in forwards):
            self._unreduced = None  # DDP reduces what was accumulated so far, too
            return
        odd = next((f for f in forwards if f.via in ("module", "no_sync") and f.training), None)
        if odd is not None:
            self._unreduced = odd

    # -- optimizer step ----------------------------------------------------------------------------
    @guarded("update_checks.optimizer")
    def _on_optimizer_pre(self, optimizer: Any) -> None:
        step = self.progress.step
        if self._unreduced is not None and not self._unreduced_reported:
            forward = self._unreduced
            self._unreduced_reported = True  # the first step it happened is what the collector needs
            self.emit("unreduced_backward", step=step, via=forward.via, module=forward.root.label,
                      site=forward.site or "")
        self._stale_at_step(optimizer, step)
        if not self._checking(step) or "not_updated" in self.reported:
            return
        names, params, grads, owners = [], [], [], []
        keys: list[tuple[str, int]] = []
        for group in getattr(optimizer, "param_groups", []):
            if not _lr_positive(group):
                continue
            for p in group.get("params", []):
                g = p.grad
                if g is None or g.is_sparse or p.is_sparse or not p.requires_grad:
                    continue
                if p.dtype not in (torch.float32, torch.float64):
                    # bf16/fp16 weights without float32 master copies: an update below the
                    # value's resolution rounds away. That is lost precision, not an optimizer
                    # that misses the tensor (its other parameters still tell that).
                    continue
                names.append(self.models.name_of(p) or f"<{tuple(p.shape)}>")
                keys.append((names[-1], id(p)))
                params.append(local(p.detach()))
                grads.append(local(g.detach()))
                owners.append((p, group))
                if len(params) >= 4096:
                    break
        if not params:
            return
        with torch.no_grad():
            before = _norms64(params)
            grad_norms = fp32_norms(grads)
        self._before[id(optimizer)] = (step, keys, grad_norms, before, params, grads, owners)

    @guarded("update_checks.optimizer")
    def _on_optimizer_post(self, optimizer: Any) -> None:
        entry = self._before.pop(id(optimizer), None)
        if entry is None:
            return
        step, keys, grad_norms, before, params, grads, owners = entry
        with torch.no_grad():
            after = _norms64(params)
            # Compared on the device in float64: the deferred read brings float32 back,
            # which would hide a small update of a big tensor.
            moved = (torch.stack(after) != torch.stack(before)).float()
            evidence = [_update_in_ulps(optimizer, p, group, param, grad)
                        for (p, group), param, grad in zip(owners, params, grads)]
            evidence = torch.stack(evidence)
        n = len(keys)
        key = id(optimizer)

        def consume(values: Optional[list[float]], step=step, keys=keys, n=n, key=key) -> None:
            if values is None:
                return  # given up (a capture, or the device fell far behind): this step says nothing
            grads, changed, ulps = values[:n], values[n:2 * n], values[2 * n:3 * n]
            if len(self._moved) > 1_000_000:
                self._moved.clear()  # bounded: a run that keeps building new tensors
            self._moved.update(k for k, c in zip(keys, changed) if c != 0)
            unchanged = [(k, u) for k, g, c, u in zip(keys, grads, changed, ulps)
                         if g > 0 and c == 0 and k not in self._moved]
            still = frozenset(k[0] for k, u in unchanged if u >= UPDATE_EVIDENCE)
            self._note_unjudged(step, [(k[0], u) for k, u in unchanged if not u >= UPDATE_EVIDENCE])
            self._note_unchanged(key, step, still)

        self.reader.submit(list(grad_norms) + [moved, evidence], consume)

    def _note_unjudged(self, step: int, below: list[tuple[str, float]]) -> None:
        """Unchanged tensors whose expected update is below their resolution: a
        healthy step leaves them as they are, so not_updated cannot judge them
        (said once, in the report's notes)."""
        if not below or "update_unjudged" in self.reported:
            return
        self.reported.add("update_unjudged")
        below.sort()
        self.emit("update_unjudged", step=step, parameters=[n for n, _ in below[:MAX_NAMES]],
                  count=len(below), largest_update_ulps=max(float(u) for _, u in below))

    def _note_unchanged(self, key: int, step: int, still: frozenset) -> None:
        previous = self._unchanged.get(key)
        self._unchanged[key] = (step, still)
        if previous is None or previous[0] >= step:
            return
        both = sorted(still & previous[1])
        if both:
            self._report("not_updated", previous[0], parameters=both[:MAX_NAMES], count=len(both), confirmed_at=step)

    # -- step end ---------------------------------------------------------------------------------
    @guarded("update_checks.step")
    def _on_step_end(self, record: StepRecord) -> None:
        if self._closed:
            self._judge_stale()
        step = record.step
        self._unreduced = None
        if self.models.version != self._checked_version:
            self._checked_version = self.models.version
            self._recheck_until = step + 2  # the model or its optimizers changed: look again
        if self._checking(step):
            self._check_orphans(step)
        if self._watch:  # still armed: the step ran its backward inside (a closure), judged now
            self._stale_at_step(self.progress.lead_optimizer(), step, inside_done=True)
        # Every step (a few sampled elements of two gradients): clearing can stop mid-run
        # (a refactor, a patched zero_grad), and the verdict is due within 2 steps.
        self._arm_stale_watch(step)
        self._zeroed = False

    def _check_orphans(self, step: int) -> None:
        if "not_in_optimizer" in self.reported or not self.models.discovered:
            return
        optimized = self.models.optimized()
        orphans = frozenset(name for name, p in self.models.named_parameters()
                            if p.requires_grad and p.grad is not None and id(p) not in optimized)
        before, self._orphans_before = self._orphans_before, (step, orphans)
        both = sorted(orphans & before[1]) if before is not None else []
        if not both:
            return
        first = before[0]  # the first of the two checks that saw them
        in_model = {id(p) for _, p in self.models.named_parameters()}
        stale = sum(1 for key in optimized if key not in in_model)
        self._report("not_in_optimizer", first, parameters=both[:MAX_NAMES], count=len(both),
                     optimizer_tensors_not_in_model=stale, confirmed_at=step)

    # -- gradients never cleared --------------------------------------------------------------------
    def _arm_stale_watch(self, step: int) -> None:
        """After a checked step: remember a few elements of two of the lead
        optimizer's parameters' gradients, and look at them again when the
        next backward reaches them (a tensor hook runs before the new
        gradient is added to `.grad`)."""
        self._disarm()
        if "grads_not_cleared" in self.reported:
            return
        for name, param in self._stale_picks(self.progress.lead_optimizer()):
            grad = local(param.grad.detach())
            index = self._index_for(grad)
            watch: dict[str, Any] = {"name": name, "param": weakref.ref(param), "grad": weakref.ref(param.grad),
                                     "index": index, "before": None, "seen": None, "step": step,
                                     "fired": False, "cleared": False}
            self._read(grad, index, watch, "before")
            if type(param).__name__ == "DTensor":
                # FSDP2 never runs autograd through a sharded parameter (its
                # gradient is reduce-scattered into .grad): no tensor hook would
                # fire. Read at the next backward's call, before it runs.
                watch["at_backward_call"] = True
            else:
                try:
                    watch["handle"] = param.register_hook(self._first_grad(watch))
                except RuntimeError:
                    continue
            self._watch.append(watch)

    def _stale_picks(self, lead: Any) -> list[tuple[str, Any]]:
        """The two watched parameters (the lead optimizer's first and middle
        ones with a gradient). Kept while the models, the optimizer's groups
        and the picks' gradients stay as they were: a scan of every parameter
        each step cost ~1.5 us a parameter (2 % of a 200-parameter CPU step)."""
        groups = getattr(lead, "param_groups", [])
        key = (id(lead), self.models.version, sum(len(g.get("params", [])) for g in groups))
        if self._picks is not None and self._picks[0] == key:
            kept = [(n, p) for n, ref in self._picks[1] if (p := ref()) is not None and _watchable(p)]
            if len(kept) == len(self._picks[1]):
                return kept
        members = {id(p) for g in groups for p in g.get("params", [])}
        candidates = [(n, p) for n, p in self.models.named_parameters() if id(p) in members and _watchable(p)]
        if not candidates:
            self._picks = None
            return []
        picks = [candidates[0]] + ([candidates[len(candidates) // 2]] if len(candidates) > 2 else [])
        picks = picks[:SAMPLE_PARAMS]
        self._picks = (key, [(n, weakref.ref(p)) for n, p in picks])
        return picks

    def _index_for(self, grad: torch.Tensor) -> torch.Tensor:
        """`_sample_index(grad)`, kept per (size, device): only ever read."""
        key = (grad.numel(), grad.device)
        index = self._indices.get(key)
        if index is None:
            if len(self._indices) >= 8:
                self._indices.clear()
            index = self._indices[key] = _sample_index(grad)
        return index

    def _read(self, grad: torch.Tensor, index: torch.Tensor, watch: dict, slot: str) -> None:
        values = grad.take(index)
        if models_mod.on_host(values):
            watch[slot] = values.tolist()
            return

        def consume(read: Optional[list[float]], watch=watch, slot=slot) -> None:
            if read is None:
                watch["cleared"] = True  # never read back: unknowable, so not called stale
            else:
                watch[slot] = read

        self.reader.submit([values], consume)

    def _first_grad(self, watch: dict) -> Callable:
        checks = self

        def hook(new_grad):
            checks._on_first_grad(watch)
            return None

        return hook

    @guarded("update_checks.stale")
    def _on_first_grad(self, watch: dict) -> None:
        """The next step's first gradient reaches the parameter, before it is added to `.grad`."""
        if watch["fired"]:
            return
        watch["fired"] = True
        param = watch["param"]()
        grad = param.grad if param is not None else None
        if grad is None or grad is not watch["grad"]() or self._zeroed:
            watch["cleared"] = True
            return
        self._read(local(grad.detach()), watch["index"], watch, "seen")

    def _stale_at_step(self, optimizer: Any, step: int, inside_done: bool = False) -> None:
        """Before the lead optimizer's next step: were its gradients cleared since the last one?
        When no backward has reached a watched gradient yet, the step's own
        closure will run it (``optimizer.step(closure)``: Lightning, LBFGS:
        forward, zero_grad and backward run inside the step, after its
        pre-hooks), so the judgement waits for the step's end
        (``inside_done``), before the next watch is armed."""
        lead = self.progress.lead_optimizer()
        if not self._watch or (lead is not None and optimizer is not lead):
            return
        if not inside_done and not any(w["fired"] for w in self._watch):
            return
        for watch in self._watch:
            param = watch["param"]()
            if self._zeroed or param is None or param.grad is not watch["grad"]():
                watch["cleared"] = True  # zero_grad ran, or the gradient was set to None, before this step
            watch["applied_at"] = step
        closed = [w for w in self._watch if w["fired"]]
        self._disarm()
        self._closed.extend(closed)
        del self._closed[:-8]
        self._judge_stale()

    def _judge_stale(self) -> None:
        """Once the device values are read: the same non-zero values at the next
        step's first backward, and no clearing before its optimizer step. Judged
        per armed step, oldest first, each once all of its reads are in (a
        watch is armed every step: later ones may still be in flight)."""
        by_step: dict[int, list[dict[str, Any]]] = {}
        for w in self._closed:
            by_step.setdefault(w["step"], []).append(w)
        waiting: list[dict[str, Any]] = []
        for armed in sorted(by_step):
            closed = by_step[armed]
            if waiting or any(not w["cleared"] and (w["before"] is None or w["seen"] is None) for w in closed):
                waiting.extend(closed)  # a device read not back yet (kept in order)
                continue
            stale = [not w["cleared"] and any(v != 0 for v in w["before"]) and list(w["seen"]) == list(w["before"])
                     for w in closed]
            if all(stale):
                self._report("grads_not_cleared", min(w["applied_at"] for w in closed),
                             parameters=sorted({w["name"] for w in closed}), checked_after_step=armed)
        self._closed = waiting

    def _disarm(self) -> None:
        for watch in self._watch:
            handle = watch.pop("handle", None)
            if handle is not None:
                try:
                    handle.remove()
                except Exception:
                    pass
        self._watch = []


def _watchable(p: Any) -> bool:
    return p.requires_grad and p.grad is not None and not p.grad.is_sparse and p.grad.numel() > 0


def _sample_index(grad: torch.Tensor) -> torch.Tensor:
    """``count`` positions spread over the gradient, strictly increasing
    (n - 1 >= count - 1). Built on the gradient's device: `torch.tensor(list,
    device=cuda)` is a blocking host-to-device copy (a stream sync, twice a
    step here; issue 25, finding 1)."""
    n = grad.numel()
    count = min(SAMPLE_ELEMENTS, n)
    return torch.arange(count, dtype=torch.int64, device=grad.device) * (n - 1) // max(1, count - 1)


def _update_in_ulps(optimizer: Any, param: torch.Tensor, group: dict, value: torch.Tensor,
                    grad: torch.Tensor) -> torch.Tensor:
    """The largest expected update of any element of ``param`` in this step,
    in units of that element's float resolution (ulp), as a 0-d device tensor
    (no sync). The expected update comes from the optimizer's own state after
    the step: Adam-like (exp_avg, exp_avg_sq): lr·|m̂|/(√v̂+eps); a momentum
    buffer: lr·|buf|; RMSprop/Adagrad (square_avg, sum): lr·|g|/(√s+eps);
    no state (plain SGD and custom steps): lr·|g|. Any other state (Lion,
    Adafactor, ...): min(lr·|g|, lr), the smaller of a plain and a
    normalised step (those optimizers' updates are of the order of lr). A
    learning rate that is not a number: 0 (cannot judge)."""
    zero = torch.zeros((), device=value.device)
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor):
        lr = lr.detach()  # used as it is (a 0-d tensor): no copy, no read
    else:
        try:
            lr = float(lr)
        except (TypeError, ValueError):
            return zero
    state = optimizer.state.get(param, {}) if isinstance(getattr(optimizer, "state", None), dict) else {}
    eps = group.get("eps", 1e-8)
    eps = eps[0] if isinstance(eps, (tuple, list)) else eps
    eps = float(eps) if isinstance(eps, (int, float)) else 1e-8
    dtype = torch.float64 if value.dtype == torch.float64 else torch.float32

    n = value.numel()
    if n == 0 or grad.numel() != n:
        return zero
    index = torch.arange(0, n, max(1, n // UPDATE_SAMPLE), device=value.device)[:UPDATE_SAMPLE]

    def sample(t: torch.Tensor) -> torch.Tensor:
        t = torch.take(t, index)  # logical (row-major) positions: no copy of a strided tensor
        return t if t.dtype == dtype else t.to(dtype)

    def state_of(name: str) -> Optional[torch.Tensor]:
        t = state.get(name)
        if isinstance(t, torch.Tensor) and t.numel() == n:
            return sample(local(t.detach()))
        return None

    g = sample(grad).abs()
    m, v = state_of("exp_avg"), state_of("exp_avg_sq")
    if m is not None and v is not None:
        betas = group.get("betas", (0.9, 0.999))
        t = state.get("step", 1)
        if isinstance(t, torch.Tensor):  # bias corrections as 0-d tensors where the step count is (no read)
            c1 = (1 - torch.pow(float(betas[0]), t.detach())).clamp_min(1e-12)
            c2 = (1 - torch.pow(float(betas[1]), t.detach())).clamp_min(1e-12)
        else:
            c1 = max(1 - float(betas[0]) ** float(t), 1e-12)
            c2 = max(1 - float(betas[1]) ** float(t), 1e-12)
        update = (m.abs() / c1) / ((v / c2).sqrt() + eps)
    elif (buf := state_of("momentum_buffer")) is not None:
        update = buf.abs()
    elif (square := state_of("square_avg")) is not None:
        update = g / (square.sqrt() + eps)
    elif (total := state_of("sum")) is not None:
        update = g / (total.sqrt() + eps)
    elif not any(isinstance(t, torch.Tensor) and t.numel() > 1 for t in state.values()):
        update = g
    else:
        update = g.clamp_max(1.0)
    magnitude = sample(value).abs()
    ulp = torch.nextafter(magnitude, torch.full_like(magnitude, float("inf"))) - magnitude
    ratio = (update * lr / ulp).amax()
    return ratio if ratio.dtype == torch.float32 else ratio.float()


def _norms64(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One float64 norm per tensor: any change of any element shows (a float32
    norm of a big tensor hides a small update)."""
    try:
        return list(torch._foreach_norm(tensors, 2, dtype=torch.float64))
    except (TypeError, RuntimeError):
        return [torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors]


def attach(models: Optional[TrainedModels], *, emit: "Emit", progress: "StepProgress",
           patches: Patches) -> Optional[UpdateChecks]:
    if models is None:
        return None
    checks = UpdateChecks(models, emit=emit, progress=progress, patches=patches)
    checks.install()
    return checks
