"""Parameter fingerprints: replicas that must hold identical weights, checked
out of band.

Every N optimizer steps, one fused kernel (``torch._foreach_norm``) gives a
norm per parameter; the vector goes to the collector in the next heartbeat
(through the device adapter's deferred read: a pinned, non-blocking copy
read a step later on a GPU). The
collector compares replicas; no collective is added to the training.

Each tensor gets two numbers:
- its float32 L2 norm, compared within a relative tolerance. A norm says how
  far apart replicas are, but it is blunt: a zero-mean perturbation of a
  tensor of n elements moves it by about 1/sqrt(n) of the perturbation's own
  relative size (a 1e-3 * randn nudge of a 6-million-element embedding
  moves its norm by ~1e-6, below any tolerance);
- an exact checksum of its bits: the sum of its elements' bit patterns read
  as integers, modulo 2**16, 2**32 or 2**64 by element size (one reduction
  kernel on the tensor's own memory, `Tensor.view(int dtype)`: no copy).
  Integer addition is associative, so the checksum does not depend on the
  reduction's order, device or thread count; any change of any element
  changes it (a collision needs the changes to cancel modulo 2**bits). DDP
  replicas hold the same bits (every rank applies the same all-reduced
  gradients with the same optimizer), as Megatron-LM's check of parameter
  hashes across data-parallel replicas also assumes, so any difference is
  a real divergence, however small.

Only what DDP promises to keep equal is compared:
- parameters at the end of an optimizer step (after the gradient allreduce),
  except those DDP was told to ignore (``_set_params_and_buffers_to_ignore``);
- buffers only right after DDP broadcast them from rank 0, which happens at
  the start of a forward when ``broadcast_buffers`` (``forward_sync_buffers``)
  is on and no custom buffer hook is set. At step end BatchNorm running
  statistics differ legitimately between replicas (each saw its own batch),
  and with ``broadcast_buffers=False`` they are never equal: then buffers are
  not compared at all. The buffer norms are taken in a forward pre-hook of the
  wrapped module, which runs after DDP's broadcast, and sent with the
  parameter norms of the step that preceded that forward.

Cost: under the same budget as the gradient checks. When a fingerprint costs
more than its share, the interval doubles (up to 64x); intervals stay powers
of two times the configured one, so ranks that adapted differently still
fingerprint common steps.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Any, Optional

import torch

from rankwatch.config import Config
from rankwatch.wire import StepRecord

from .grad_checks import fp32_norms
from ..core.safety import guarded
from ..core.torch_state import compiling
from ..core.weakrefs import WeakList, deref, weak

if TYPE_CHECKING:
    from ..core.ports import AddFingerprint, StepProgress

MAX_TENSORS = 8192
MAX_MULTIPLIER = 64
BUDGET_SHARE = 0.5  # of the gradient-check budget (the checks use the rest)


# An element's bits as an integer of its own size: the checksum sums these.
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
         torch.float64: torch.int64}
_PIECES = 4  # an int64 checksum travels as four int16 pieces (exact in float32, the deferred read's type)


def digest(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Device tensors to read (DeferredReads.submit) for ``tensors``: their
    float32 norms, then their bit checksums as int16 pieces. Read back with
    `read_digest`. No host-device copy: reductions, a stack and views."""
    if not tensors:
        return []
    return fp32_norms(tensors) + [_checksum_pieces(tensors)]


def _checksum_pieces(tensors: list[torch.Tensor]) -> torch.Tensor:
    sums = []
    for t in tensors:
        as_int = _BITS.get(t.dtype)
        if as_int is None or t.is_complex() or t.layout != torch.strided:
            sums.append(t.new_zeros((), dtype=torch.int64))  # not checksummed: equal on every rank
        else:
            # Summed in its own width (wrapping): a wider accumulator would make
            # ATen copy the whole tensor into that type first.
            sums.append(t.view(as_int).sum(dtype=as_int))
    # stack promotes mixed int16/int32/int64 sums to the widest, keeping every value.
    return torch.stack(sums).to(torch.int64).view(torch.int16)


