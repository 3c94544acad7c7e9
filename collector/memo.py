"""A value computed once per object, not once per use.

Every rank's start-up facts arrive as one shared details object
(collector/codec.py): 100,000 ranks hand the analyses and the index the same
dict 100,000 times. What is derived from it (its pairs, its JSON text) is
computed once and shared.
"""

from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class PerObject(Generic[T]):
    """``compute(obj, *args)``, memoised by the object's identity (not its
    value: a dict is neither hashable nor cheap to compare). The memo holds
    the object, so its id is not reused by another while it is there; it is
    cleared past `bound` entries. The values are shared: read them, never
    change them. No lock: each dict operation is atomic, and a race at worst
    computes a value twice."""

    def __init__(self, compute: Callable[..., T], bound: int = 10_000) -> None:
        self._compute = compute
        self._bound = bound
        self._memo: dict[tuple, tuple[Any, T]] = {}

    def __call__(self, obj: Any, *args: Any) -> T:
        key = (id(obj), *args)
        memo = self._memo.get(key)
        if memo is None or memo[0] is not obj:
            if len(self._memo) >= self._bound:
                self._memo.clear()
            memo = self._memo[key] = (obj, self._compute(obj, *args))
        return memo[1]
