"""faultbench's fault injector: one fault, on one rank, at one optimizer step,
put into an unmodified training script from outside through torch's own hooks.

Loaded by the `sitecustomize.py` next to it (this folder first on PYTHONPATH),
so the same injector runs under plain torchrun, under `rankwatch run` and in
Ray Train's workers, and every tool sees the same fault. It waits for torch to
be imported, then installs:

- torch's global optimizer step post-hook (`register_optimizer_step_post_hook`):
  counts this rank's optimizer steps (the first optimizer that steps is the
  clock) and injects what happens at a step's end (weight perturbation, an
  extra collective, a leak, broken `zero_grad`);
- global module forward hooks (`register_module_forward_pre_hook` /
  `register_module_forward_hook`), only on the culprit rank and only from the
  fault's step on: what happens inside a forward (hang, exception, SIGKILL,
  early exit, allocation failure, a slow rank, eval mode), and on the first
  leaf module's output a NaN or a gradient hook (`Tensor.register_hook`);
- `_BaseDataLoaderIter.__next__` (DataLoader) for the data faults;
- `init_process_group`: every process group gets FAULTBENCH_PG_TIMEOUT
  seconds as its collective timeout (the same on every side of a comparison,
  what a user sets with Lightning's `DDPStrategy(timeout=)`, HF's
  `ddp_timeout`, Ray's `TorchConfig(timeout_s=)`), and, with FAULTBENCH_FR_DIR
  set, this rank's Flight Recorder is dumped there every second and at exit
  (what torch's debug server does with `dump_interval`; gloo never dumps by
  itself).

Ground truth: when the fault fires, one JSON line (kind, rank, step = this
rank's completed optimizer steps, wall time, detail) is appended to
FAULTBENCH_TRUTH and fsynced before the fault acts.

Environment: FAULTBENCH_KIND (a kind below, or "none"), FAULTBENCH_RANK (the
culprit's global rank), FAULTBENCH_STEP, FAULTBENCH_VARIANT, FAULTBENCH_SEED,
FAULTBENCH_TRUTH, FAULTBENCH_PG_TIMEOUT, FAULTBENCH_FR_DIR.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Optional

KINDS = (
    "none", "hang", "dataloader_hang", "early_exit", "crash", "sigkill", "oom", "collective_mismatch",
    "nan_loss", "nan_grad", "grad_spike", "weight_divergence", "straggler", "leak",
    "config_divergence", "duplicate_data", "broken_update",
)
FORWARD_KINDS = ("hang", "crash", "sigkill", "early_exit", "oom", "straggler", "config_divergence")
LEAF_KINDS = ("nan_loss", "nan_grad", "grad_spike")
DATA_KINDS = ("dataloader_hang", "duplicate_data")

KIND = os.environ.get("FAULTBENCH_KIND", "")
CULPRIT = int(os.environ.get("FAULTBENCH_RANK") or -1)
STEP = int(os.environ.get("FAULTBENCH_STEP") or -1)
VARIANT = os.environ.get("FAULTBENCH_VARIANT", "")
SEED = int(os.environ.get("FAULTBENCH_SEED") or 0)
TRUTH = os.environ.get("FAULTBENCH_TRUTH", "")
PG_TIMEOUT = float(os.environ.get("FAULTBENCH_PG_TIMEOUT") or 0)
FR_DIR = os.environ.get("FAULTBENCH_FR_DIR", "")
# The fault's size, for sensitivity sweeps (bench/sensitivity_jobs.py); empty: the defaults below.
#   weight_divergence: a relative nudge of the largest tensor, p *= 1 + M * randn (or "nan"/"inf":
#   that value in one of its elements); nan_loss / nan_grad with VARIANT "one": the value ("nan",
#   "inf") in one element; config_divergence with VARIANT "lr": the culprit's learning rate x M;
#   duplicate_data: the share M of each batch's rows repeated from the fault step's batch.
MAGNITUDE = os.environ.get("FAULTBENCH_MAGNITUDE", "")

LEAK_BYTES = 16 << 20  # per step, kept alive
SPIKE_FACTOR = 1e4
PERTURB_SCALE = 1e-3


def _rank() -> int:
    # Read at each use: Ray Train sets RANK in a worker after the process started.
    return int(os.environ.get("RANK") or -1)


def _culprit() -> bool:
    return KIND not in ("", "none") and _rank() == CULPRIT


class _State:
    lead: Any = None  # the optimizer whose steps are the clock
    steps = 0  # optimizer steps this rank has completed
    last_step_at: Optional[float] = None
    durations: list = []
    forward_step = -1  # the step whose first forward was handled
    leaf_done = False
    recorded = False
    straggle_s = 0.0
    break_handle: Any = None
    repeat_batch: Any = None
    leaked: list = []
    forward_handles: list = []


S = _State()


def record(detail: Optional[dict] = None, step: Optional[int] = None) -> None:
    """The ground truth, written once, before the fault acts (it may kill us)."""
    if S.recorded or not TRUTH:
        return
    S.recorded = True
    line = json.dumps({"kind": KIND, "rank": _rank(), "step": S.steps if step is None else step,
                       "time": time.time(), "pid": os.getpid(), "variant": VARIANT, "detail": detail or {}})
    fd = os.open(TRUTH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _hang_forever() -> None:
    while True:  # a stuck rank: a deadlock, a lost lock, a read that never returns
        time.sleep(3600)


# ---------------------------------------------------------------- optimizer --

def _after_optimizer_step(optimizer, args, kwargs) -> None:
    import weakref

    if S.lead is None:
        S.lead = weakref.ref(optimizer)
    if S.lead() is not optimizer:
        return
    now = time.monotonic()
    if S.last_step_at is not None:
        S.durations.append(now - S.last_step_at)
    S.last_step_at = now
    ending = S.steps  # the step that ends now
    if _culprit():
        if KIND == "weight_divergence" and ending == STEP:
            _nudge(optimizer) if MAGNITUDE else _perturb(optimizer)
        elif KIND == "config_divergence" and VARIANT == "lr" and ending == STEP:
            factor = float(MAGNITUDE or 2.0)
            record({"lr_factor": factor})
            for group in optimizer.param_groups:  # this rank's learning rate from now on
                group["lr"] = group["lr"] * factor
        elif KIND == "collective_mismatch" and ending == STEP:
            _extra_collective()
        elif KIND == "leak" and ending >= STEP:
            record({"bytes_per_step": LEAK_BYTES})
            import torch

            S.leaked.append(torch.ones(LEAK_BYTES, dtype=torch.uint8))  # never freed
    S.steps += 1
    if _culprit():
        if KIND == "broken_update" and S.steps == STEP:
            _break_zero_grad()
        if S.steps == STEP and (KIND in FORWARD_KINDS or KIND in LEAF_KINDS) and VARIANT != "lr":
            _arm_forward_hooks()


def _perturb(optimizer) -> None:
    import torch

    g = torch.Generator().manual_seed(SEED)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    record({"params": len(params), "scale": PERTURB_SCALE})
    with torch.no_grad():  # this replica's weights drift from the others' (a bit flip, a bad write)
        for p in params:
            local = p.to_local() if hasattr(p, "to_local") else p  # an FSDP2 shard: its local part
            local.add_(PERTURB_SCALE * torch.randn(local.shape, generator=g, dtype=local.dtype))


def _nudge(optimizer) -> None:
    """The largest tensor the optimizer updates, nudged once on this replica:
    relatively (``MAGNITUDE`` a number) or one element set to nan/inf."""
    import torch

    g = torch.Generator().manual_seed(SEED)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    target = max(params, key=lambda p: p.numel())
    local = target.to_local() if hasattr(target, "to_local") else target
    with torch.no_grad():
        if MAGNITUDE in ("nan", "inf"):
            index = int(torch.randint(local.numel(), (1,), generator=g))
            local.view(-1)[index] = float(MAGNITUDE)
            record({"elements": local.numel(), "changed": 1, "value": MAGNITUDE})
            return
        before = local.detach().clone()
        local.mul_(1 + float(MAGNITUDE) * torch.randn(local.shape, generator=g, dtype=local.dtype))
        changed = int((local != before).sum())
    record({"elements": local.numel(), "changed": changed, "relative": float(MAGNITUDE)})


def _one(tensor, value: float):
    out = tensor.clone()
    out.view(-1)[0] = value
    return out


def _extra_collective() -> None:
    import torch
    import torch.distributed as dist

    size = 8 if VARIANT == "small" else 1_000_000
    record({"op": "all_reduce", "numel": size})
    dist.all_reduce(torch.ones(size))  # a collective only this rank issues


def _break_zero_grad() -> None:
    """Gradients are never cleared on the culprit from now on. Checked at each
    call: a step-0 fault is armed at torch's import, before the rank is known
    (Ray Train sets RANK in the worker later); the ground truth is written at
    the first call it swallows."""
    import torch

    def broken(original):
        def zero_grad(self, *args, **kwargs):
            if not _culprit():
                return original(self, *args, **kwargs)
            record({"patched": ["torch.optim.Optimizer.zero_grad", "torch.nn.Module.zero_grad"]})
            return None

        return zero_grad

    torch.optim.Optimizer.zero_grad = broken(torch.optim.Optimizer.zero_grad)
    torch.nn.Module.zero_grad = broken(torch.nn.Module.zero_grad)


# ------------------------------------------------------------------ forward --

def _arm_forward_hooks() -> None:
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    if S.durations:
        ordered = sorted(S.durations[1:] or S.durations)
        S.straggle_s = max(0.03, ordered[len(ordered) // 2])
    if KIND in FORWARD_KINDS:
        S.forward_handles.append(register_module_forward_pre_hook(_before_forward))
    if KIND in LEAF_KINDS:
        S.forward_handles.append(register_module_forward_hook(_after_forward))


def _disarm() -> None:
    for handle in S.forward_handles:
        handle.remove()
    S.forward_handles.clear()


def _before_forward(module, args):
    if not _culprit():  # armed before the rank was known (a step-0 fault): not this rank's
        _disarm()
        return None
    if S.forward_step == S.steps:
        return None  # only the first (outermost) module call of a step
    S.forward_step = S.steps
    if KIND == "hang":
        record({"where": type(module).__name__ + ".forward"})
        _hang_forever()
    elif KIND == "crash":
        record({"exception": "RuntimeError"})
        raise RuntimeError(f"faultbench: injected failure on rank {_rank()} at step {S.steps}")
    elif KIND == "sigkill":
        record({"signal": "SIGKILL"})
        os.kill(os.getpid(), signal.SIGKILL)
    elif KIND == "early_exit":
        record({"exit": 0})
        _disarm()
        sys.exit(0)  # this rank leaves the training while its peers go on
    elif KIND == "oom":
        import torch

        size = 4 * _host_memory_bytes()
        record({"bytes": size})
        _disarm()
        torch.empty(size, dtype=torch.uint8)  # more than the host has: the CPU allocator fails
    elif KIND == "straggler":
        if S.straggle_s <= 0.0:
            if not S.durations:
                return None  # armed before any step time was known: slow down from the next step
            S.straggle_s = max(0.03, sorted(S.durations)[len(S.durations) // 2])
        record({"extra_s_per_step": round(S.straggle_s, 4)})
        time.sleep(S.straggle_s)  # this rank's compute takes about twice as long from now on
    elif KIND == "config_divergence":
        if module.training:
            record({"mode": "eval", "module": type(module).__name__})
            module.eval()  # this rank trains in eval mode (dropout off) from now on
    return None


def _after_forward(module, args, output):
    import torch

    if not _culprit():  # armed before the rank was known (a step-0 fault): not this rank's
        _disarm()
        return None
    if S.leaf_done or module._modules or not isinstance(output, torch.Tensor):
        return None
    if not output.is_floating_point() or (KIND != "nan_loss" and not output.requires_grad):
        return None
    S.leaf_done = True
    _disarm()
    where = {"module": type(module).__name__}
    if VARIANT == "one":  # one element of the first layer's output (or of its gradient)
        value = float(MAGNITUDE or "nan")
        record({**where, "elements": 1, "value": MAGNITUDE or "nan"})
        if KIND == "nan_loss":
            return _one(output, value)
        if KIND == "nan_grad":
            output.register_hook(lambda grad: _one(grad, value))
            return None
    if KIND == "nan_loss":
        record(where)
        return output * float("nan")  # a NaN activation: the loss is NaN
    if KIND == "nan_grad":
        record(where)
        output.register_hook(lambda grad: grad * float("nan"))  # the loss stays finite
    elif KIND == "grad_spike":
        record({**where, "factor": SPIKE_FACTOR})
        output.register_hook(lambda grad: grad * SPIKE_FACTOR)
    return None


def _host_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 1 << 40


# --------------------------------------------------------------------- data --

def _clone(batch: Any) -> Any:
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, dict):
        return type(batch)({k: _clone(v) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_clone(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_clone(v) for v in batch)
    return batch


def _mixed(batch: Any, repeated: Any, share: float) -> Any:
    """``batch`` with its first ``share`` of rows taken from ``repeated``."""
    import math

    import torch

    if isinstance(batch, torch.Tensor):
        if not isinstance(repeated, torch.Tensor) or batch.shape != repeated.shape or batch.dim() == 0:
            return batch
        out = batch.clone()
        rows = math.ceil(share * batch.shape[0])
        out[:rows] = repeated[:rows]
        return out
    if isinstance(batch, dict) and isinstance(repeated, dict):
        return type(batch)({k: _mixed(v, repeated.get(k), share) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)) and isinstance(repeated, (list, tuple)) and len(batch) == len(repeated):
        items = [_mixed(a, b, share) for a, b in zip(batch, repeated)]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


def _patch_dataloader() -> None:
    from torch.utils.data import dataloader

    original = dataloader._BaseDataLoaderIter.__next__

    def __next__(self):
        if not _culprit():
            return original(self)
        if KIND == "dataloader_hang" and S.steps == STEP:
            record({"where": "DataLoader.__next__"})
            _hang_forever()
        batch = original(self)
        if KIND == "duplicate_data" and S.steps >= STEP:
            share = float(MAGNITUDE or 1.0)
            if S.repeat_batch is None:
                record({"repeats": "the batch of this step, from now on", "share": share})
                S.repeat_batch = _clone(batch)
            if share < 1.0:
                return _mixed(batch, S.repeat_batch, share)  # part of each batch the same rows
            return _clone(S.repeat_batch)  # the same batch step after step
        return batch

    dataloader._BaseDataLoaderIter.__next__ = __next__


# -------------------------------------------------------- process groups --

def _patch_init_process_group() -> None:
    import datetime
    import inspect

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.init_process_group
    signature = inspect.signature(original)

    def init_process_group(*args, **kwargs):
        if PG_TIMEOUT > 0:
            bound = signature.bind(*args, **kwargs)
            bound.arguments["timeout"] = datetime.timedelta(seconds=PG_TIMEOUT)
            args, kwargs = bound.args, bound.kwargs
        result = original(*args, **kwargs)
        if FR_DIR:
            _start_flight_recorder_dumps()
        return result

    init_process_group.__wrapped__ = original
    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group


def _dump_flight_recorder() -> None:
    """This rank's Flight Recorder in the format fr_trace reads (torch's
    pickle dump), as `fr_<rank>`."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    rank = dist.get_rank()
    c10d = torch._C._distributed_c10d
    if not json.loads(c10d._dump_fr_trace_json(True, False)).get("pg_config"):
        return  # after destroy_process_group: keep the last dump that knows its groups
    dump = c10d._dump_fr_trace()
    path, partial = os.path.join(FR_DIR, f"fr_{rank}"), os.path.join(FR_DIR, f".partial-{rank}")
    with open(partial, "wb") as f:  # a name fr_trace's loader does not pick up
        f.write(dump)
    os.replace(partial, path)