def read_digest(values: list[float], count: int) -> tuple[list[float], list[int]]:
    """The host values of `digest` for ``count`` tensors -> (norms, checksums),
    each checksum folded to 32 bits."""
    norms = values[:count]
    pieces = values[count:count + _PIECES * count]
    sums = []
    for i in range(0, len(pieces), _PIECES):
        whole = 0
        for j, piece in enumerate(pieces[i:i + _PIECES]):
            whole |= (int(piece) & 0xFFFF) << (16 * j)
        sums.append((whole & 0xFFFFFFFF) ^ (whole >> 32))
    return norms, sums


def adapted(multiplier: int, every: int, budget: float, record: StepRecord, spent: float) -> int:
    """The interval's multiplier that keeps a fingerprint's amortised cost
    (``spent`` seconds every ``every * multiplier`` steps) within ``budget``
    of the step time: doubled when over, halved when far under."""
    duration = record.ended_at - record.started_at
    if budget <= 0 or duration <= 0:
        return multiplier
    allowed = budget * duration * every * multiplier
    if spent > allowed and multiplier < MAX_MULTIPLIER:
        return multiplier * 2
    if spent < allowed / 8 and multiplier > 1:
        return multiplier // 2
    return multiplier


def syncs_buffers_before_forward(ddp) -> bool:
    """DDP broadcasts this model's buffers from rank 0 at the start of a
    forward (the default; not with broadcast_buffers=False or a buffer hook)."""
    if hasattr(ddp, "buffer_hook"):
        return False  # a user's buffer hook may do anything (or run after the forward)
    flag = getattr(ddp, "forward_sync_buffers", None)
    if flag is None:
        flag = getattr(ddp, "broadcast_buffers", False)
    return bool(flag)


