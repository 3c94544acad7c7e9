"""Objects of the job's that the agent watches but must never keep alive.

A DDP model holds its process group through its reducer. When the script
drops it (``del model``) and then calls ``destroy_process_group``, plain
torch frees it at once; if anything of the agent's still held it, it would
be freed only at interpreter shutdown, after the process group, where torch
2.13's gloo sometimes aborts the process ("terminate called without an
active exception", SIGABRT): the agent would have changed the job's exit
code. So the agent refers to DDP wrappers only weakly, and never from an
object that a hook on the same wrapper keeps alive (a reference cycle is
freed only by the cyclic collector, too late the same way).

The same holds for memory: a part that keeps a dropped model's parameters
would keep its device memory, and a script that trains one model, drops it
and builds the next (a sweep, a fine-tune after pre-training) could run out
of memory under the agent where it runs under plain torch. So every part
built for one model is retired when that model is freed (``when_dropped``):
it removes its hooks and callbacks and lets go of the model's tensors.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class WeakList(Generic[T]):
    """The objects appended, in order, while they live. ``added`` counts every
    one ever appended (an index that stays stable when earlier ones die)."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref[Any]] = []
        self.added = 0

    def append(self, obj: T) -> None:
        self._refs = [ref for ref in self._refs if ref() is not None]
        self._refs.append(weakref.ref(obj))
        self.added += 1

    def alive(self) -> list[T]:
        return [obj for obj in (ref() for ref in self._refs) if obj is not None]

    def __iter__(self) -> Iterator[T]:
        return iter(self.alive())

    def __getitem__(self, index: int) -> T:
        return self.alive()[index]

    def __len__(self) -> int:
        return len(self.alive())

    def __bool__(self) -> bool:
        return any(ref() is not None for ref in self._refs)


def weak(obj: Any) -> "weakref.ref[Any] | None":
    return weakref.ref(obj) if obj is not None else None


def deref(ref: "weakref.ref[Any] | None") -> Any:
    return ref() if ref is not None else None


def when_dropped(owner: Any, fn: Callable[..., None], *args: Any) -> None:
    """Call ``fn(*args)`` once ``owner`` is freed, on the thread that frees it
    (the training thread at its ``del``, or whichever thread runs a cyclic
    collection); never at interpreter exit. Neither ``fn`` nor ``args`` may
    refer to ``owner``."""
    try:
        finalizer = weakref.finalize(owner, fn, *args)
    except TypeError:  # an object without weak references: it is never retired
        return
    finalizer.atexit = False


def owner_of(callback: Any) -> Any:
    """The object a registered callback belongs to: a bound method's ``self``,
    also through a ``functools.wraps`` wrapper (``safety.guarded``)."""
    owner = getattr(callback, "__self__", None)
    if owner is None:
        owner = getattr(getattr(callback, "__wrapped__", None), "__self__", None)
    return owner
