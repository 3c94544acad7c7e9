"""How this rank trains: facts every replica must share.

Ranks of one data-parallel job must train the same way. Each rank records,
cheaply, what it actually does, and the collector compares the ranks
(collector/analyses/config_divergence.py):

- module train/eval modes of the trained models: `nn.Module.train` (and so
  `eval`) is wrapped transparently; a mode is recorded when it *changes*,
  with the calling line, and summarised at the training backward (the mode
  the training forward ran in), never by walking the module tree per step
  (only after a `train()`/`eval()` call on a submodule);
- gradient clipping called or not, and its max norm / value
  (`torch.nn.utils.clip_grad_norm_`, `clip_grad_value_`, ...);
- autocast on or off and its dtype, read at each training forward;
- micro-batches (backwards after a training forward) per optimizer step;
- the GradScaler's loss scale, read at each `update()` (on CUDA through the
  deferred device read: no sync);
- parameter count, shapes and dtypes of the trained models;
- the batches per epoch of the DataLoader feeding the training forwards, and
  whether `torch.distributed.algorithms.Join` is in use;
- the data-parallel group the rank's DDP averages over (the ranks that must
  agree);
- values the user declares with `rankwatch.agent.expect_same(name, value)`.

These rarely change: they go to the collector as a `train_config` event
only when they do (the first step sends them all). Optimizer
hyper-parameters (lr, momentum/betas, weight decay, eps of every param
group) change every step under a scheduler: they travel as a per-step
digest in the step record (`optim_fp`, and the lead optimizer's first `lr`),
compared on the collector.
"""

from __future__ import annotations

import functools
import hashlib
import weakref
from typing import TYPE_CHECKING, Any, Optional

import torch

from rankwatch.wire import StepRecord

from ..watch import models as models_mod
from ..watch.models import Forward, TrainedModels, unwrap, user_site
from ..core.imports import ImportWatch
from ..core.patching import Patches, argument
from ..core.safety import guarded

if TYPE_CHECKING:
    from ..watch.loaders import LoaderTracker
    from ..core.ports import Emit, StepProgress

MASK = (1 << 52) - 1  # digests stay exact in any JSON reader's double
MAX_FACTS = 64
MAX_VALUE = 200
MAX_LISTED_MODULES = 8
HYPER = ("lr", "momentum", "betas", "weight_decay", "eps")
_MISSING = -1.0  # stands for an absent hyper-parameter in the digest (hash(None) is not stable across processes)


def _num(value: Any) -> Optional[float]:
    """A hyper-parameter as a float, without reading a device tensor (None)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and value.numel() == 1:
            return float(value)
        return None  # a capturable optimizer's device lr: reading it would sync
    return None


def _rounded(value: Optional[float]) -> float:
    """A digest part: None and NaN as fixed stand-ins (their hashes are not stable across processes)."""
    if value is None:
        return _MISSING
    if value != value:
        return 1.5e308
    return value


def bounded_value(value: Any) -> str:
    """A user's value as a short text: itself when short, else a digest."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= MAX_VALUE and "\n" not in text:
        return text
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:32]


def _fact_name(name: str) -> str:
    clean = "".join(c if c.isalnum() or c in "_.-" else "_" for c in str(name))[:48]
    return clean or "_"


