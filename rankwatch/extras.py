"""Optional dependencies (pip extras): one clear line when one is missing.

The base install (``pip install rankwatch``) is what the agent inside every
training process needs. Commands that need more (the aiohttp server,
Grafana's clients, matplotlib, TensorBoard) name the extra that brings it
instead of ending in a ``ModuleNotFoundError`` traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


class MissingExtra(RuntimeError):
    """A command needs a package of an extra that is not installed."""

    def __init__(self, what: str, package: str, extra: str):
        self.package, self.extra = package, extra
        super().__init__(f"{what} needs {package}, which is not installed: pip install 'rankwatch[{extra}]'")


def available(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, package: str, extra: str, what: str) -> ModuleType:
    """Import ``module`` or raise MissingExtra naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (exc.name == module or module.startswith(exc.name + ".")):
            raise MissingExtra(what, package, extra) from None
        raise