class Fingerprinter:
    @property
    def ddp(self) -> Any:
        """The DDP wrapper, while the script keeps it."""
        return deref(self._ddp)

    def __init__(self, ddp, every: int, *, config: Config, progress: "StepProgress",
                 add_fingerprint: "AddFingerprint", model: int = 0) -> None:
        self.add_fingerprint = add_fingerprint
        self._ddp = weak(ddp)  # a hook on the DDP keeps this alive: no cycle (agent/core/weakrefs.py)
        # Which of the job's DDP models (0 for the first): the collector compares
        # each model's prints with the same model's on the other ranks.
        self.model = model
        self.every = every
        self.multiplier = 1
        self.budget = config.grad_check_budget * BUDGET_SHARE
        ignored = set(getattr(ddp, "parameters_to_ignore", None) or ())
        self._ignored = ignored
        params = [(f"param:{n}", p) for n, p in ddp.module.named_parameters() if n not in ignored]
        buffers = [(f"buffer:{n}", b) for n, b in ddp.module.named_buffers()
                   if n not in ignored and b.is_floating_point() and b.numel() > 0]
        params = params[:MAX_TENSORS]
        buffers = buffers[: max(0, MAX_TENSORS - len(params))]
        self.param_names = [n for n, _ in params]
        self.params = [t for _, t in params]
        self.compare_buffers = bool(buffers) and syncs_buffers_before_forward(ddp)
        self.buffer_names = [n for n, _ in buffers] if self.compare_buffers else []
        self.buffer_module = ddp.module
        self.names = self.param_names + self.buffer_names  # one list, shared by every fingerprint sent
        self.reader = progress.reads  # the device adapter's deferred reads (agent/core/device.py)
        # Parameter norms waiting for the buffer norms of the next synchronised forward.
        self._pending: Optional[tuple[int, list[torch.Tensor]]] = None
        self._syncing = False
        self._buffer_spent = 0.0
        self._handles: list[Any] = []
        if self.compare_buffers:
            self._handles.append(ddp.register_forward_pre_hook(self._before_ddp_forward))
            self._handles.append(ddp.module.register_forward_pre_hook(self._after_buffer_sync))
        self.progress = progress
        progress.step_extras.append(self._on_step_end)

    def retire(self) -> None:
        """Its DDP model was freed (agent/core/weakrefs.py): unhook (the inner
        module may live on without DDP), let go of the model's tensors."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.params, self.buffer_module, self._pending = [], None, None
        self.compare_buffers = False
        self.progress.remove_extras(self)

    @property
    def interval(self) -> int:
        return self.every * self.multiplier

    # -- step end (training thread) --------------------------------------------------
    @guarded("fingerprints")
    def _on_step_end(self, record: StepRecord) -> None:
        # record.step just completed: fingerprint the weights it produced.
        if (record.step + 1) % self.interval:
            return
        started = time.perf_counter()
        if self._pending is not None:
            # No synchronised forward since the last fingerprint (buffers never
            # broadcast in between): send the parameters alone.
            self._submit(*self._pending, [])
            self._pending = None
        with torch.no_grad():
            values = digest([t.detach() for t in self.params])
        if self.compare_buffers:
            self._pending = (record.step, values)
        else:
            self._submit(record.step, values, [])
        spent, self._buffer_spent = time.perf_counter() - started + self._buffer_spent, 0.0
        self.multiplier = adapted(self.multiplier, self.every, self.budget, record, spent)

    # -- buffers, right after DDP's broadcast ---------------------------------------
    @guarded("fingerprints.buffers")
    def _before_ddp_forward(self, module, inputs) -> None:
        # Evaluated by DDP itself a moment later, in the same state: will this
        # forward broadcast the buffers from rank 0?
        self._syncing = self._pending is not None and bool(module._check_sync_bufs_pre_fwd())

    @guarded("fingerprints.buffers")
    def _after_buffer_sync(self, module, inputs) -> None:
        syncing, self._syncing = self._syncing, False
        if not syncing or self._pending is None or compiling():
            return
        step, param_values = self._pending
        self._pending = None
        started = time.perf_counter()
        current = [(f"buffer:{n}", b) for n, b in self.buffer_module.named_buffers()
                   if n not in self._ignored and b.is_floating_point() and b.numel() > 0]
        names = [n for n, _ in current][: len(self.buffer_names) + 1]
        buffers = [b for _, b in current][: len(self.buffer_names)]
        if names != self.buffer_names:  # buffers were added or replaced: compare parameters only
            self._submit(step, param_values, [])
            return
        with torch.no_grad():
            values = digest([b.detach() for b in buffers])
        self._submit(step, param_values, values)
        self._buffer_spent = time.perf_counter() - started  # counted at the next adaptation

    @guarded("fingerprints")
    def flush(self) -> None:
        """At exit: the last parameter fingerprint goes out even if no forward followed it."""
        if self._pending is not None:
            self._submit(*self._pending, [])
            self._pending = None

    def _submit(self, step: int, param_values: list[torch.Tensor], buffer_values: list[torch.Tensor]) -> None:
        names = self.names if buffer_values else self.param_names
        values = param_values + buffer_values
        if not values:
            return
        extra = {"buffers": "after_broadcast"} if buffer_values else {}  # where DDP made them equal
        if self.model:
            extra["model"] = self.model
        params, buffers = len(self.param_names), len(self.buffer_names) if buffer_values else 0

        def consume(read: Optional[list[float]], step=step, names=names) -> None:
            if read is None:  # not readable (a graph capture, a stalled device)
                return
            norms, sums = read_digest(read, params)
            if buffers:
                buffer_norms, buffer_sums = read_digest(read[(1 + _PIECES) * params:], buffers)
                norms, sums = norms + buffer_norms, sums + buffer_sums
            self.add_fingerprint({"step": step, "names": names, "norms": norms, "sums": sums, **extra})

        self.reader.submit(values, consume)


def attach(ddp, *, config: Config, progress: "StepProgress", add_fingerprint: "AddFingerprint",
           model: int = 0) -> Optional[Fingerprinter]:
    every = config.fingerprint_every
    if every <= 0:
        return None
    return Fingerprinter(ddp, every, config=config, progress=progress, add_fingerprint=add_fingerprint, model=model)


# -- without DDP: through the optimizers' parameters ----------------------------------------------


def _plain(tensor: torch.Tensor) -> bool:
    """A whole tensor every replica holds (not a DTensor or an FSDP flat shard,
    whose norm would need a collective or differs by design)."""
    return (type(tensor).__name__ not in ("DTensor", "FlatParameter") and not getattr(tensor, "_is_flat_param", False)
            and not tensor.is_sparse and tensor.numel() > 0)


class OptimizerFingerprinter:
    """Replicas without a DDP wrapper (hand-written data parallelism: the
    script all-reduces the gradients itself): the parameters the optimizers
    update, named through agent/watch/models.py.

    At the first optimizer step, before it updates anything, one fingerprint
    of the parameters *and* their gradients (``"at": "start"``, step 0): the
    collector takes ranks whose averaged gradients are equal for replicas,
    and replicas whose parameters already differ then started apart
    (``unsynced_start``: no broadcast at the start). Ranks whose gradients
    differ are not replicas (model or pipeline parallelism, sharding): their
    fingerprints are not compared. Then every N steps, like the DDP
    fingerprints (``"source": "optimizer"``), under the same cost budget.
    Used only on ranks without a DDP model (one fingerprint stream a rank):
    ``ddp_modules`` is the runtime's list of the DDP wrappers built so far that still live.
    """

    def __init__(self, models, every: int, *, config: Config, progress: "StepProgress",
                 add_fingerprint: "AddFingerprint", ddp_modules: WeakList[Any]) -> None:
        self.add_fingerprint = add_fingerprint
        self.progress = progress
        self.ddp_modules = ddp_modules
        self.models = models
        self.every = every
        self.multiplier = 1
        self.budget = config.grad_check_budget * BUDGET_SHARE
        self.reader = progress.reads  # the rank's one poller of deferred device reads (Progress)
        self.started = False
        self._names: Optional[list[str]] = None
        self._version = -1
        self._params: list[Any] = []  # weak references
        models.on_optimizer_pre.append(self._before_first_step)
        progress.step_extras.append(self._on_step_end)

    def _active(self) -> bool:
        return not self.ddp_modules

    def _tensors(self) -> tuple[list[str], list[torch.Tensor]]:
        if self._version != self.models.version:
            self._version = self.models.version
            optimized = self.models.optimized()
            pairs = [(n, p) for n, p in self.models.named_parameters() if id(p) in optimized and _plain(p)]
            pairs = pairs[:MAX_TENSORS]
            self._names = [f"param:{n}" for n, _ in pairs]
            self._params = [weakref.ref(p) for _, p in pairs]  # a dropped model's are freed (core/weakrefs.py)
        params = [ref() for ref in self._params]
        if any(p is None for p in params):  # a model was dropped: wait for the next discovery
            return [], []
        return self._names or [], params

    @guarded("fingerprints.optimizer")
    def _before_first_step(self, optimizer) -> None:
        if self.started or not self._active():
            return
        self.started = True
        names, params = self._tensors()
        grads = [(n, p.grad) for n, p in zip(names, params)
                 if p.grad is not None and _plain(p.grad) and p.grad.shape == p.shape]
        if not params or not grads:
            return
        with torch.no_grad():
            norms = fp32_norms([p.detach() for p in params]) + fp32_norms([g.detach() for _, g in grads])
        all_names = names + ["grad:" + n[len("param:"):] for n, _ in grads]
        step = self.progress.step

        def consume(values: Optional[list[float]], step=step, names=all_names) -> None:
            if values is None:
                return  # not readable (a graph capture, a stalled device)
            self.add_fingerprint({"step": step, "names": names, "norms": values, "at": "start",
                                  "source": "optimizer"})

        self.reader.submit(norms, consume)

    @guarded("fingerprints.optimizer")
    def _on_step_end(self, record: StepRecord) -> None:
        interval = self.every * self.multiplier
        if not self.started or not self._active() or record.step == 0 or (record.step + 1) % interval:
            return
        started = time.perf_counter()
        names, params = self._tensors()
        if not params:
            return
        with torch.no_grad():
            values = digest([p.detach() for p in params])
        step = record.step

        def consume(read: Optional[list[float]], step=step, names=names) -> None:
            if read is None:
                return  # not readable (a graph capture, a stalled device)
            norms, sums = read_digest(read, len(names))
            self.add_fingerprint({"step": step, "names": names, "norms": norms, "sums": sums,
                                  "source": "optimizer"})

        self.reader.submit(values, consume)
        self.multiplier = adapted(self.multiplier, self.every, self.budget, record, time.perf_counter() - started)


def attach_optimizers(models, *, config: Config, progress: "StepProgress", add_fingerprint: "AddFingerprint",
                      ddp_modules: WeakList[Any]) -> Optional[OptimizerFingerprinter]:
    every = config.fingerprint_every
    if every <= 0 or models is None:
        return None
    return OptimizerFingerprinter(models, every, config=config, progress=progress, add_fingerprint=add_fingerprint,
                                  ddp_modules=ddp_modules)
