"""What this rank trains: its root modules, their parameters, its optimizers.

Found without DDP, and without a hook on every module call:

- torch's global *registration* hooks (``register_module_module_registration_hook``,
  ``register_module_parameter_registration_hook``) record, as the script
  builds its models, which module holds which child and which parameter.
  They fire once per module or parameter at build time, never per forward,
  and (unlike global forward hooks) do not make ``torch.compile`` warn.
- every optimizer is seen when it is built (``Optimizer.add_param_group``)
  and when it steps (torch's global optimizer step hooks).
- at the first optimizer step (and again after the model tree or the
  optimizers change) each optimized parameter is walked up to its topmost
  module: the *root*. DDP and ``torch.compile`` wrappers are unwrapped to the
  user's module; parameter names come from the roots (``named_parameters``).

A root gets one forward pre-hook, and a DDP wrapper a pre- and a post-hook,
so every grad-enabled forward of a root is seen with *how* it ran: through
DDP's forward (``ddp``: its gradients are averaged), through DDP inside
``no_sync()`` (``no_sync``), straight through ``ddp.module`` (``module``: DDP
never sees that backward) or without DDP (``direct``). Modules built before
the agent attached are still found through their DDP wrapper; an optimized
parameter without a known module gets a positional name
(``optimizer0.group1.3``).

API (shared by the silent-error checks and the GPU checks, which the runtime
builds with it):

    models = attach(config=..., progress=...)  # None when silent_checks is off
    models.roots                               # [Root]: module, label, ddp wrapper or None
    models.optimizers()                        # every optimizer, in the order they were built
    models.named_parameters()                  # [(name, param)] of every root
    models.name_of(param)                      # its name, or None
    models.optimized()                         # {id(param): (optimizer index, group index)}
    models.version                             # bumps at every (re-)discovery
    models.on_discovered.append(fn)            # fn() after each discovery
    models.on_training_forward.append(fn)      # fn(Forward) per grad-enabled forward of a root
    models.on_training_backward.append(fn)     # fn([Forward]) per backward that follows some
    models.on_optimizer_pre.append(fn)         # fn(optimizer) before every optimizer step
    models.on_optimizer_post.append(fn)        # fn(optimizer) after every optimizer step

Everything runs on the training thread, is guarded, reads no device value
and issues no collective.
"""

from __future__ import annotations

import re
import sys
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from rankwatch.config import Config

from ..core import device
from ..core.patching import Patches, after_call
from ..core.safety import guarded, log_once
from ..core.torch_state import compiling
from ..core.weakrefs import WeakList, deref, weak, when_dropped

if TYPE_CHECKING:
    from ..core.ports import StepProgress

MAX_TRACKED = 1_000_000  # modules and parameters remembered from registration, at most


class Root:
    """A user module whose parameters an optimizer updates. The module and its
    DDP wrapper are held weakly (agent/core/weakrefs.py): once the script
    drops the module, ``module`` reads None and the root is forgotten."""

    __slots__ = ("_module", "_ddp", "label", "hooked", "__weakref__")

    def __init__(self, module: Any, label: str = "", ddp: Any = None) -> None:
        self._module = weak(module)
        self._ddp = weak(ddp)
        self.label = label
        self.hooked = False

    @property
    def module(self) -> Any:
        return deref(self._module)

    @property
    def ddp(self) -> Any:
        """The DistributedDataParallel wrapping it, while it lives."""
        return deref(self._ddp)

    @ddp.setter
    def ddp(self, value: Any) -> None:
        self._ddp = weak(value)

    def __repr__(self) -> str:
        return f"Root({self.label!r}, ddp={self.ddp is not None})"


@dataclass
class Forward:
    """One grad-enabled forward of a root, as it ran."""

    root: Root
    args: tuple
    kwargs: dict
    via: str  # "ddp" | "no_sync" | "module" | "direct"
    training: bool = True
    site: Optional[str] = None  # the calling line, only for a forward DDP does not see


