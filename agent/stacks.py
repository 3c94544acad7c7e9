"""Every thread's Python stack, as data (for bundles and stack grouping)."""

from __future__ import annotations

import sys
import threading
import traceback
from typing import Any

MAX_FRAMES = 64


def python_stacks() -> list[dict[str, Any]]:
    names = {t.ident: (t.name, t.daemon) for t in threading.enumerate()}
    main_id = threading.main_thread().ident
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