class TrainConfig:
    def __init__(self, models: TrainedModels, loaders: Optional["LoaderTracker"], *, emit: "Emit",
                 progress: "StepProgress", patches: Patches, imports: ImportWatch) -> None:
        self.emit = emit
        self.progress = progress
        self.patches = patches
        self.imports = imports
        self.models = models
        self.loaders = loaders
        self.sent: dict[str, str] = {}
        self.sites: dict[str, str] = {}
        self.user: dict[str, str] = {}
        self.reader = progress.reads  # the rank's one poller of deferred device reads (Progress)
        self._stepped: list[Any] = []  # optimizers that stepped, build order kept
        self._stepped_ids: set[int] = set()
        # Modes: train()/eval() calls since the last summary, and the summary.
        self._in_train = False
        self._mode_version = 0
        self._mode_summary_version = -1
        self._uniform: dict[int, bool] = {}  # id(root module) -> its tree is in one mode
        self._mode_sites: dict[int, str] = {}  # id(root module) -> the last call touching it
        self._modes: dict[str, str] = {}
        self._mode_sampled = False
        # This step's observations.
        self._clips: list[str] = []
        self._autocast: Optional[str] = None
        self._backwards = 0
        self._scale: Optional[tuple[int, float]] = None  # (step, value) of the last update()
        self._deferred: list[tuple[int, str, str]] = []  # (step, key, value) read late from the device
        self._params_version = -1
        self._params_fact: Optional[str] = None
        self._replicas: Optional[str] = None
        self._training_loader = None

    # -- installation ----------------------------------------------------------------------
    def install(self) -> None:
        models = self.models
        models.on_training_forward.append(self._on_forward)
        models.on_training_backward.append(self._on_backward)
        models.on_optimizer_pre.append(self._on_optimizer_pre)
        self.progress.step_extras.append(self._on_step_end)
        self._patch_train()
        self._patch_clipping()
        self._patch_scaler()

    def _patch_train(self) -> None:
        config = self

        def make(original):
            @functools.wraps(original)
            def train(*args, **kwargs):
                if config._in_train:
                    return original(*args, **kwargs)  # the recursion into children
                config._in_train = True
                try:
                    result = original(*args, **kwargs)
                finally:
                    config._in_train = False
                if args:
                    mode = argument(original, args, kwargs, 1)
                    config._note_mode(args[0], True if mode is None else bool(mode))
                return result

            return train

        self.patches.apply(torch.nn.Module, "train", make)

    def _patch_clipping(self) -> None:
        import torch.nn.utils as utils
        import torch.nn.utils.clip_grad as clip_grad

        config = self

        def make(kind: str):
            def wrap(original):
                @functools.wraps(original)
                def clip(*args, **kwargs):
                    config._note_clip(kind, original, args, kwargs)
                    return original(*args, **kwargs)

                return clip

            return wrap

        for name, kind in (("clip_grad_norm_", "norm"), ("clip_grad_value_", "value"),
                           ("clip_grads_with_norm_", "norm")):
            original = getattr(clip_grad, name, None)
            if original is None:
                continue
            wrapper = self.patches.apply(clip_grad, name, make(kind))
            if wrapper is not None:
                self.patches.alias(utils, name, original, wrapper)
        def fsdp1_clip(fsdp) -> None:  # FSDP1's own method, once the job imports torch.distributed.fsdp
            owner = getattr(fsdp, "FullyShardedDataParallel", None)
            if owner is not None:
                self.patches.apply(owner, "clip_grad_norm_", lambda original: _method_clip(config, original))

        self.imports.when_imported("torch.distributed.fsdp", fsdp1_clip)

    def _patch_scaler(self) -> None:
        try:
            from torch.amp.grad_scaler import GradScaler
        except ImportError:
            return
        config = self

        def make(original):
            @functools.wraps(original)
            def update(*args, **kwargs):
                result = original(*args, **kwargs)
                if args:
                    config._note_scale(args[0])
                return result

            return update

        self.patches.apply(GradScaler, "update", make)

    # -- observations (training thread) --------------------------------------------------------------
    @guarded("train_config.mode")
    def _note_mode(self, module: Any, mode: bool) -> None:
        self._mode_version += 1
        roots = {id(r.module): r for r in self.models.roots}
        top, _ = unwrap(self.models._top_module(module))
        root = roots.get(id(top))
        if root is None:
            return  # not a trained model (an EMA copy, a teacher, an evaluation-only model)
        # A call on the model itself leaves its whole tree in one mode; one on a
        # submodule may leave the tree mixed (walked once, at the next summary).
        whole = module is root.module or module is root.ddp or unwrap(module)[0] is root.module
        self._uniform[id(root.module)] = whole
        site = user_site()
        if site:
            self._mode_sites[id(root.module)] = site

    def _mode_of_roots(self) -> dict[str, str]:
        """{"mode" (or "mode.<root>"): "train" | "eval" | "train; eval: a, b"}: the model's mode and
        the modules that switch to another one. The tree is walked only after a
        train()/eval() call on a submodule, never per step."""
        if self._mode_summary_version == self._mode_version and self._modes:
            return self._modes
        roots = self.models.roots
        out = {}
        for root in roots:
            module = root.module
            base = "train" if module.training else "eval"
            switches: dict[str, list[str]] = {}
            if not self._uniform.get(id(module), True):
                modes = {"": module.training}
                for name, sub in module.named_modules():
                    if not name:
                        continue
                    parent = name.rsplit(".", 1)[0] if "." in name else ""
                    modes[name] = sub.training
                    if sub.training != modes.get(parent, module.training):
                        switches.setdefault("train" if sub.training else "eval", []).append(name)
            key = "mode" if len(roots) == 1 else f"mode.{root.label}"
            value = base
            for mode in ("eval", "train"):
                names = switches.get(mode)
                if names:
                    more = f" +{len(names) - MAX_LISTED_MODULES} more" if len(names) > MAX_LISTED_MODULES else ""
                    value += f"; {mode}: {', '.join(names[:MAX_LISTED_MODULES])}{more}"
            out[key] = bounded_value(value)
            site = self._mode_sites.get(id(module))
            if site:
                self.sites[key] = site
        self._modes = out
        self._mode_summary_version = self._mode_version
        return out

    @guarded("train_config.clip")
    def _note_clip(self, kind: str, original, args: tuple, kwargs: dict) -> None:
        limit = argument(original, args, kwargs, 1)
        if kind == "norm":
            norm_type = argument(original, args, kwargs, 2)
            text = f"norm {_short(limit)}"
            if norm_type is not None and _num(norm_type) not in (None, 2.0):
                text += f" (L{_short(norm_type)})"
        else:
            text = f"value {_short(limit)}"
        if text not in self._clips and len(self._clips) < 8:
            self._clips.append(text)
            if text not in self.sent.get("clip", "") and not self.sites.get("clip"):
                self.sites["clip"] = user_site() or ""  # only when clipping changes: a frame walk

    @guarded("train_config.scale")
    def _note_scale(self, scaler: Any) -> None:
        scale = getattr(scaler, "_scale", None)
        if not isinstance(scale, torch.Tensor) or not getattr(scaler, "_enabled", True):
            return
        step = self.progress.step
        if models_mod.on_host(scale):
            self._scale = (step, float(scale.reshape(-1)[0]))
            return

        def consume(values: Optional[list[float]], step=step) -> None:
            if values:
                self._scale = (step, values[0])
                self._deferred.append((step, "loss_scale", _short(values[0])))

        self.reader.submit([scale.reshape(-1)[:1]], consume)

    @guarded("train_config.forward")
    def _on_forward(self, forward: Forward) -> None:
        if not forward.training:
            return  # a grad-enabled evaluation forward (one rank validating) says nothing of training
        self._autocast = _autocast_state()
        if self.loaders is not None:
            self._training_loader = self.loaders.last

    @guarded("train_config.backward")
    def _on_backward(self, forwards: list[Forward]) -> None:
        self._backwards += 1
        self._modes = self._mode_of_roots()
        self._mode_sampled = True

    @guarded("train_config.optimizer")
    def _on_optimizer_pre(self, optimizer: Any) -> None:
        if id(optimizer) not in self._stepped_ids:
            self._stepped_ids.add(id(optimizer))
            self._stepped.append(weakref.ref(optimizer))

    def expect_same(self, name: str, value: Any) -> None:
        from rankwatch.redact import is_secret_name

        key = f"user.{_fact_name(name)}"
        if key not in self.user and len(self.user) >= 16:
            return
        text = bounded_value(value)
        if is_secret_name(name.replace("tokenizer", "").replace("Tokenizer", "")) and not text.startswith("sha256:"):
            # a secret-looking name: only a digest leaves the process
            text = "sha256:" + hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:32]
        self.user[key] = text
        self.sites[key] = user_site() or ""

    # -- step end --------------------------------------------------------------------------------------
    def _optimizers_stepped(self) -> list[Any]:
        order = {id(o): i for i, o in enumerate(self.models.optimizers())}
        alive = [o for o in (ref() for ref in self._stepped) if o is not None]
        return sorted(alive, key=lambda o: order.get(id(o), 1 << 30))

    def optimizer_digest(self) -> tuple[Optional[int], Optional[float]]:
        """(hash of every stepped optimizer's per-group hyper-parameters, the lead
        optimizer's first learning rate). Exact values: every rank computes its
        schedule the same way. Per step: a few attribute reads per group."""
        parts: list[Any] = []
        append = parts.append
        for opt in self._optimizers_stepped():
            append(-3.0)  # an optimizer's groups begin
            for group in getattr(opt, "param_groups", ()):
                get = group.get
                for key in HYPER:
                    value = get(key)
                    kind = type(value)
                    if kind is int or (kind is float and value == value):
                        append(value)
                    elif value is None:
                        append(_MISSING)  # hash(None) differs between processes before Python 3.12
                    elif kind is tuple:
                        if all(type(v) is float and v == v for v in value):
                            parts.extend(value)  # betas
                        else:
                            parts.extend(_rounded(_num(v)) for v in value[:4])
                    else:
                        append(_rounded(_num(value)))
        if not parts:
            return None, None
        lead = self.progress.lead_optimizer()
        lr = None
        groups = getattr(lead, "param_groups", None)
        if groups:
            lr = _num(groups[0].get("lr"))
        return hash(tuple(parts)) & MASK, (lr if lr is not None and 0 <= lr <= 1e12 else None)

    def _params_facts(self) -> dict[str, str]:
        if self._params_version == self.models.version:
            return {"params": self._params_fact} if self._params_fact else {}
        self._params_version = self.models.version
        params = self.models.named_parameters()
        self._params_fact = None
        if not params or any(_sharded(p) for _, p in params):
            return {}  # sharded (FSDP, tensor parallel): ranks hold different pieces by design
        numel = sum(p.numel() for _, p in params)
        dtypes: dict[str, int] = {}
        for _, p in params:
            name = str(p.dtype).replace("torch.", "")
            dtypes[name] = dtypes.get(name, 0) + 1
        shapes = hash(tuple(d for _, p in params for d in (len(p.shape), *p.shape))) & MASK
        self._params_fact = (f"{len(params)} tensors, {numel} elements, "
                             f"{', '.join(f'{k} x{v}' for k, v in sorted(dtypes.items()))} (shapes #{shapes:013x})")
        return {"params": self._params_fact}

    def _replica_group(self) -> str:
        if self._replicas is not None:
            return self._replicas
        groups = set()
        for root in self.models.roots:
            if root.ddp is None:
                continue
            try:
                import torch.distributed as dist

                ranks = tuple(dist.get_process_group_ranks(root.ddp.process_group))
            except Exception:
                continue
            groups.add((len(ranks), hash(ranks) & MASK))
        if len(groups) == 1:
            size, digest = groups.pop()
            self._replicas = f"ddp:{size}:{digest:013x}"
        elif not groups and self.models.discovered:
            self._replicas = "none"
        return self._replicas or "none"

    def current(self) -> dict[str, str]:
        facts: dict[str, str] = {}
        facts.update(self._mode_of_roots() if not self._mode_sampled else self._modes)
        facts["clip"] = "; ".join(self._clips) if self._clips else "none"
        if self._autocast is not None:
            facts["autocast"] = self._autocast
        facts["micro_batches"] = str(self._backwards)
        if self._scale is not None:
            facts["loss_scale"] = _short(self._scale[1])
        facts.update(self._params_facts())
        loader = self._training_loader
        if loader is not None and loader.batches is not None:
            facts["batches_per_epoch"] = str(loader.batches)  # not the samples: an uneven last batch is fine
        if self.loaders is not None and self.loaders.join_used:
            facts["join"] = "yes"
        facts["replicas"] = self._replica_group()
        facts.update(self.user)
        return facts

    @guarded("train_config.step")
    def _on_step_end(self, record: StepRecord) -> None:
        record.optim_fp, record.lr = self.optimizer_digest()
        if not self.models.discovered:
            return
        # Values read late from the device first, each with the step it belongs to.
        for step, key, value in self._deferred:
            if self.sent.get(key) != value:
                self.sent[key] = value
                self.emit("train_config", step=step, facts=[[key, value]])
        self._deferred = []
        facts = self.current()
        changed = {k: v for k, v in facts.items() if self.sent.get(k) != v}
        removed = [k for k in self.sent if k not in facts and not k.startswith("user.")]
        for key in removed:
            changed[key] = ""
        if changed:
            keys = list(changed)[:MAX_FACTS]
            # [name, value] pairs, not a mapping: a fact's name ("user.tokenizer")
            # must not read as a secret's name to the redaction (values still are checked).
            details: dict[str, Any] = {"facts": [[k, changed[k]] for k in keys]}
            sites = [[k, self.sites[k]] for k in keys if self.sites.get(k)]
            if sites:
                details["sites"] = sites
            self.emit("train_config", step=record.step, **details)
            for key in keys:
                if changed[key]:
                    self.sent[key] = changed[key]
                else:
                    self.sent.pop(key, None)
        self._clips = []
        self.sites.pop("clip", None)
        self._backwards = 0
        self._mode_sampled = False