class _Hook:
    """A forward hook rankwatch puts on a user's module. A copy of the module
    (``copy.deepcopy(model)`` for an EMA, ``torch.save(model)``) must not take
    rankwatch along: the module's ``__getstate__`` (wrapped in `install`)
    leaves these hooks out, and should a subclass bypass it, a copied hook
    is an inert one.

    Under ``torch.compile`` a hook runs either where the compiled module is
    called from (a DDP wrapper, a user's model class: a frame of its own,
    which dynamo would compile to nothing, the hook returning at once while
    traced) or inside the traced graph (a module under DDP, an ``nn.*``
    container): there it returns at once and adds nothing to the graph, no
    break (``fullgraph=True`` stays possible). Once dynamo is loaded
    (`torch.compile` is wrapped to say so) this class's call frame, and what
    it calls, is left to run eagerly: the first case then works as without
    compile. Without dynamo loaded nothing is asked of it (importing it
    costs ~1 s)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Optional[Callable] = None) -> None:
        self.fn = fn

    def __call__(self, *args, **kwargs):
        fn = self.fn
        return None if fn is None else fn(*args, **kwargs)

    def __deepcopy__(self, memo) -> "_Hook":
        return _Hook()

    def __copy__(self) -> "_Hook":
        return _Hook()

    def __reduce__(self):
        return (_Hook, ())


_RUN_EAGERLY = False


def after_compile() -> None:
    """torch.compile was called (dynamo is loaded): a hook's own frame, and
    every frame it calls, is never compiled. torch 2.6+ (older: the hooks
    are compiled to nothing, and compiled models lose these checks)."""
    global _RUN_EAGERLY
    if _RUN_EAGERLY:
        return
    _RUN_EAGERLY = True
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        set_code_exec_strategy(_Hook.__call__.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    except Exception:
        pass


_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks")
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _ours(hook: Any) -> bool:
    if isinstance(hook, _Hook):
        return True
    owner = getattr(hook, "__self__", None)  # a bound method of one of the agent's parts
    return owner is not None and type(owner).__module__.startswith("rankwatch.agent.")


def without_our_hooks(state: Any) -> Any:
    """A module's pickled state without rankwatch's hooks (the module itself keeps them)."""
    if not isinstance(state, dict):
        return state
    out = state
    for table in _HOOK_TABLES:
        hooks = state.get(table)
        if not hooks or not any(_ours(h) for h in hooks.values()):
            continue
        ids = {k for k, h in hooks.items() if _ours(h)}
        if out is state:
            out = dict(state)
        out[table] = type(hooks)((k, h) for k, h in hooks.items() if k not in ids)
        for flags in _HOOK_FLAGS:
            marks = out.get(flags)
            if marks and ids & set(marks):
                out[flags] = type(marks)((k, v) for k, v in marks.items() if k not in ids)
    return out


def on_host(tensor: torch.Tensor) -> bool:
    """Its values can be read now without a device sync (the device adapter
    says it is a host tensor). Everything else goes through the deferred
    device read (device.DeferredReads). Tests install device.GpuLikeDouble,
    under which no tensor is on the host: the accelerator path was never run
    on a GPU here."""
    return not device.for_tensor(tensor).accelerated()


def unwrap(module: Any) -> tuple[Any, Any]:
    """(the user's module, the DDP wrapper around it or None): through
    DistributedDataParallel and torch.compile's OptimizedModule."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = None
    for _ in range(8):
        if isinstance(module, DistributedDataParallel):
            ddp = module
            module = module.module
        elif type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None),
                                                                         torch.nn.Module):
            module = module._orig_mod
        else:
            break
    return module, ddp


def _own_dirs() -> tuple[str, ...]:
    import os

    import rankwatch

    here = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # agent/, above this room
    return (os.path.dirname(os.path.realpath(torch.__file__)) + os.sep, here + os.sep,
            os.path.dirname(os.path.realpath(rankwatch.__file__)) + os.sep)


_SKIPPED: Optional[tuple[str, ...]] = None
_STDLIB = re.compile(r"[\\/]lib[\\/]python3\.\d+[\\/](?!site-packages|dist-packages)")


_SITE_FILES: dict[str, bool] = {}  # filename -> is the user's (realpath once per file)


def _users(name: str) -> bool:
    import os

    known = _SITE_FILES.get(name)
    if known is None:
        global _SKIPPED
        if _SKIPPED is None:
            _SKIPPED = _own_dirs()
        real = os.path.realpath(name) if not name.startswith("<") else name
        known = not real.startswith(_SKIPPED) and not name.startswith("<") and not _STDLIB.search(real)
        if len(_SITE_FILES) < 4096:
            _SITE_FILES[name] = known
    return known


