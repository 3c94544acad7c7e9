"""Never hurt the job we watch: every hook rankwatch puts into the training
runs through `guarded`, which swallows the exception, logs it once, and turns
the failing part off so it cannot cost time on every step."""

from __future__ import annotations

import functools
import sys
import threading
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

_disabled: set[str] = set()
_lock = threading.Lock()


def log(message: str) -> None:
    try:
        sys.stderr.write(f"[rankwatch] {message}\n")
        sys.stderr.flush()
    except Exception:
        pass


_said: set[str] = set()


def log_once(key: str, message: str) -> None:
    """Say a degradation once per process (a full disk must not flood the job's log)."""
    with _lock:
        if key in _said:
            return
        _said.add(key)
    log(message)


def disable(part: str, exc: BaseException) -> None:
    with _lock:
        if part in _disabled:
            return
        _disabled.add(part)
    log(f"{part} turned off after an internal error (training continues): {type(exc).__name__}: {exc}")


def is_disabled(part: str) -> bool:
    return part in _disabled


def guarded(part: str, default=None) -> Callable[[F], F]:
    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if part in _disabled:
                return default
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # never into the training
                disable(part, exc)
                return default

        return wrapper  # type: ignore[return-value]

    return decorate