def _method_clip(config: TrainConfig, original):
    @functools.wraps(original)
    def clip_grad_norm_(*args, **kwargs):
        # FSDP's own clip_grad_norm_(self, max_norm, norm_type): the limit is argument 1 as for torch's.
        config._note_clip("norm", original, args, kwargs)
        return original(*args, **kwargs)

    return clip_grad_norm_


def _short(value: Any) -> str:
    number = _num(value)
    if number is None:
        return str(value)[:32]
    return f"{number:.6g}"


def _sharded(param: Any) -> bool:
    return type(param).__name__ in ("DTensor", "FlatParameter") or bool(getattr(param, "_is_flat_param", False))


def _autocast_state() -> str:
    out = []
    for device in ("cuda", "cpu"):
        try:
            enabled = torch.is_autocast_enabled(device)
        except TypeError:  # an older torch: one flag per device
            enabled = torch.is_autocast_enabled() if device == "cuda" else torch.is_autocast_cpu_enabled()
        if enabled:
            try:
                dtype = torch.get_autocast_dtype(device)
            except (AttributeError, TypeError):
                dtype = torch.get_autocast_gpu_dtype() if device == "cuda" else torch.get_autocast_cpu_dtype()
            out.append(f"{device} {str(dtype).replace('torch.', '')}")
    return ", ".join(out) if out else "off"


def attach(models: Optional[TrainedModels], loaders: Optional["LoaderTracker"], *, emit: "Emit",
           progress: "StepProgress", patches: Patches, imports: ImportWatch) -> Optional[TrainConfig]:
    if models is None:
        return None
    config = TrainConfig(models, loaders, emit=emit, progress=progress, patches=patches, imports=imports)
    config.install()
    return config