def user_site(depth: int = 1) -> Optional[str]:
    """'train.py:42': the innermost calling frame outside torch, rankwatch
    and Python's own machinery (asked when a fact changes, not per step)."""
    import os

    try:
        frame = sys._getframe(depth)
    except ValueError:
        return None
    for _ in range(64):
        if frame is None:
            return None
        name = frame.f_code.co_filename
        if _users(name):
            return f"{os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


class TrainedModels:
    """``hook_handles``: where the torch hooks it registers are kept (the
    runtime removes them at uninstall); ``ddp_modules``: the DDP wrappers
    built so far that still live (the runtime's weak list, grown as they are built)."""

    def __init__(self, *, progress: "StepProgress", patches: Patches, hook_handles: list[Any],
                 ddp_modules: WeakList[Any]) -> None:
        self.progress = progress
        self.patches = patches
        self.hook_handles = hook_handles
        self.ddp_modules = ddp_modules
        self._roots: list[Root] = []
        self.version = 0
        self.discovered = False
        self.dirty = False
        self.on_discovered: list[Callable[[], None]] = []
        self.on_training_forward: list[Callable[[Forward], None]] = []
        self.on_training_backward: list[Callable[[list[Forward]], None]] = []
        self.on_optimizer_pre: list[Callable[[Any], None]] = []
        self.on_optimizer_post: list[Callable[[Any], None]] = []
        # Registration records: id -> (weak child, weak parent, name) and id -> (weak param, weak module).
        self._parents: dict[int, tuple[Any, Any, str]] = {}
        self._owners: dict[int, tuple[Any, Any]] = {}
        self._optimizers: list[Any] = []  # weak references, build order
        self._optimizer_ids: set[int] = set()
        self._names: dict[int, str] = {}
        self._params: list[tuple[str, Any]] = []  # (name, weak reference)
        self._optimized: dict[int, tuple[int, int]] = {}
        self._by_module: dict[int, Root] = {}
        self._by_ddp: dict[int, Root] = {}
        self._hooked_ddp: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._ddp_depth = 0
        self._pending: list[Forward] = []  # grad-enabled forwards since the last backward
        self._full = False

    @property
    def roots(self) -> list[Root]:
        """The roots whose module the script still holds."""
        return [root for root in self._roots if root.module is not None]

    def named_parameters(self) -> list[tuple[str, Any]]:
        """(name, parameter) of every root, as of the last discovery; a dropped
        model's are left out (held weakly: its memory is freed)."""
        return [(name, param) for name, ref in self._params if (param := ref()) is not None]

    def _root_of_module(self, module: Any) -> Optional[Root]:
        root = self._by_module.get(id(module))
        return root if root is not None and root.module is module else None

    def _new_root(self, module: Any, label: str = "") -> Root:
        root = Root(module=module, label=label)
        self._by_module[id(module)] = root
        when_dropped(module, self._root_dropped, id(module))
        return root

    def _root_dropped(self, key: int) -> None:
        """The script freed a root's module (any thread: see when_dropped).
        Its entry goes; the next optimizer step finds the roots again."""
        root = self._by_module.get(key)
        if root is not None and root.module is None:
            self._by_module.pop(key, None)
        self.dirty = True

    # -- installation ---------------------------------------------------------------
    def install(self) -> None:
        from torch.nn.modules.module import (register_module_module_registration_hook,
                                             register_module_parameter_registration_hook)
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        handles = self.hook_handles
        handles.append(register_module_module_registration_hook(self._on_module_registered))
        handles.append(register_module_parameter_registration_hook(self._on_param_registered))
        handles.append(register_optimizer_step_pre_hook(self._on_optimizer_pre))
        handles.append(register_optimizer_step_post_hook(self._on_optimizer_post))
        self.progress.backward_extras.append(self._on_backward)
        self.progress.step_extras.append(self._after_step)
        patches = self.patches
        patches.apply(torch.optim.Optimizer, "add_param_group",
                      after_call(lambda _, optimizer=None, *a, **k: optimizer is not None and self._note_optimizer(optimizer)))
        patches.apply(torch.nn.Module, "__getstate__",
                      after_call(lambda state, *a, **k: without_our_hooks(state), replaces_result=True))
        patches.apply(torch, "compile", after_call(lambda *a, **k: after_compile()))

    # -- registration (build time) ------------------------------------------------------
    def _forget(self, table: dict, key: int):
        def gone(_ref) -> None:
            entry = table.get(key)
            if entry is not None and entry[0]() is None:
                table.pop(key, None)

        return gone

    def _room(self) -> bool:
        if len(self._parents) + len(self._owners) < MAX_TRACKED:
            return True
        if not self._full:
            self._full = True
            log_once("models.full", "more than a million modules and parameters built: "
                                    "new ones are not tracked for the silent-error checks")
        return False

    @guarded("models.registration")
    def _on_module_registered(self, parent, name, child) -> None:
        if child is None or not self._room():
            return
        key = id(child)
        self._parents[key] = (weakref.ref(child, self._forget(self._parents, key)), weakref.ref(parent), name)
        if self.discovered and self._climb(parent) in self._by_module_tops():
            self.dirty = True  # a child added to (or replaced in) a trained model

    @guarded("models.registration")
    def _on_param_registered(self, module, name, param) -> None:
        if param is None or not self._room():
            return
        key = id(param)
        self._owners[key] = (weakref.ref(param, self._forget(self._owners, key)), weakref.ref(module))
        if self.discovered and self._climb(module) in self._by_module_tops():
            self.dirty = True  # a parameter added to (or replaced in) a trained model

    def _by_module_tops(self) -> set[int]:
        tops = set()
        for root in self.roots:
            tops.add(id(root.module))
            if root.ddp is not None:
                tops.add(id(root.ddp))
        return tops

    def _climb(self, module: Any) -> int:
        """id of the topmost module holding ``module`` (itself when none does)."""
        for _ in range(256):
            link = self._parents.get(id(module))
            if link is None:
                break
            child, parent, name = link[0](), link[1](), link[2]
            if child is not module or parent is None or getattr(parent, "_modules", {}).get(name) is not module:
                break  # replaced or detached since: no longer its parent's
            module = parent
        return id(module)

    def _top_module(self, module: Any) -> Any:
        for _ in range(256):
            link = self._parents.get(id(module))
            if link is None:
                break
            child, parent, name = link[0](), link[1](), link[2]
            if child is not module or parent is None or getattr(parent, "_modules", {}).get(name) is not module:
                break
            module = parent
        return module

    @guarded("models.optimizers")
    def _note_optimizer(self, optimizer) -> None:
        if id(optimizer) in self._optimizer_ids:
            return
        self._optimizer_ids.add(id(optimizer))
        try:
            self._optimizers.append(weakref.ref(optimizer))
        except TypeError:
            self._optimizers.append(lambda optimizer=optimizer: optimizer)
        if self.discovered:
            self.dirty = True

    # -- DDP ------------------------------------------------------------------------------
    def _root_of_ddp(self, ddp) -> Optional[Root]:
        """The root DDP ``ddp`` wraps (an id alone could be a dropped DDP's, reused)."""
        root = self._by_ddp.get(id(ddp))
        return root if root is not None and root.ddp is ddp else None

    @guarded("models.ddp")
    def on_ddp(self, ddp) -> None:
        """A DistributedDataParallel was built: its module is a root from now on
        (before the first optimizer step names the roots), so the first
        forwards are seen too."""
        inner, _ = unwrap(ddp.module)
        root = self._root_of_module(inner)
        if root is None:
            root = self._new_root(inner, type(inner).__name__)
        root.ddp = ddp
        self._by_ddp[id(ddp)] = root
        self._hook_root(root)
        if root not in self._roots:
            self._roots.append(root)

    @guarded("models.sharded")
    def on_sharded(self, module) -> Any:
        """FSDP2 sharded ``module`` (agent/watch/fsdp.py): the topmost module built
        around it is a root from now on (its forwards are seen from step 0).
        Returns that module."""
        top = self._top_module(module)
        inner, _ = unwrap(top)
        root = self._root_of_module(inner)
        if root is None:
            root = self._new_root(inner, type(inner).__name__)
        self._hook_root(root)
        if root not in self._roots:
            self._roots.append(root)
        return inner

    def _hook_root(self, root: Root) -> None:
        handles = self.hook_handles
        if not root.hooked:
            root.hooked = True
            handles.append(root.module.register_forward_pre_hook(_Hook(self._root_pre), with_kwargs=True))
        # Each DDP wrapper once: a script that rebuilds DDP around the same module (after
        # unfreezing layers, DDP must be built again) gets the new wrapper's hooks too; without
        # them its forwards looked like forwards through `.module` (unreduced_backward).
        if root.ddp is not None and root.ddp not in self._hooked_ddp:
            self._hooked_ddp.add(root.ddp)
            handles.append(root.ddp.register_forward_pre_hook(_Hook(self._ddp_pre), with_kwargs=True))
            handles.append(root.ddp.register_forward_hook(_Hook(self._ddp_post), always_call=True))

    # -- discovery ----------------------------------------------------------------------------
    def optimizers(self) -> list[Any]:
        out = []
        for ref in self._optimizers:
            opt = ref()
            if opt is not None:
                out.append(opt)
        return out

    def name_of(self, param: Any) -> Optional[str]:
        return self._names.get(id(param))

    def optimized(self) -> dict[int, tuple[int, int]]:
        return self._optimized

    @guarded("models.discovery")
    def discover(self) -> None:
        optimizers = self.optimizers()
        optimized: dict[int, tuple[int, int]] = {}
        order: list[Any] = []
        for oi, opt in enumerate(optimizers):
            for gi, group in enumerate(getattr(opt, "param_groups", [])):
                for p in group.get("params", []):
                    if id(p) not in optimized:
                        optimized[id(p)] = (oi, gi)
                        order.append(p)
        self._by_ddp = {key: root for key, root in self._by_ddp.items() if root.ddp is not None}  # dropped DDPs
        ddp_inner = {id(r.module): r for r in self._by_ddp.values()}
        for ddp in self.ddp_modules:
            if self._root_of_ddp(ddp) is None:
                self.on_ddp(ddp)
        tops: dict[int, Any] = {}
        unowned: set[int] = set()
        for p in order:
            entry = self._owners.get(id(p))
            owner = entry[1]() if entry is not None and entry[0]() is p else None
            if owner is None:
                unowned.add(id(p))
                continue
            top = self._top_module(owner)
            tops.setdefault(id(top), top)
        if unowned:
            self._find_owners(unowned, tops)
        roots: list[Root] = []
        seen: set[int] = set()
        for top in tops.values():
            module, ddp = unwrap(top)
            if id(module) in seen:
                continue
            seen.add(id(module))
            root = self._root_of_module(module) or ddp_inner.get(id(module))
            if root is None:
                root = self._new_root(module)
            if ddp is not None and root.ddp is None:
                root.ddp = ddp
                self._by_ddp[id(ddp)] = root
            roots.append(root)
        for root in self._by_ddp.values():  # DDP models whose parameters are optimized (found without registration)
            if id(root.module) not in seen and any(id(p) in optimized for p in root.module.parameters()):
                seen.add(id(root.module))
                roots.append(root)
        labels: dict[str, int] = {}
        for root in roots:
            base = type(root.module).__name__
            labels[base] = labels.get(base, 0) + 1
            root.label = base if labels[base] == 1 else f"{base}{labels[base] - 1}"
        names: dict[int, str] = {}
        params: list[tuple[str, Any]] = []
        prefix = len(roots) > 1
        for root in roots:
            for name, p in root.module.named_parameters():
                if id(p) in names:
                    continue
                full = f"{root.label}.{name}" if prefix else name
                names[id(p)] = full
                params.append((full, p))
        counters: dict[tuple[int, int], int] = {}
        for p in order:
            if id(p) not in names:
                oi, gi = optimized[id(p)]
                k = counters.get((oi, gi), 0)
                counters[(oi, gi)] = k + 1
                names[id(p)] = f"optimizer{oi}.group{gi}.{k}"
        self._roots = roots
        self._names, self._optimized = names, optimized
        self._params = [(name, weakref.ref(p)) for name, p in params]
        for root in roots:
            self._hook_root(root)
        self.discovered = True
        self.dirty = False
        self.version += 1
        for listener in self.on_discovered:
            listener()

    def _find_owners(self, unowned: set[int], tops: dict[int, Any]) -> None:
        """Optimized parameters put in place without the registration hook
        (FSDP2's ``fully_shard`` swaps in DTensor parameters through
        ``module._parameters``; other wrappers do the same): searched for in
        the topmost modules the registration hooks saw being built. At
        discovery only, and bounded."""
        looked: set[int] = set()
        for link in list(self._parents.values())[:100_000]:
            parent = link[1]()
            if parent is None:
                continue
            top = self._top_module(parent)
            if id(top) in looked:
                continue
            looked.add(id(top))
            try:
                held = [id(p) for p in top.parameters()]
            except Exception:
                continue
            if unowned.intersection(held):
                tops.setdefault(id(top), top)
                unowned.difference_update(held)
                if not unowned:
                    return

    # -- hooks (training thread) ------------------------------------------------------------------
    # Dynamo traces these global hooks when optimizer.step is compiled: the
    # first thing they do is ask whether it is tracing, and then do nothing
    # (no graph break; fullgraph=True works). A compiled step is still
    # counted (runtime.py, CompiledSteps); the silent checks skip it.
    def _on_optimizer_pre(self, optimizer, args, kwargs) -> None:
        if torch.compiler.is_compiling():
            return None
        self._before_step(optimizer)
        for listener in self.on_optimizer_pre:
            listener(optimizer)

    @guarded("models.optimizer")
    def _before_step(self, optimizer) -> None:
        self._note_optimizer(optimizer)
        if not self.discovered or self.dirty:
            self.discover()

    def _on_optimizer_post(self, optimizer, args, kwargs) -> None:
        if torch.compiler.is_compiling():
            return None
        for listener in self.on_optimizer_post:
            listener(optimizer)

    @guarded("models.forward")
    def _ddp_pre(self, ddp, args, kwargs) -> None:
        if compiling():
            return None
        self._ddp_depth += 1
        root = self._root_of_ddp(ddp)
        if root is None or not torch.is_grad_enabled():
            return None
        via = "ddp" if getattr(ddp, "require_backward_grad_sync", True) else "no_sync"
        self._forward(Forward(root=root, args=args, kwargs=kwargs, via=via, training=ddp.training))
        return None

    @guarded("models.forward")
    def _ddp_post(self, ddp, args, output) -> None:
        if compiling():
            return None
        self._ddp_depth = max(0, self._ddp_depth - 1)
        return None

    @guarded("models.forward")
    def _root_pre(self, module, args, kwargs) -> None:
        if compiling() or self._ddp_depth > 0 or not torch.is_grad_enabled():
            return None  # inside DDP's forward: seen by its own hook
        root = self._root_of_module(module)
        if root is None:
            return None
        via = "module" if root.ddp is not None else "direct"
        if via == "direct" and not self.ddp_modules:
            self.progress.on_forward(module, args)  # no DDP hook times this rank's steps
        forward = Forward(root=root, args=args, kwargs=kwargs, via=via, training=module.training)
        if via == "module":
            forward.site = user_site()
        self._forward(forward)
        return None

    def _forward(self, forward: Forward) -> None:
        for listener in self.on_training_forward:
            listener(forward)
        forward.args, forward.kwargs = (), {}  # the batch is not kept alive by rankwatch
        if len(self._pending) < 64:
            self._pending.append(forward)

    @guarded("models.backward")
    def _on_backward(self, loss) -> None:
        forwards, self._pending = self._pending, []
        if not forwards:
            return  # a backward of something that is not a trained root (or before discovery)
        for listener in self.on_training_backward:
            listener(forwards)

    @guarded("models.step")
    def _after_step(self, record) -> None:
        """The lead optimizer stepped: forwards not followed by a backward are dropped."""
        self._pending = []


def attach(*, config: Config, progress: "StepProgress", patches: Patches, hook_handles: list[Any],
           ddp_modules: WeakList[Any]) -> Optional[TrainedModels]:
    if not config.silent_checks:
        return None
    models = TrainedModels(progress=progress, patches=patches, hook_handles=hook_handles, ddp_modules=ddp_modules)
    models.install()
    return models
