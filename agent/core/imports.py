"""Patches that wait for the job's own import of a module.

Some of what the agent wraps lives in modules that are slow to import and
that most jobs never use: torch.distributed.checkpoint (~1.3 s on this
project's CPUs, and it pulls in torch.distributed.fsdp) and FSDP itself.
Importing them at install made every rank of every job pay for them before
its first step. ``ImportWatch.when_imported(name, fn)`` calls ``fn(module)``
as soon as the job's import of ``name`` completes (a meta-path finder wraps
that module's ``exec_module``), or at once if it is imported already.
"""

from __future__ import annotations

import importlib.abc
import sys
import types
from typing import Any, Callable

from .safety import guarded

Callback = Callable[[types.ModuleType], None]


class ImportWatch(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._waiting: dict[str, list[Callback]] = {}
        self._finding: set[str] = set()

    def when_imported(self, name: str, fn: Callback) -> None:
        module = sys.modules.get(name)
        if module is not None:
            _call(fn, module)
            return
        self._waiting.setdefault(name, []).append(fn)
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def uninstall(self) -> None:
        self._waiting.clear()
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass

    def find_spec(self, name: str, path: Any = None, target: Any = None):
        if name not in self._waiting or name in self._finding:
            return None
        self._finding.add(name)  # the finders after this one find the real spec
        try:
            spec = None
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        finally:
            self._finding.discard(name)
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec
        watch = self

        def exec_then_call(module: types.ModuleType) -> None:
            exec_module(module)
            for fn in watch._waiting.pop(name, []):
                _call(fn, module)

        loader.exec_module = exec_then_call  # this spec's own loader instance
        return spec


def _call(fn: Callback, module: types.ModuleType) -> None:
    guarded("imports.when_imported")(fn)(module)