def _start_flight_recorder_dumps() -> None:
    os.makedirs(FR_DIR, exist_ok=True)

    def loop() -> None:
        while True:
            try:
                _dump_flight_recorder()
            except Exception:
                pass
            time.sleep(1.0)

    threading.Thread(target=loop, name="faultbench-fr-dump", daemon=True).start()
    atexit.register(lambda: _safe(_dump_flight_recorder))


def _safe(fn) -> None:
    try:
        fn()
    except Exception:
        pass


# ------------------------------------------------------------ installation --

def _on_torch_imported() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _patch_init_process_group()
    if KIND in ("none", ""):
        return
    register_optimizer_step_post_hook(_after_optimizer_step)
    if KIND in DATA_KINDS:
        _patch_dataloader()
    if STEP == 0 and (KIND in FORWARD_KINDS or KIND in LEAF_KINDS) and VARIANT != "lr":
        _arm_forward_hooks()  # armed at once; the rank is only known at the first forward
    if STEP == 0 and KIND == "broken_update":
        # A step-0 fault was never armed at a50cb18. Broken at the first forward,
        # after the job's own set-up (a watcher's wrapper of zero_grad included,
        # as when it breaks at a later step), before any gradient exists.
        from torch.nn.modules.module import register_module_forward_pre_hook

        def break_at_first_forward(module, args):
            S.break_handle.remove()
            _break_zero_grad()

        S.break_handle = register_module_forward_pre_hook(break_at_first_forward)


class _TorchImportWatcher(importlib.abc.MetaPathFinder):
    """Runs `_on_torch_imported` right after `import torch` completes."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            try:
                _on_torch_imported()
            except Exception as exc:
                sys.stderr.write(f"[faultbench] injector not installed: {exc!r}\n")

        spec.loader.exec_module = exec_then_install
        return spec


def install() -> None:
    if KIND not in KINDS:
        raise ValueError(f"FAULTBENCH_KIND={KIND!r}: not one of {', '.join(KINDS)}")
    if "torch" in sys.modules:
        _on_torch_imported()
    else:
        sys.meta_path.insert(0, _TorchImportWatcher())
