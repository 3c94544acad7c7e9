"""Transparent patches of torch functions, and their undoing.

Every wrapper rankwatch installs must accept exactly the calls its original
accepts (positional or keyword, in any mix) and give the same result and the
same errors: frameworks call ``DistributedDataParallel(module=model, ...)``,
``scaler.scale(outputs=loss)``, ``dist.all_reduce(tensor=t, op=...)``. So
wrappers take ``(*args, **kwargs)`` and pass them on untouched; when one needs
a named argument it finds it through the original's signature (computed once,
cached), never by giving its own parameters names that could collide.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

_MISSING = object()


class Patches:
    """The patches one agent installed, so they can be undone (tests, an agent
    detached from a long-lived worker process such as a Ray actor)."""

    def __init__(self) -> None:
        self._applied: list[tuple[Any, str, Any, Any]] = []  # owner, name, original, wrapper

    def apply(self, owner: Any, name: str, make: Callable[[Callable], Callable]) -> Optional[Callable]:
        """Replace ``owner.name`` with ``make(original)``; skip what is missing or already ours."""
        original = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)
        if original is _MISSING or getattr(original, "__rankwatch_wrapped__", False):
            return None
        wrapper = make(original)
        wrapper.__rankwatch_wrapped__ = True  # type: ignore[attr-defined]
        setattr(owner, name, wrapper)
        self._applied.append((owner, name, original, wrapper))
        return wrapper

    def alias(self, owner: Any, name: str, original: Any, wrapper: Any) -> None:
        """``owner.name`` is another reference to a function patched elsewhere
        (``torch.distributed.all_reduce`` is ``distributed_c10d.all_reduce``)."""
        if getattr(owner, name, _MISSING) is original:
            setattr(owner, name, wrapper)
            self._applied.append((owner, name, original, wrapper))

    def adopt(self, owner: Any, name: str, original: Any) -> None:
        """``owner.name`` already holds a wrapper of ours: it was imported
        from a module patched before (``from ._fully_shard import
        fully_shard``). Restored to ``original`` at undo too."""
        wrapper = getattr(owner, name, _MISSING)
        if getattr(wrapper, "__rankwatch_wrapped__", False) and (owner, name) not in self.names():
            self._applied.append((owner, name, original, wrapper))

    def original(self, owner: Any, name: str) -> Any:
        """What ``owner.name`` was before this agent patched it (None if not patched)."""
        for patched_owner, patched_name, original, _ in self._applied:
            if patched_owner is owner and patched_name == name:
                return original
        return None

    def names(self) -> list[tuple[Any, str]]:
        return [(owner, name) for owner, name, _, _ in self._applied]

    def undo(self) -> None:
        for owner, name, original, wrapper in reversed(self._applied):
            if getattr(owner, name, None) is wrapper:  # someone patched over us: leave theirs
                setattr(owner, name, original)
        self._applied.clear()


@functools.lru_cache(maxsize=256)
def after_call(effect: Callable[..., Any], *, replaces_result: bool = False) -> Callable[[Callable], Callable]:
    """A wrapper factory for ``Patches.apply``: the original runs as it
    would, then ``effect(result, *args, **kwargs)``. An exception of the
    effect never reaches the caller (the original's result stands); with
    ``replaces_result``, what the effect returns is given back instead."""
    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            result = original(*args, **kwargs)
            try:
                changed = effect(result, *args, **kwargs)
            except Exception:
                return result
            return changed if replaces_result else result

        return wrapper

    return make


def _signature(fn: Callable) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def argument(fn: Callable, args: tuple, kwargs: dict, index: int) -> Any:
    """The value the call ``fn(*args, **kwargs)`` gives to fn's parameter number
    ``index`` (None when it was not passed). Cheap: a tuple index in the usual
    positional case, a cached signature lookup otherwise."""
    if len(args) > index:
        return args[index]
    if not kwargs:
        return None
    sig = _signature(fn)
    if sig is None:
        return None
    params = list(sig.parameters)
    if index < len(params):
        return kwargs.get(params[index])
    return None


def binding_error(fn: Callable, args: tuple, kwargs: dict) -> bool:
    """``fn(*args, **kwargs)`` is a wrong call (its arguments do not bind to
    fn's signature): it failed before doing anything. Only asked after an
    error, so its cost is off the normal path."""
    sig = _signature(fn)
    if sig is None:
        return False
    try:
        sig.bind(*args, **kwargs)
    except TypeError:
        return True
    return False
