"""Every thread's Python stack, as data (for bundles and stack grouping)."""

from __future__ import annotations

import functools
import os
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Optional

MAX_FRAMES = 64

# The thread that runs the training loop when it is not the process's main
# thread (Ray Train runs train_loop_per_worker in a thread of the worker
# actor); set by rankwatch.ray. Its stack is the one reported as "main".
training_thread_ident: Optional[int] = None


def _own_dirs() -> tuple[str, ...]:
    """The real folders of the installed rankwatch: the package and its
    subpackages agent/ and collector/ (in a source checkout they sit next to
    rankwatch/, not inside it). A user's code in a folder that happens to be
    called "rankwatch" is not ours."""
    import rankwatch

    dirs = {Path(rankwatch.__file__).resolve().parent, Path(__file__).resolve().parents[1]}  # agent/, above core/
    try:  # located, not imported (the collector is not needed in a rank)
        import importlib.util

        spec = importlib.util.find_spec("rankwatch.collector")
        if spec is not None and spec.origin:
            dirs.add(Path(spec.origin).resolve().parent)
    except Exception:
        pass
    return tuple(sorted(str(d) + os.sep for d in dirs))


OWN_DIRS = _own_dirs()


@functools.lru_cache(maxsize=4096)
def _real(filename: str) -> str:
    try:
        return os.path.realpath(filename)
    except (OSError, ValueError):
        return filename


def is_own_file(filename: str) -> bool:
    """A frame in rankwatch's own code, by the installed package's real location."""
    if not filename or filename.startswith("<"):
        return False
    return filename.startswith(OWN_DIRS) or _real(filename).startswith(OWN_DIRS)


def python_stacks() -> list[dict[str, Any]]:
    names = {t.ident: (t.name, t.daemon) for t in threading.enumerate()}
    main_id = training_thread_ident or threading.main_thread().ident
    out = []
    for thread_id, frame in sys._current_frames().items():
        name, daemon = names.get(thread_id, ("<unknown>", False))
        frames = [
            {"file": fs.filename, "line": fs.lineno, "name": fs.name, "code": (fs.line or "")[:200]}
            for fs in traceback.extract_stack(frame)[-MAX_FRAMES:]
        ]
        out.append(
            {
                "thread_id": thread_id,
                "name": name,
                "daemon": daemon,
                "main": thread_id == main_id,
                "frames": frames,  # outermost first, innermost last
            }
        )
    out.sort(key=lambda t: (not t["main"], t["name"]))
    return out


def format_exception(exc: BaseException) -> dict[str, Any]:
    tb = traceback.extract_tb(exc.__traceback__)
    return {
        "type": type(exc).__name__,
        "module": type(exc).__module__,
        "message": str(exc)[:4000],
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-20000:],
        "frames": [{"file": fs.filename, "line": fs.lineno, "name": fs.name} for fs in tb[-MAX_FRAMES:]],
    }
